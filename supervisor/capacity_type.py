"""Spot vs on-demand capacity: the clouds' node labels, in one table, and the pod template's
scheduling directives switched between the two. Pure functions over API dicts.

`CAPACITY_LABELS` is the single table (cost accounting reads nodes with it, fallback rewrites pod
templates with it). Each entry names a node label, the values that mean spot, and the value that
means on-demand, or None where on-demand nodes simply lack the spot value (GKE's `gke-spot`,
AKS's `scalesetpriority`): there the on-demand form is the node affinity `NotIn [spot values]`.
Alibaba ACK has no documented capacity-type label that we could verify here, so it is not listed.

`to_on_demand(directives)` rewrites every spot selection in `nodeSelector` and in the required
node affinity's `matchExpressions` (`In [spot values]`) into its on-demand form; it returns None
when the directives select no spot capacity (nothing to switch). Only `nodeSelector`, `affinity`
and `tolerations` are read or returned, the fields a suspended Job's template may change
(tolerations stay: tolerating a spot taint does not force a pod onto spot nodes). Going back,
the supervisor restores the directives it saved before the move, exactly.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

SPOT, ON_DEMAND = "spot", "on-demand"
DIRECTIVES = ("nodeSelector", "affinity", "tolerations")


@dataclass(frozen=True)
class CapacityLabel:
    """A node label that tells spot from on-demand capacity."""

    key: str
    spot: tuple[str, ...]
    on_demand: str | None  # None: on-demand nodes lack the spot value (no positive on-demand value)


CAPACITY_LABELS: tuple[CapacityLabel, ...] = (
    CapacityLabel("karpenter.sh/capacity-type", ("spot",), "on-demand"),
    CapacityLabel("eks.amazonaws.com/capacityType", ("SPOT",), "ON_DEMAND"),
    CapacityLabel("cloud.google.com/gke-provisioning", ("spot",), "standard"),
    CapacityLabel("cloud.google.com/gke-spot", ("true",), None),
    CapacityLabel("cloud.google.com/gke-preemptible", ("true",), None),
    CapacityLabel("kubernetes.azure.com/scalesetpriority", ("spot",), None),
)
BY_KEY = {label.key: label for label in CAPACITY_LABELS}


def spot_labels() -> dict[str, tuple[str, ...]]:
    """{label: spot values}: what cost accounting uses to call a node spot."""
    return {label.key: label.spot for label in CAPACITY_LABELS}


def directives_of(pod_spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scheduling directives of a pod spec (absent ones as None)."""
    spec = pod_spec or {}
    return {name: copy.deepcopy(spec.get(name)) for name in DIRECTIVES}


def _required_terms(affinity: Mapping[str, Any] | None) -> list[dict] | None:
    node_affinity = (affinity or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms")
    return terms if isinstance(terms, list) else None


def _spot_expression(expr: Mapping[str, Any]) -> CapacityLabel | None:
    label = BY_KEY.get(expr.get("key", ""))
    if label is None or expr.get("operator") != "In":
        return None
    values = expr.get("values") or []
    return label if values and all(v in label.spot for v in values) else None


def _on_demand_expression(label: CapacityLabel) -> dict:
    if label.on_demand is not None:
        return {"key": label.key, "operator": "In", "values": [label.on_demand]}
    return {"key": label.key, "operator": "NotIn", "values": list(label.spot)}


def selects_spot(directives: Mapping[str, Any]) -> bool:
    """Whether the directives pin the pods to spot capacity through a label of the table."""
    for key, value in (directives.get("nodeSelector") or {}).items():
        if key in BY_KEY and value in BY_KEY[key].spot:
            return True
    for term in _required_terms(directives.get("affinity")) or []:
        if any(_spot_expression(e) for e in term.get("matchExpressions") or []):
            return True
    return False


def names_capacity_label(directives: Mapping[str, Any]) -> bool:
    """Whether the `nodeSelector` or a required node-affinity expression names a label of the
    table, whatever its values: the pods' placement then tells spot from on-demand."""
    if any(key in BY_KEY for key in directives.get("nodeSelector") or {}):
        return True
    return any(e.get("key") in BY_KEY for term in _required_terms(directives.get("affinity")) or []
               for e in term.get("matchExpressions") or [])


def to_on_demand(directives: Mapping[str, Any]) -> dict[str, Any] | None:
    """The on-demand form of spot-selecting directives (module docstring); None if none select spot."""
    if not selects_spot(directives):
        return None
    out = copy.deepcopy(dict(directives))
    selector = dict(out.get("nodeSelector") or {})
    moved: list[dict] = []  # selections with no positive on-demand value become affinity
    for key, value in list(selector.items()):
        label = BY_KEY.get(key)
        if label is None or value not in label.spot:
            continue
        if label.on_demand is not None:
            selector[key] = label.on_demand
        else:
            del selector[key]
            moved.append(_on_demand_expression(label))
    out["nodeSelector"] = selector or None
    terms = _required_terms(out.get("affinity"))
    for term in terms or []:
        term["matchExpressions"] = [_on_demand_expression(lbl) if (lbl := _spot_expression(e)) else e
                                    for e in term.get("matchExpressions") or []]
    if moved:
        affinity = out.get("affinity") or {}
        node_affinity = affinity.setdefault("nodeAffinity", {})
        required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        required["nodeSelectorTerms"] = [{**t, "matchExpressions": list(t.get("matchExpressions") or []) + moved}
                                         for t in (terms or [{}])]
        out["affinity"] = affinity
    return out


def merge_patch(current: Any, desired: Any) -> Any:
    """The RFC 7386 merge patch that turns `current` into exactly `desired` (None removes)."""
    if not isinstance(current, Mapping) or not isinstance(desired, Mapping):
        return desired
    patch: dict = {}
    for key in set(current) | set(desired):
        if key not in desired or desired[key] is None:
            if current.get(key) is not None:
                patch[key] = None
        elif key not in current or current[key] != desired[key]:
            patch[key] = merge_patch(current.get(key), desired[key])
    return patch
