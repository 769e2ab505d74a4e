"""Reports hook phases and timing to the sidecar: `POST /v1/hooks` (docs/protocols.md, "Sidecar";
the body is `wire.hook_report.HookReport`).

Contract: `HookReporter.report(...)` sends one report with the bearer token read from
`SPOTGUARD_TOKEN_FILE` and returns True on a 2xx answer. It never raises: a missing sidecar,
token or a refused report is logged (the checkpoint is what matters; the report only lets the
preStop hook end early). The body carries the protocol's fields plus `steps_lost` and
`saved_step`; if the sidecar rejects the body (400), it is sent again with the protocol fields only.
"""
from __future__ import annotations

import http.client
import json
import logging
import urllib.parse
from pathlib import Path

from spotguard.wire.hook_report import HookReport

log = logging.getLogger("spotguard.hooks.report")

HOOKS_PATH = "/v1/hooks"


class HookReporter:
    """Posts phase reports (`checkpoint-durable`, `drained`, `failed`) for one rank."""

    def __init__(self, url: str, token_file: str | None, rank: int, world_size: int, timeout: float = 2.0):
        self.url = url.rstrip("/")
        self._parsed = urllib.parse.urlsplit(self.url)
        self.token_file = token_file
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.sent: list[dict] = []

    def _token(self) -> str | None:
        if not self.token_file:
            return None
        try:
            return Path(self.token_file).read_text().strip() or None
        except OSError as exc:
            log.warning("cannot read SPOTGUARD_TOKEN_FILE %s: %s", self.token_file, exc)
            return None

    def report(self, notice_id: str, step: int, phase: str, seconds: float, **extra) -> bool:
        protocol = HookReport(notice_id, self.rank, self.world_size, int(step), phase, round(float(seconds), 6))
        body = {**protocol.to_wire(), **extra}
        status = self._post(body)
        if status == 400 and extra:
            status = self._post(protocol.to_wire())
        ok = status is not None and 200 <= status < 300
        if ok:
            self.sent.append(body)
        else:
            log.warning("sidecar did not accept the %s report for notice %s (status %s)", phase, notice_id, status)
        return ok

    def _post(self, body: dict) -> int | None:
        headers = {"Content-Type": "application/json"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        host = self._parsed.hostname
        if host is None:
            log.warning("cannot report to the sidecar: %r names no host", self.url)
            return None
        cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = cls(host, self._parsed.port, timeout=self.timeout)
        try:
            conn.request("POST", self._parsed.path.rstrip("/") + HOOKS_PATH, body=json.dumps(body), headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException) as exc:
            log.warning("cannot report to the sidecar at %s: %s", self.url, exc)
            return None
        finally:
            conn.close()
