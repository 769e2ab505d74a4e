"""Emulated Alibaba Cloud ECS metadata: spot termination time, with the optional hardened mode.

Paths: PUT /latest/api/token (header `X-aliyun-ecs-metadata-token-ttl-seconds`, 1..21600;
403 with `X-Forwarded-For`, 400 for a bad TTL), GET /latest/meta-data/instance/spot/termination-time
(404 with an HTML page while not reclaimed, else the UTC time of the reclaim as
`2015-01-05T18:02:00Z`), GET /latest/meta-data/instance-id (option `instance_id`, default a
random `i-` + 20 lowercase letters and digits per emulated VM).

A GET that carries `X-aliyun-ecs-metadata-token` must carry a valid one (401 otherwise, e.g. once
expired); with option `hardened=True` a GET without a token is refused with 401 as well.
Schedule kind: reclaim (default lead 300 s); canceling it brings the 404 back.
"""
from __future__ import annotations

import secrets
import string
from typing import Any, ClassVar

from aiohttp import web

from spotguard.emulator.clouds.session_tokens import SessionTokens
from spotguard.emulator.clouds.base import CloudHandler
from spotguard.emulator.clouds.timefmt import iso_z

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aliyun-ecs-metadata-token"
MD = "/latest/meta-data"
TERMINATION_PATH = f"{MD}/instance/spot/termination-time"
NOT_FOUND_HTML = ("<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n"
                  "<center><h1>404 Not Found</h1></center>\r\n</body>\r\n</html>\r\n")


class Handler(CloudHandler):
    name = "alibaba"
    kinds = ("reclaim",)
    default_lead: ClassVar[dict[str, float]] = {"reclaim": 300.0}

    def __init__(self, hardened: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.hardened = hardened
        self.session = SessionTokens(TTL_HEADER, TOKEN_HEADER, allow_tokenless=not hardened)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.put(TOKEN_PATH, self.session.issue),
            web.get(TERMINATION_PATH, self.session.guard(self._termination_time)),
            web.get(f"{MD}/instance-id", self.session.guard(self._instance_id)),
        ]

    def expire_tokens(self) -> None:
        self.session.expire()

    def malformed_body(self, path: str) -> bytes:
        return b"2015-01-05T18:0"

    async def _termination_time(self, request: web.Request) -> web.Response:
        live = [n for n in self.state.visible() if n.kind == "reclaim"]
        if not live:
            return web.Response(status=404, text=NOT_FOUND_HTML, content_type="text/html")
        return web.Response(text=iso_z(live[-1].deadline), content_type="text/plain")

    async def _instance_id(self, request: web.Request) -> web.Response:
        return web.Response(text=self.instance_id, content_type="text/plain")

    @staticmethod
    def new_instance_id() -> str:
        return "i-" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(20))
