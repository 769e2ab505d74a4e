"""Prefer spot, fall back to on-demand, come back: the job's fallback annotations and the
on-demand form of its scheduling directives, as pure functions. The moves themselves are rows
of the policy's transitions (fallback_moves.py).

Annotations: `spotguard.io/fallback: on-demand` opts in; `spotguard.io/fallback-after` (default
10m) and `spotguard.io/return-after` (default 5m) are durations ("90s", "10m", "1h30m", "500ms",
or plain seconds). The job's pod template must select spot capacity through a label of
capacity_type.py (checked by the controller).

The move decisions (fallback, return, and the clocks between) are rows of `policy.TRANSITIONS`:
fallback_moves.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping

from spotguard.config import ConfigError
from spotguard.supervisor import capacity_type
from spotguard.wire import names

ON_DEMAND, SPOT = capacity_type.ON_DEMAND, capacity_type.SPOT
DEFAULT_FALLBACK_AFTER = 600.0
DEFAULT_RETURN_AFTER = 300.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Fallback:
    """A job's validated fallback settings (seconds)."""

    after: float = DEFAULT_FALLBACK_AFTER
    return_after: float = DEFAULT_RETURN_AFTER


def parse_duration(field: str, raw: object) -> float:
    """Seconds > 0 from a Go-style duration ("1h30m", "90s", "500ms") or plain seconds; else
    ConfigError naming `field`."""
    text = str(raw).strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        seconds = sum(float(n) * _UNITS[u] for n, u in parts) if "".join(n + u for n, u in parts) == text else -1.0
    if not (0 < seconds < float("inf")):
        raise ConfigError(field, f"expected a duration > 0 such as 90s, 10m or 1h30m, got {raw!r}")
    return seconds


def parse_fallback(annotations: Mapping[str, str]) -> Fallback | None:
    """The job's fallback settings, None when it did not opt in; ConfigError names a bad annotation."""
    raw = annotations.get(names.ANN_FALLBACK)
    if raw is None:
        return None
    if str(raw).strip() != ON_DEMAND:
        raise ConfigError(names.ANN_FALLBACK, f"expected {ON_DEMAND!r}, got {raw!r}")
    after, back = DEFAULT_FALLBACK_AFTER, DEFAULT_RETURN_AFTER
    if names.ANN_FALLBACK_AFTER in annotations:
        after = parse_duration(names.ANN_FALLBACK_AFTER, annotations[names.ANN_FALLBACK_AFTER])
    if names.ANN_RETURN_AFTER in annotations:
        back = parse_duration(names.ANN_RETURN_AFTER, annotations[names.ANN_RETURN_AFTER])
    return Fallback(after, back)


def on_demand_directives(directives: Mapping[str, Mapping]) -> dict[str, dict] | None:
    """Per pod role, the on-demand form of its directives (roles selecting no spot stay as they
    are); None when no role selects spot capacity."""
    out: dict[str, dict] = {}
    switched = False
    for role, current in directives.items():
        moved = capacity_type.to_on_demand(current)
        switched = switched or moved is not None
        out[role] = moved if moved is not None else dict(current)
    return out if switched else None
