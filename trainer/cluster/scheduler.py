"""The scheduler of the local cluster: binds each Pending pod that has no node and no
scheduling gate to a node where it fits, as kube-scheduler's filters do for what the example
manifests ask: the node is Ready and schedulable, the pod's `nodeSelector` and required node
affinity match its labels, every NoSchedule/NoExecute taint is tolerated, and its free
resources (allocatable minus the requests of the pods there that have not finished) hold the
pod's requests (`nvidia.com/gpu` above all). The filters are the supervisor's capacity
functions (supervisor/capacity.py): one definition of "fits" for both.

Pods are taken oldest first; among the nodes that fit, the first by name (a deterministic
choice; kube-scheduler scores them). A pod that fits nowhere gets `PodScheduled=False`
(Unschedulable) and waits for the next pass. `sync()` is one pass; it never asks to be
looked at again by time (only writes change where a pod fits).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from spotguard.kube.api import NODES, PODS, Conflict, NotFound
from spotguard.supervisor.capacity import node_free, node_matches, node_ready, pod_requests, replicas_fitting
from spotguard.trainer.cluster.job_pods import terminal, terminating
from spotguard.trainer.cluster.kube import LocalKube, rfc3339

log = logging.getLogger(__name__)


def fits(node: Mapping[str, Any], pod: Mapping[str, Any], pods_there: list[Mapping[str, Any]]) -> bool:
    """Whether `pod` may be bound to `node` now (see the module docstring)."""
    spec = pod.get("spec") or {}
    if not node_ready(node) or (node.get("spec") or {}).get("unschedulable") or not node_matches(node, spec):
        return False
    return replicas_fitting(node_free(node, pods_there), pod_requests(spec)) >= 1


def _waiting(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    return not spec.get("nodeName") and not spec.get("schedulingGates") and not terminal(pod) \
        and not terminating(pod)


class Scheduler:
    """See the module docstring."""

    def __init__(self, kube: LocalKube):
        self.kube = kube

    def sync(self) -> float | None:
        nodes, _ = self.kube.list(NODES)
        pods, _ = self.kube.list(PODS)
        placed: dict[str, list[Mapping[str, Any]]] = {}
        for pod in pods:
            if (pod.get("spec") or {}).get("nodeName"):
                placed.setdefault(pod["spec"]["nodeName"], []).append(pod)
        waiting = sorted((p for p in pods if _waiting(p)),
                         key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))
        for pod in waiting:
            node = next((n for n in sorted(nodes, key=lambda n: n["metadata"]["name"])
                         if fits(n, pod, placed.get(n["metadata"]["name"], []))), None)
            if node is None:
                self._unschedulable(pod)
                continue
            name = node["metadata"]["name"]
            try:
                bound = self.kube.bind(pod["metadata"]["namespace"], pod["metadata"]["name"], name)
            except (Conflict, NotFound):
                continue
            placed.setdefault(name, []).append(bound)
            self._condition(bound, "True", "")
            log.info("scheduled pod %s on %s", pod["metadata"]["name"], name)
        return None

    def _unschedulable(self, pod: Mapping[str, Any]) -> None:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return
        self._condition(pod, "False", "Unschedulable")

    def _condition(self, pod: Mapping[str, Any], status: str, reason: str) -> None:
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
        cond = {"type": "PodScheduled", "status": status, "lastTransitionTime": rfc3339()}
        if reason:
            cond.update(reason=reason, message="0 nodes are available for the pod")
        try:
            self.kube.patch(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"],
                            {"status": {"phase": (pod.get("status") or {}).get("phase") or "Pending",
                                        "conditions": [*conditions, cond]}}, status=True)
        except NotFound:
            pass
