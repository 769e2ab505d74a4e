"""The GPU health policy: what each Xid and each NVML signal means, as data.

Actions:
- `ignore`: nothing (counted only);
- `warn`: a warning (metric + Node Event), no notice;
- `cordon`: a warning that also recommends cordoning (detail `"cordon": true`), no notice;
- `fatal`: a notice of kind gpu-fault with deadline now (checkpoint + drain);
- `recovery` (Xids only): read the recovery-action field now and act on it (Xid 154).

The defaults are the Xid table of the GPU-health fact sheet (shared/reference/gpu-health.md).
Overrides are a mapping (from YAML or JSON, `--gpu-policy FILE`), merged over the defaults key by
key:
```yaml
xid:                      # an Xid, a range "144-150" or a list "13,31" -> action
  "109": fatal
  "13": warn
xid_default: warn         # any Xid not in the table (999 = unknown)
escalate:                 # a warning Xid that repeats `count` times within `window_seconds` -> fatal
  "109": {count: 3, window_seconds: 600}
signals:                  # persistent and event signals -> action (see SIGNALS)
  remap_pending: cordon
thresholds:
  uncorrectable_rows: 512     # remapped uncorrectable rows at which the GPU is failed
  shutdown_margin_c: 3        # within this many degrees of the shutdown threshold: emergency
  clock_reasons_mask: 0xC8    # clock-event bits that warn (HwSlowdown|HwThermal|HwPowerBrake)
```
A bad entry raises ConfigError naming it (e.g. `--gpu-policy: xid.79: unknown action 'boom'`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard
from collections.abc import Mapping

from spotguard.agent.gpu.datafile import load_data
from spotguard.config import ConfigError

ACTIONS = ("ignore", "warn", "cordon", "fatal", "recovery")
SIGNAL_ACTIONS = ("ignore", "warn", "cordon", "fatal")

# (xids, action, remedy, meaning): gpu-health.md's Xid classification.
DEFAULT_XID_TABLE: tuple[tuple[str, str, str, str], ...] = (
    ("13,31,43,45,68", "ignore", "none", "application error"),
    ("8,11,25,32,39-41,69-72,75-77,80,82-86,88,89,96-105,126-135,139", "ignore", "restart-app",
     "channel / copy-engine / video-engine error"),
    ("109", "warn", "drain-if-repeats", "context-switch timeout"),
    ("63", "cordon", "reset-when-idle", "row remap / page retirement recorded, reset needed"),
    ("92", "warn", "none", "excessive single-bit ECC"),
    ("94", "warn", "restart-app", "contained ECC error"),
    ("154", "recovery", "see-recovery-action", "recovery action changed"),
    ("46,48,62,64,74,95,110,119,120,136,140,143,144-150,155,156,158", "fatal", "reset",
     "GPU timeout, double-bit ECC, PMU halt, remap failure, NVLink, uncontained ECC, GSP or init error"),
    ("79,160", "fatal", "reboot", "GPU fell off the bus / channel retirement"),
    ("151", "fatal", "restart-vm", "confidential-computing key rotation"),
    ("54", "fatal", "hardware-ticket", "aux power not connected"),
)

# Signal name -> (default action, meaning).
SIGNALS: dict[str, tuple[str, str]] = {
    "gpu_lost": ("fatal", "NVML reports the GPU is lost"),
    "gpu_count_drop": ("fatal", "fewer GPUs than expected"),
    "recovery_action": ("fatal", "the driver asks for a recovery action"),
    "double_bit_ecc": ("fatal", "volatile double-bit (uncorrected) ECC errors"),
    "remap_failure": ("fatal", "row remapping failed"),
    "uncorrectable_rows": ("fatal", "too many uncorrectable remapped rows"),
    "fatal_poison": ("fatal", "fatal poison error event"),
    "gpu_unavailable": ("fatal", "GPU unavailable event"),
    "dram_retirement_failure": ("fatal", "DRAM retirement failure event"),
    "thermal_shutdown": ("fatal", "temperature within the margin of the shutdown threshold"),
    "remap_pending": ("cordon", "row remap pending: reset needed"),
    "dram_retirement": ("warn", "DRAM page retirement event"),
    "sbe_storm": ("warn", "single-bit ECC storm"),
    "nonfatal_poison": ("warn", "non-fatal poison error event"),
    "clock_slowdown": ("warn", "hardware clock slowdown"),
    "thermal_slowdown": ("warn", "temperature at or above the slowdown threshold"),
}

DEFAULT_THRESHOLDS = {"uncorrectable_rows": 512, "shutdown_margin_c": 3, "clock_reasons_mask": 0xC8}
DEFAULT_ESCALATE = {"109": {"count": 3, "window_seconds": 600}}


@dataclass(frozen=True)
class XidRule:
    """What one Xid means: its action, the remedy the sheet recommends, and a short meaning."""

    action: str
    remedy: str
    meaning: str


@dataclass(frozen=True)
class Escalation:
    count: int
    window_seconds: float


class GpuPolicy:
    """A validated policy. Build with `GpuPolicy()` (defaults), `from_data(...)` or `load(path)`."""

    def __init__(self, xid: Mapping[int, XidRule] | None = None, xid_default: str = "warn",
                 escalate: Mapping[int, Escalation] | None = None, signals: Mapping[str, str] | None = None,
                 thresholds: Mapping[str, int] | None = None):
        self.xid: dict[int, XidRule] = dict(_default_xids() if xid is None else xid)
        self.xid_default = xid_default
        self.escalate: dict[int, Escalation] = dict(
            {int(k): Escalation(v["count"], v["window_seconds"]) for k, v in DEFAULT_ESCALATE.items()}
            if escalate is None else escalate)
        self.signals: dict[str, str] = {name: action for name, (action, _) in SIGNALS.items()}
        self.signals.update(signals or {})
        self.thresholds: dict[str, int] = dict(DEFAULT_THRESHOLDS) | dict(thresholds or {})

    def xid_rule(self, xid: int) -> XidRule:
        """The rule for `xid`; unknown Xids (and 999) get `xid_default`."""
        rule = self.xid.get(xid)
        if rule is None:
            return XidRule(self.xid_default, "alert", "unknown Xid" if xid != 999 else "unknown error (999)")
        return rule

    def signal_action(self, signal: str) -> str:
        return self.signals.get(signal, "warn")

    def signal_meaning(self, signal: str) -> str:
        return SIGNALS.get(signal, ("warn", signal))[1]

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None, field_name: str = "--gpu-policy") -> GpuPolicy:
        """Defaults overridden by `data` (see the module docstring); ConfigError on a bad entry."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(field_name, "expected a mapping at the top of the GPU policy")

        def bad(where: str, message: str) -> ConfigError:
            return ConfigError(field_name, f"{where}: {message}")

        unknown = set(data) - {"xid", "xid_default", "escalate", "signals", "thresholds"}
        if unknown:
            raise bad(sorted(unknown)[0], "unknown policy section")
        xids = _default_xids()
        for key, action in _mapping(data.get("xid"), "xid", bad).items():
            if action not in ACTIONS:
                raise bad(f"xid.{key}", f"unknown action {action!r:.30} (expected one of {', '.join(ACTIONS)})")
            for xid in _xid_keys(key, bad):
                old = xids.get(xid)
                xids[xid] = XidRule(action, old.remedy if old else "configured", old.meaning if old else "configured")
        xid_default = data.get("xid_default", "warn")
        if xid_default not in SIGNAL_ACTIONS:
            raise bad("xid_default", f"unknown action {xid_default!r:.30}")
        escalate = {int(k): Escalation(v["count"], v["window_seconds"]) for k, v in DEFAULT_ESCALATE.items()}
        for key, rule in _mapping(data.get("escalate"), "escalate", bad).items():
            if rule is None:
                for xid in _xid_keys(key, bad):
                    escalate.pop(xid, None)
                continue
            if not isinstance(rule, Mapping):
                raise bad(f"escalate.{key}", "expected {count, window_seconds} or null")
            count, window = rule.get("count"), rule.get("window_seconds")
            if not _number(count, integer=True) or count < 1:
                raise bad(f"escalate.{key}.count", f"expected a whole number >= 1, got {count!r:.20}")
            if not _number(window) or window <= 0:
                raise bad(f"escalate.{key}.window_seconds", f"expected seconds > 0, got {window!r:.20}")
            for xid in _xid_keys(key, bad):
                escalate[xid] = Escalation(int(count), float(window))
        signals = {}
        for name, action in _mapping(data.get("signals"), "signals", bad).items():
            if name not in SIGNALS:
                raise bad(f"signals.{name}", f"unknown signal (known: {', '.join(SIGNALS)})")
            if action not in SIGNAL_ACTIONS:
                raise bad(f"signals.{name}", f"unknown action {action!r:.30}")
            signals[name] = action
        thresholds = {}
        for name, value in _mapping(data.get("thresholds"), "thresholds", bad).items():
            if name not in DEFAULT_THRESHOLDS:
                raise bad(f"thresholds.{name}", "unknown threshold")
            if isinstance(value, str):
                try:
                    value = int(value, 0)
                except ValueError:
                    raise bad(f"thresholds.{name}", f"not a whole number: {value!r:.20}") from None
            if not _number(value, integer=True) or value < 0:
                raise bad(f"thresholds.{name}", f"expected a whole number >= 0, got {value!r:.20}")
            thresholds[name] = int(value)
        return cls(xids, xid_default, escalate, signals, thresholds)

    @classmethod
    def load(cls, path: str | Path, field_name: str = "--gpu-policy") -> GpuPolicy:
        """Reads a policy file (YAML or JSON) and validates it."""
        return cls.from_data(load_data(path, field_name), field_name)

    def to_data(self) -> dict[str, Any]:
        """The whole effective policy as plain data (loadable by `from_data`)."""
        return {
            "xid": {str(x): r.action for x, r in sorted(self.xid.items())},
            "xid_default": self.xid_default,
            "escalate": {str(x): {"count": e.count, "window_seconds": e.window_seconds}
                         for x, e in sorted(self.escalate.items())},
            "signals": dict(self.signals),
            "thresholds": copy.deepcopy(self.thresholds),
        }


def _default_xids() -> dict[int, XidRule]:
    table: dict[int, XidRule] = {}
    for keys, action, remedy, meaning in DEFAULT_XID_TABLE:
        for xid in parse_xid_list(keys):
            table[xid] = XidRule(action, remedy, meaning)
    return table


def parse_xid_list(text: str) -> list[int]:
    """'8,11,39-41' -> [8, 11, 39, 40, 41]. ValueError on anything else."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if "-" in part:
            low, high = (int(p, 10) for p in part.split("-", 1))
            if low > high or high - low > 1000:
                raise ValueError(f"bad Xid range {part!r}")
            out.extend(range(low, high + 1))
        else:
            out.append(int(part, 10))
    if any(x < 0 for x in out):
        raise ValueError("Xids are >= 0")
    return out


def _xid_keys(key: Any, bad) -> list[int]:
    if isinstance(key, int) and not isinstance(key, bool):
        return [key]
    try:
        return parse_xid_list(key)
    except ValueError:
        raise bad(f"xid.{key}", "expected an Xid, a range a-b or a comma list") from None


def _mapping(value: Any, where: str, bad) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad(where, "expected a mapping")
    return value


def _number(value: Any, integer: bool = False) -> TypeGuard[float]:
    """True for a number (not a bool, not NaN); with `integer`, for a whole number only."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, (int, float)) and value == value
