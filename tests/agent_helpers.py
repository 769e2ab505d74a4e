"""Helpers for the node agent tests: a queue-fed Source, an SSE reader, an exposition checker,
and a subprocess runner for `spotguard agent`."""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta, UTC
from typing import Any

import aiohttp

from spotguard.agent.sources.base import Source, SourceError
from spotguard.wire.notice import Kind, Notice, now_utc
from spotguard.wire.sse import SSEDecoder, SSEEvent


class FedSource(Source):
    """A real Source whose reads come from a queue: `show(*notices)` is one successful read,
    `fail(reason)` a failed one. Not a mock: it runs through Source.run() like any source."""

    def __init__(self, name: str, node: str = "n1"):
        super().__init__(node, interval=0.0)
        self.name = name
        self._reads: asyncio.Queue = asyncio.Queue()

    def show(self, *notices: Notice) -> None:
        self._reads.put_nowait(list(notices))

    def fail(self, reason: str = "timeout") -> None:
        self._reads.put_nowait(SourceError(reason, "fed failure"))

    async def poll(self) -> list[Notice]:
        item = await self._reads.get()
        if isinstance(item, Exception):
            raise item
        return item


class ApprovingSource(FedSource):
    """A FedSource that can approve events early (like Azure's), recording what it approved."""

    def __init__(self, name: str = "test.approving", node: str = "n1"):
        super().__init__(name, node)
        self.approved: list[str] = []

    async def approve(self, event_id: str) -> None:
        self.approved.append(event_id)


def make_notice(nid: str, source: str = "test.a", deadline_in: float | None = 120.0, node: str = "n1",
                kind: Kind = Kind.RECLAIM, detail: dict | None = None) -> Notice:
    now = now_utc()
    deadline = None if deadline_in is None else (now + timedelta(seconds=deadline_in)).replace(microsecond=0)
    return Notice(id=nid, kind=kind, source=source, node=node, detected_at=now, deadline=deadline,
                  detail=detail or {})


class SSEReader:
    """Reads events from an open `GET /v1/stream` response."""

    def __init__(self, response: aiohttp.ClientResponse):
        self.response = response
        self.decoder = SSEDecoder()
        self.pending: list[SSEEvent] = []

    async def next(self, timeout: float = 5.0) -> SSEEvent | None:
        """The next event; None at end of stream."""
        async def read() -> SSEEvent | None:
            while not self.pending:
                chunk = await self.response.content.readany()
                if not chunk:
                    return None
                self.pending.extend(self.decoder.feed(chunk))
            return self.pending.pop(0)
        return await asyncio.wait_for(read(), timeout)

    async def until(self, predicate, timeout: float = 5.0) -> SSEEvent:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            event = await self.next(max(0.01, end - loop.time()))
            if event is None:
                raise AssertionError("stream ended")
            if predicate(event):
                return event


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)?\})? (\S+)$')
_TYPE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$")
_HELP = re.compile(r"^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .*$")


def parse_exposition(text: str) -> dict[str, float]:
    """Checks every line is valid Prometheus text format; returns {'name{labels}': value}."""
    assert text.endswith("\n"), "exposition must end with a newline"
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            m = _TYPE.match(line)
            if m:
                assert m.group(1) not in types, f"TYPE twice: {line}"
                types[m.group(1)] = m.group(2)
                continue
            assert _HELP.match(line), f"bad comment line: {line!r}"
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, value = m.group(1), m.group(4)
        family = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert name in types or family in types or (family + "_total") in types, f"sample before TYPE: {line!r}"
        number = float(value.replace("+Inf", "inf").replace("-Inf", "-inf"))
        assert not math.isnan(number) or value == "NaN"
        key = name + (m.group(2) or "")
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = number
    return samples


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotguard", "agent", *args]


class AgentProcess:
    """`spotguard agent` as a subprocess; `address` once it announced itself. Kill by PID."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen(agent_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=REPO)
        self.address = ""

    async def started(self, timeout: float = 20.0) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise AssertionError(f"agent exited: {self.proc.wait(5)} {self.proc.stderr.read().decode()[-2000:]}")
        info = json.loads(line)
        assert info["event"] == "listening"
        self.address = info["listen"]
        return self.address

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def terminate(self, timeout: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


async def wait_for(predicate, timeout: float = 5.0, pause: float = 0.02) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(pause)


def utc_seconds(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
