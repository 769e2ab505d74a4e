"""Capacity: where more replicas of a job could run now. Pure functions over API objects (dicts).

A node counts when it is Ready, schedulable (`spec.unschedulable` not set), carries no
spotguard notice (annotation `spotguard.io/notice` or taint `spotguard.io/reclaim`), matches the
pod template's `nodeSelector` and required node affinity (`matchExpressions`: In, NotIn, Exists,
DoesNotExist, Gt, Lt), and every NoSchedule/NoExecute taint is tolerated. How many
replicas fit on it is the minimum over the pod's requested resources (plus one `pods` slot) of
floor(free / request), free being allocatable minus the requests of its non-terminal pods.
Preferred affinity, `matchFields` and topology spread are not evaluated (the scheduler still has the
last word).
"""
from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from collections.abc import Iterable, Mapping
from typing import Any

from spotguard.wire import names

_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
DEFAULT_POD_SLOTS = 110
TERMINAL_PHASES = ("Succeeded", "Failed")


def parse_quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3", 4) as a float; ValueError if bad."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, multiplier = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, multiplier = text, 1
    try:
        return float(Decimal(number) * Decimal(multiplier))
    except (InvalidOperation, ValueError):
        raise ValueError(f"not a quantity: {value!r}") from None


def _quantities(mapping: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, raw in (mapping or {}).items():
        try:
            out[name] = parse_quantity(raw)
        except ValueError:
            continue  # an unreadable quantity constrains nothing rather than crashing the loop
    return out


def pod_requests(pod_spec: Mapping[str, Any] | None) -> dict[str, float]:
    """Summed container requests (limits stand in where a request is missing, as the API
    defaults them); init containers count as the max with the sum."""
    total: dict[str, float] = {}
    spec = pod_spec or {}
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        merged = {**_quantities(resources.get("limits")), **_quantities(resources.get("requests"))}
        for name, amount in merged.items():
            total[name] = total.get(name, 0.0) + amount
    for container in spec.get("initContainers") or []:
        resources = container.get("resources") or {}
        merged = {**_quantities(resources.get("limits")), **_quantities(resources.get("requests"))}
        for name, amount in merged.items():
            total[name] = max(total.get(name, 0.0), amount)
    return total


def node_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def has_notice(node: Mapping[str, Any]) -> bool:
    """True when the agent marked the node (annotation or taint), whatever the notice's kind."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    if annotations.get(names.ANN_NOTICE):
        return True
    return any(t.get("key") == names.TAINT_RECLAIM for t in (node.get("spec") or {}).get("taints") or [])


def node_healthy(node: Mapping[str, Any]) -> bool:
    """Ready, schedulable and without a spotguard notice."""
    return node_ready(node) and not (node.get("spec") or {}).get("unschedulable") and not has_notice(node)


def tolerates(tolerations: Iterable[Mapping[str, Any]] | None, taint: Mapping[str, Any]) -> bool:
    """Kubernetes toleration matching for one taint."""
    for tol in tolerations or []:
        effect = tol.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        operator = tol.get("operator") or "Equal"
        key = tol.get("key")
        if not key:
            if operator == "Exists":
                return True
            continue
        if key != taint.get("key"):
            continue
        if operator == "Exists" or (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_matches(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    key, operator, values = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    if operator in ("Gt", "Lt") and len(values) == 1:
        try:
            have, bound = int(labels.get(key, "")), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def affinity_matches(labels: Mapping[str, str], affinity: Mapping[str, Any] | None) -> bool:
    """The required node affinity (any term whose matchExpressions all match) admits the labels."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    return any(all(_expression_matches(labels, e) for e in term.get("matchExpressions") or []) for term in terms)


def node_matches(node: Mapping[str, Any], pod_spec: Mapping[str, Any] | None) -> bool:
    """The pod template's nodeSelector and required node affinity match the node and its taints
    are all tolerated."""
    spec = pod_spec or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    if not affinity_matches(labels, spec.get("affinity")):
        return False
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(spec.get("tolerations"), taint):
            return False
    return True


def pod_active(pod: Mapping[str, Any]) -> bool:
    """Not finished and not being deleted."""
    return ((pod.get("status") or {}).get("phase") not in TERMINAL_PHASES
            and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def node_free(node: Mapping[str, Any], pods_on_node: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Allocatable minus the requests of the node's non-terminal pods (each also takes a pod slot)."""
    free = _quantities((node.get("status") or {}).get("allocatable"))
    free.setdefault("pods", float(DEFAULT_POD_SLOTS))
    for pod in pods_on_node:
        if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        for name, amount in pod_requests(pod.get("spec")).items():
            free[name] = free.get(name, 0.0) - amount
        free["pods"] -= 1
    return free


def replicas_fitting(free: Mapping[str, float], request: Mapping[str, float]) -> int:
    """How many pods asking `request` fit into `free`."""
    count = math.inf
    for name, amount in {**request, "pods": 1.0}.items():
        if amount <= 0:
            continue
        count = min(count, math.floor(max(0.0, free.get(name, 0.0)) / amount + 1e-9))
    return 0 if count is math.inf else int(count)


def free_slots(nodes: Iterable[Mapping[str, Any]], pods_by_node: Mapping[str, Iterable[Mapping[str, Any]]],
               pod_spec: Mapping[str, Any] | None, ignore=None) -> int:
    """Further replicas of `pod_spec` that fit on healthy, matching nodes. Pods for which
    `ignore(pod)` is true (e.g. a suspended job's own, going away) do not occupy space."""
    request = pod_requests(pod_spec)
    total = 0
    for node in nodes:
        if not node_healthy(node) or not node_matches(node, pod_spec):
            continue
        name = (node.get("metadata") or {}).get("name", "")
        pods = pods_by_node.get(name, ())
        if ignore is not None:
            pods = [p for p in pods if not ignore(p)]
        total += replicas_fitting(node_free(node, pods), request)
    return total
