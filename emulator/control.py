"""A client for the emulator's control API, over HTTP like any other caller."""
from __future__ import annotations

from typing import Any

import aiohttp


class EmulatorControlError(RuntimeError):
    pass


class EmulatorControl:
    """Schedules notices and faults on a running emulator. Use as an async context manager."""

    def __init__(self, url: str, token: str):
        self.url = url.rstrip("/") + "/_emulator"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EmulatorControl:
        self._session = aiohttp.ClientSession(trust_env=False, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False, headers=self._headers)
        async with self._session.request(method, self.url + path, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise EmulatorControlError(f"{method} {path}: {resp.status} {data}")
            return data

    async def schedule(self, kind: str, *, in_: float = 0.0, lead: float | None = None, **fields: Any) -> dict:
        body = {"kind": kind, "in": in_, **fields}
        if lead is not None:
            body["lead"] = lead
        return await self._call("POST", "/notices", body)

    async def cancel(self, notice_id: str) -> dict:
        return await self._call("DELETE", f"/notices/{notice_id}")

    async def notices(self) -> list[dict]:
        return (await self._call("GET", "/notices"))["notices"]

    async def fault(self, kind: str, **fields: Any) -> dict:
        return await self._call("POST", "/faults", {"kind": kind, **fields})

    async def clear_faults(self) -> None:
        await self._call("DELETE", "/faults")

    async def reset(self) -> None:
        await self._call("POST", "/reset")

    async def instance_id(self) -> str:
        return (await self._call("GET", "/instance"))["instance_id"]

    async def replace_instance(self, instance_id: str | None = None) -> str:
        """Re-creates the emulated VM under the same name; returns its new instance id."""
        body = {} if instance_id is None else {"instance_id": instance_id}
        return (await self._call("POST", "/instance", body))["instance_id"]

    async def request_counts(self) -> dict:
        return await self._call("GET", "/requests")
