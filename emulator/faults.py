"""Faults the emulator injects into cloud-facing requests, one rule at a time.

A rule matches requests whose path starts with `path` (default: any cloud path) and applies to
the next `count` of them (default 1; 0 means until cleared). Kinds:
- latency: delay the answer by `seconds`;        - hang: never answer (until the client gives up);
- status: answer `status` (5xx, 429, ...), with `Retry-After: <retry_after>` when given;
- malformed: 200 with a corrupt body;
- oversized: 200 with a body of `bytes` (default 1 MiB);
- drop: close the connection without an answer;  - expired-token: invalidate issued tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

KINDS = ("latency", "hang", "status", "malformed", "oversized", "drop", "expired-token")


class FaultSpecError(ValueError):
    """A fault request is invalid; the message names the field."""


@dataclass
class FaultRule:
    id: str
    kind: str
    path: str
    remaining: int | None  # None: until cleared
    seconds: float = 0.0
    status: int = 503
    size: int = 1 << 20
    retry_after: int | None = None

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "path": self.path, "remaining": self.remaining,
                "seconds": self.seconds, "status": self.status, "bytes": self.size, "retry_after": self.retry_after}


def _number(spec: dict, key: str, default: float, low: float, high: float) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise FaultSpecError(f"{key}: expected a number in [{low}, {high}], got {value!r}")
    return value


class FaultTable:
    """The active fault rules, matched in the order they were added."""

    def __init__(self) -> None:
        self.rules: list[FaultRule] = []
        self._ids = itertools.count(1)

    def add(self, spec: Any) -> FaultRule:
        if not isinstance(spec, dict):
            raise FaultSpecError("fault: expected a JSON object")
        kind = spec.get("kind")
        if kind not in KINDS:
            raise FaultSpecError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        path = spec.get("path", "/")
        if not isinstance(path, str) or not path.startswith("/"):
            raise FaultSpecError(f"path: expected a path starting with '/', got {path!r}")
        count = int(_number(spec, "count", 1, 0, 1_000_000))
        rule = FaultRule(
            id=f"f{next(self._ids)}", kind=kind, path=path, remaining=None if count == 0 else count,
            seconds=float(_number(spec, "seconds", 3600.0 if kind == "hang" else 0.5, 0, 86400)),
            status=int(_number(spec, "status", 503, 100, 599)),
            size=int(_number(spec, "bytes", 1 << 20, 0, 64 << 20)),
            retry_after=None if spec.get("retry_after") is None else int(_number(spec, "retry_after", 0, 0, 86400)),
        )
        self.rules.append(rule)
        return rule

    def take(self, path: str) -> FaultRule | None:
        """Returns the first rule matching `path` and uses up one of its count."""
        for rule in self.rules:
            if path.startswith(rule.path):
                if rule.remaining is not None:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self.rules.remove(rule)
                return rule
        return None

    def clear(self) -> None:
        self.rules.clear()
