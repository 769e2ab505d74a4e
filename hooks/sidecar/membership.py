"""The job's membership as the supervisor pushes it: pod annotation -> downward-API file.

The kubelet writes a pod's annotations into a downward-API volume file as lines
`key="value"`, the value quoted as Go's `%q` does (strconv.Quote: `\\n`, `\\"`, `\\\\`, `\\xHH`,
`\\uHHHH`, `\\UHHHHHHHH`, octal `\\ooo`, ...). `parse_downward_annotations` undoes exactly that
and rejects anything else with `AnnotationFormatError` naming the line.

`spotguard.io/membership` holds `{"v": 1, "generation": n, "hosts": [...], "world_size": n}`
and optionally `"drain": "<id>"`, the supervisor asking every member to checkpoint and drain
(a return from on-demand to spot capacity; the sidecar turns it into a `drain` notice)
(`Membership`). `AnnotationWatcher` polls the file (stat signature, then content, read in a
thread) and calls back with each new valid membership; a missing file means "none yet", and a
malformed file or value is logged and ignored, keeping the last good membership.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

MEMBERSHIP_KEY = "spotguard.io/membership"
ANNOTATIONS_FILE = "annotations"
MAX_FILE_BYTES = 1 << 20
MAX_DRAIN_ID = 256

_SIMPLE_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, '"': 34}
_HEX = "0123456789abcdefABCDEF"


class AnnotationFormatError(ValueError):
    """The downward-API annotations file is malformed; the message names the line."""


class MembershipFormatError(ValueError):
    """A membership value is not the versioned JSON object; the message names the field."""


def unquote_go(literal: str) -> str:
    """The string a Go interpreted string literal (`"..."`, as strconv.Quote writes) denotes."""
    if len(literal) < 2 or literal[0] != '"' or literal[-1] != '"':
        raise ValueError("not a double-quoted string")
    body = literal[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            raise ValueError(f"unescaped quote at offset {i + 1}")
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("backslash at the end of the string")
        code = body[i + 1]
        if code in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[code])
            i += 2
        elif code in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[code]
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or any(d not in _HEX for d in digits):
                raise ValueError(f"\\{code} needs {width} hex digits at offset {i + 1}")
            value = int(digits, 16)
            if code == "x":
                out.append(value)
            else:
                if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                    raise ValueError(f"\\{code}{digits} is not a valid code point")
                out += chr(value).encode("utf-8")
            i += 2 + width
        elif code in "01234567":
            digits = body[i + 1:i + 4]
            if len(digits) != 3 or any(d not in "01234567" for d in digits) or int(digits, 8) > 255:
                raise ValueError(f"octal escape needs 3 digits <= 377 at offset {i + 1}")
            out.append(int(digits, 8))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{code} at offset {i + 1}")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("escapes do not form UTF-8 text") from None


def parse_downward_annotations(text: str) -> dict[str, str]:
    """Parses the kubelet's `key="value"` lines; AnnotationFormatError names the bad line."""
    result: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip() == "":
            continue
        key, sep, quoted = line.partition("=")
        if not sep or not key or key != key.strip():
            raise AnnotationFormatError(f"line {number}: expected key=\"value\", got {line!r:.120}")
        try:
            result[key] = unquote_go(quoted.rstrip("\r"))
        except ValueError as exc:
            raise AnnotationFormatError(f"line {number} ({key}): {exc}") from None
    return result


def _whole(obj: dict, name: str, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MembershipFormatError(f"{name}: expected a whole number >= {minimum}, got {value!r:.40}")
    return value


@dataclass(frozen=True)
class Membership:
    """Which hosts make up the job, generation `generation` (larger is newer)."""

    generation: int
    hosts: tuple[str, ...]
    world_size: int
    drain: str = ""  # the supervisor's drain request id ("" when none)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"v": 1, "generation": self.generation, "hosts": list(self.hosts),
                                "world_size": self.world_size}
        if self.drain:
            wire["drain"] = self.drain
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> Membership:
        if not isinstance(obj, dict):
            raise MembershipFormatError(f"membership: expected a JSON object, got {type(obj).__name__}")
        if obj.get("v") != 1 or isinstance(obj.get("v"), bool):
            raise MembershipFormatError(f"v: unsupported version {obj.get('v')!r:.20} (expected 1)")
        generation = _whole(obj, "generation", 0)
        world_size = _whole(obj, "world_size", 0)
        hosts = obj.get("hosts")
        if not isinstance(hosts, list) or any(not isinstance(h, str) or not h or h != h.strip() for h in hosts):
            raise MembershipFormatError("hosts: expected a list of non-empty host names")
        if len(set(hosts)) != len(hosts):
            raise MembershipFormatError("hosts: a host is listed twice")
        drain = obj.get("drain", "")
        if not isinstance(drain, str) or len(drain) > MAX_DRAIN_ID or drain != drain.strip():
            raise MembershipFormatError(f"drain: expected a request id of at most {MAX_DRAIN_ID} characters")
        return cls(generation, tuple(hosts), world_size, drain)

    @classmethod
    def from_json(cls, text: str) -> Membership:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise MembershipFormatError(f"membership: not JSON ({exc})") from None
        return cls.from_wire(obj)


def read_membership(path: str) -> Membership | None:
    """The membership in a downward-API annotations file (blocking); None if absent.

    Raises AnnotationFormatError / MembershipFormatError for a malformed file or value.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_FILE_BYTES:
        raise AnnotationFormatError(f"file larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AnnotationFormatError("file is not UTF-8") from None
    value = parse_downward_annotations(text).get(MEMBERSHIP_KEY)
    return None if value is None else Membership.from_json(value)


def _signature(path: str) -> tuple | None:
    try:
        st = os.stat(path)  # follows the kubelet's ..data symlink swap
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class AnnotationWatcher:
    """Polls `<podinfo_dir>/annotations` every `interval` s; calls `on_change(membership)`.

    The callback runs for the first valid membership and for every later one that differs.
    Malformed content is logged once per change of the file and leaves the last one in force;
    a vanished annotation also keeps the last membership (the supervisor never un-sets it).
    """

    def __init__(self, podinfo_dir: str, on_change: Callable[[Membership], Awaitable[None]],
                 interval: float = 1.0):
        self.path = os.path.join(podinfo_dir, ANNOTATIONS_FILE)
        self.on_change = on_change
        self.interval = interval
        self.current: Membership | None = None
        self._signature: tuple | None = None

    async def check(self) -> bool:
        """Reads the file if its stat signature changed; True when the membership changed."""
        signature = await asyncio.to_thread(_signature, self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            membership = await asyncio.to_thread(read_membership, self.path)
        except (AnnotationFormatError, MembershipFormatError, OSError) as exc:
            log.error("ignoring malformed membership in %s: %s", self.path, exc)
            return False
        if membership is None or membership == self.current:
            return False
        self.current = membership
        await self.on_change(membership)
        return True

    async def run(self) -> None:
        """Polls until cancelled; never raises for bad input."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch loop must not die
                log.exception("membership watch failed; retrying")
                self._signature = None
            await asyncio.sleep(self.interval)
