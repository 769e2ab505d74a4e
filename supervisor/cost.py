"""Cost accounting: node-hours on spot vs on-demand nodes per job, priced from a table.

Capacity type comes from node labels: the table in capacity_type.py (Karpenter, EKS, GKE, AKS;
replaceable in the price file under `spot-labels`); anything else is on-demand. The instance type is
`node.kubernetes.io/instance-type` (or the beta label).

Attribution: every node that runs at least one of a job's running replica pods counts fully for
that job while it does (training nodes are normally dedicated to one job). The ledger integrates
piecewise between `observe` calls, so call it on each change and periodically. The totals are
seeded from, and saved to, the job's decision record (`restore`, `JobCost.totals`), so they
survive a supervisor restart up to the last save.

Price file (YAML or JSON), dollars per node-hour:
    default: {spot: 1.0, on-demand: 3.0}
    instance-types: {p4d.24xlarge: {spot: 9.8, on-demand: 32.77}}
    spot-labels: {karpenter.sh/capacity-type: [spot]}      # optional, replaces the defaults
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping

from spotguard.config import ConfigError
from spotguard.supervisor import capacity_type

DEFAULT_SPOT_LABELS: dict[str, tuple[str, ...]] = capacity_type.spot_labels()
INSTANCE_TYPE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
SPOT, ON_DEMAND = capacity_type.SPOT, capacity_type.ON_DEMAND
TOTALS = ("spot_hours", "on_demand_hours", "cost", "on_demand_equivalent")


def _price(field_name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(field_name, f"expected a price >= 0 in dollars per hour, got {value!r}")
    return float(value)


def _pair(field_name: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, Mapping) or set(value) - {SPOT, ON_DEMAND} or not value:
        raise ConfigError(field_name, f"expected {{spot: <$/h>, on-demand: <$/h>}}, got {value!r:.80}")
    if SPOT in value:
        spot = _price(f"{field_name}.{SPOT}", value[SPOT])
        on_demand = _price(f"{field_name}.{ON_DEMAND}", value.get(ON_DEMAND, spot))
    else:
        on_demand = _price(f"{field_name}.{ON_DEMAND}", value[ON_DEMAND])
        spot = on_demand
    return spot, on_demand


@dataclass(frozen=True)
class PriceTable:
    """Prices per node-hour: (spot, on-demand) per instance type, with a default."""

    default: tuple[float, float] = (0.0, 0.0)
    instance_types: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    spot_labels: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_SPOT_LABELS))

    @classmethod
    def from_mapping(cls, obj: Any, field_name: str = "--prices") -> PriceTable:
        if not isinstance(obj, Mapping):
            raise ConfigError(field_name, "expected a mapping with default / instance-types / spot-labels")
        unknown = set(obj) - {"default", "instance-types", "spot-labels"}
        if unknown:
            raise ConfigError(f"{field_name}: {sorted(unknown)[0]}", "unknown key")
        default = _pair(f"{field_name}: default", obj["default"]) if "default" in obj else (0.0, 0.0)
        types_obj = obj.get("instance-types") or {}
        if not isinstance(types_obj, Mapping):
            raise ConfigError(f"{field_name}: instance-types", "expected a mapping")
        types = {str(k): _pair(f"{field_name}: instance-types.{k}", v) for k, v in types_obj.items()}
        labels: dict[str, tuple[str, ...]] = dict(DEFAULT_SPOT_LABELS)
        if "spot-labels" in obj:
            raw = obj["spot-labels"]
            if not isinstance(raw, Mapping) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                                       for v in raw.values()):
                raise ConfigError(f"{field_name}: spot-labels", "expected {label: [values...]}")
            labels = {str(k): tuple(v) for k, v in raw.items()}
        return cls(default, types, labels)

    @classmethod
    def from_file(cls, path: str) -> PriceTable:
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                obj = yaml.safe_load(fh)
        except OSError as exc:
            raise ConfigError("--prices", f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError("--prices", f"{path} is not YAML/JSON: {exc}") from None
        return cls.from_mapping(obj)

    def capacity_type(self, node: Mapping[str, Any]) -> str:
        labels = (node.get("metadata") or {}).get("labels") or {}
        for key, values in self.spot_labels.items():
            if labels.get(key) in values:
                return SPOT
        return ON_DEMAND

    def prices(self, node: Mapping[str, Any]) -> tuple[float, float]:
        labels = (node.get("metadata") or {}).get("labels") or {}
        for key in INSTANCE_TYPE_LABELS:
            if labels.get(key) in self.instance_types:
                return self.instance_types[labels[key]]
        return self.default


@dataclass
class JobCost:
    """Running totals for one job."""

    spot_hours: float = 0.0
    on_demand_hours: float = 0.0
    cost: float = 0.0
    on_demand_equivalent: float = 0.0
    last_seen: float | None = None
    nodes: tuple = ()

    def totals(self) -> dict[str, float]:
        """The running totals, rounded for the decision record."""
        return {name: round(getattr(self, name), 9) for name in TOTALS}

    @property
    def savings_ratio(self) -> float:
        """1 - cost / on-demand equivalent (0 when nothing was spent yet)."""
        return 0.0 if self.on_demand_equivalent <= 0 else 1.0 - self.cost / self.on_demand_equivalent


class CostLedger:
    """Integrates node-hours and dollars per job (see the module docstring)."""

    def __init__(self, prices: PriceTable | None = None):
        self.prices = prices or PriceTable()
        self.jobs: dict[Any, JobCost] = {}

    def observe(self, job: Any, nodes: Iterable[Mapping[str, Any]], now: float) -> JobCost:
        """Credits the time since the last call to the nodes seen then; remembers `nodes` for the next."""
        entry = self.jobs.setdefault(job, JobCost())
        if entry.last_seen is not None and now > entry.last_seen:
            hours = (now - entry.last_seen) / 3600.0
            for capacity_type, (spot_price, on_demand_price) in entry.nodes:
                if capacity_type == SPOT:
                    entry.spot_hours += hours
                    entry.cost += hours * spot_price
                else:
                    entry.on_demand_hours += hours
                    entry.cost += hours * on_demand_price
                entry.on_demand_equivalent += hours * on_demand_price
        entry.last_seen = now
        entry.nodes = tuple((self.prices.capacity_type(n), self.prices.prices(n)) for n in nodes)
        return entry

    def restore(self, job: Any, totals: Mapping[str, Any] | None) -> None:
        """Seeds a job not yet seen by this process with the totals saved in its record."""
        if job in self.jobs or not totals:
            return
        entry = self.jobs[job] = JobCost()
        for name in TOTALS:
            value = totals.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
                setattr(entry, name, float(value))

    def forget(self, job: Any) -> None:
        self.jobs.pop(job, None)
