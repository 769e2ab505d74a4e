"""The job's membership as the supervisor pushes it: pod annotation -> downward-API file.

The kubelet writes a pod's annotations into a downward-API volume file as lines
`key="value"`, the value quoted as Go's `%q` does (strconv.Quote: `\\n`, `\\"`, `\\\\`, `\\xHH`,
`\\uHHHH`, `\\UHHHHHHHH`, octal `\\ooo`, ...). `parse_downward_annotations` undoes exactly that
and rejects anything else with `AnnotationFormatError` naming the line.

`spotguard.io/membership` holds a `wire.membership.Membership` (the supervisor writes it).
`AnnotationWatcher` polls the file (stat signature, then content, read in a
thread) and calls back with each new valid membership; a missing file means "none yet", and a
malformed file or value is logged and ignored, keeping the last good membership.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from spotguard.wire import names
from spotguard.wire.membership import Membership, MembershipFormatError

log = logging.getLogger(__name__)

ANNOTATIONS_FILE = "annotations"
MAX_FILE_BYTES = 1 << 20

_SIMPLE_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, '"': 34}
_HEX = "0123456789abcdefABCDEF"


class AnnotationFormatError(ValueError):
    """The downward-API annotations file is malformed; the message names the line."""


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
    value = parse_downward_annotations(text).get(names.ANN_MEMBERSHIP)
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
