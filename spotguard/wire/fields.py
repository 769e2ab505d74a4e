"""The checks every wire codec makes, written once: the versioned JSON object envelope and whole
numbers. Each takes the codec's own error class, so a caller still catches the error of the
message it reads, and the message names the field."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def versioned_object(obj: Any, version: int, error: type[ValueError], what: str,
                     label: str = "version") -> Mapping[str, Any]:
    """`obj` as a mapping whose `v` is `version` (not a bool); else `error` naming `what` or `v`."""
    if not isinstance(obj, Mapping):
        raise error(f"{what}: expected a JSON object, got {type(obj).__name__}")
    found = obj.get("v")
    if found != version or isinstance(found, bool):
        raise error(f"v: unsupported {label} {found!r:.20} (expected {version})")
    return obj


def whole(obj: Mapping[str, Any], name: str, minimum: int, error: type[ValueError],
          optional: bool = False) -> Any:
    """The whole number (not a bool) `obj[name]` >= `minimum`; None when absent and `optional`."""
    value = obj.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name}: expected a whole number >= {minimum}, got {value!r:.40}")
    return value
