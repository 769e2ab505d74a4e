"""JSON from untrusted bytes: strict UTF-8, bounded nesting, every failure a ValueError.

`loads(raw, max_depth)` refuses a document nested deeper than `max_depth` before parsing it
(the standard parser would recurse once per level and could end in a RecursionError), and
decodes only UTF-8 (the standard parser also guesses UTF-16/32 from bytes). The depth scan is
linear in the input and looks only at brackets, quotes and backslashes.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32
_SPECIAL = re.compile(r'[\[\]{}"\\]')


class JSONInputError(ValueError):
    """The input is not acceptable JSON; the message says why (never echoes the input)."""


def exceeds_depth(text: str, limit: int) -> bool:
    """True when some array/object in `text` nests deeper than `limit` (strings ignored)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    in_string = False
    escaped_at = -1  # index of a character a backslash escapes
    for match in _SPECIAL.finditer(text):
        ch, at = match.group(), match.start()
        if in_string:
            if at == escaped_at:
                continue
            if ch == "\\":
                escaped_at = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def loads(raw: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """Parses `raw`; JSONInputError if it is not UTF-8, nests deeper than `max_depth`, or is
    not JSON."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise JSONInputError("not UTF-8") from None
    else:
        text = raw
    if exceeds_depth(text, max_depth):
        raise JSONInputError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONInputError(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise JSONInputError(f"not JSON ({exc})") from None
