"""Server-Sent Events framing, shared by every stream in spotguard (agent, sidecar, Guard).

`encode(event, data, id)` makes one frame; `SSEDecoder.feed(chunk)` turns bytes from any
transport (aiohttp, a blocking socket) into complete events. The decoder bounds its buffer:
a line longer than `max_line` raises `SSEError` instead of growing without limit.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KEEPALIVE = b": keepalive\n\n"


class SSEError(ValueError):
    """The byte stream is not valid SSE within our limits."""


@dataclass(frozen=True)
class SSEEvent:
    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        """The data parsed as JSON; ValueError if it is not."""
        return json.loads(self.data)


def encode(event: str, data: Any, id: int | str | None = None) -> bytes:
    """One SSE frame; `data` is JSON-encoded unless it is already a string."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    lines.append(f"event: {event}")
    lines.extend(f"data: {part}" for part in text.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


class SSEDecoder:
    """Incremental SSE parser (the subset we emit: id, event, data, comments)."""

    def __init__(self, max_line: int = 1 << 20):
        self.max_line = max_line
        self._buffer = b""
        self._event = "message"
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                if len(self._buffer) > self.max_line:
                    raise SSEError(f"line longer than {self.max_line} bytes")
                return events
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1:]
            try:
                line = raw.rstrip(b"\r").decode("utf-8")
            except UnicodeDecodeError:
                raise SSEError("line is not UTF-8") from None
            if line == "":
                if self._data:
                    events.append(SSEEvent(self._event, "\n".join(self._data), self._id))
                self._event, self._data, self._id = "message", [], None
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                self._event = value
            elif name == "data":
                self._data.append(value)
            elif name == "id":
                self._id = value
