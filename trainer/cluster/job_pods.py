"""What the Job controller decides about one Indexed Job's pods. Pure: objects in, answers out.

- `pod_for(job, index)`: the pod Kubernetes makes for a completion index: the template with the
  Job's labels (`batch.kubernetes.io/job-name`, `controller-uid`, `job-completion-index`), the
  index annotation, the owner reference, hostname `<job>-<index>` and `JOB_COMPLETION_INDEX`
  (from the annotation, downward API) in every container;
- `failure_action(job, pod)`: the `podFailurePolicy` rule a Failed pod matches first (`Ignore`,
  `FailIndex`, `FailJob`, `Count`), else `Count` (onExitCodes looks at containers that exited
  non-zero, optionally one named container; onPodConditions at the pod's conditions);
- `success_policy_met(job, succeeded)`: which `successPolicy` rule the succeeded indices meet
  first (None: none, or no policy): a rule with `succeededIndexes` ("0,2-4") needs those indices
  (with `succeededCount`, that many of them), one with only `succeededCount` that many of any;
- `removal_order(pods)`: which active pods a scale-down deletes first, the Job controller's
  ranking (`controller.ActivePods`): unscheduled, then Pending, then not Ready, then Ready for
  the shortest time, then more restarts, then the newest; ties: the highest index first.
"""
from __future__ import annotations

import calendar
import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

INDEX_KEY = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
UID_LABEL = "batch.kubernetes.io/controller-uid"
INDEX_ENV = "JOB_COMPLETION_INDEX"
TERMINAL = ("Succeeded", "Failed")


def epoch(stamp: str | None) -> float:
    """A Kubernetes timestamp as seconds since the epoch (0 for none)."""
    if not stamp:
        return 0.0
    return float(calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")))


def index_of(pod: Mapping[str, Any]) -> int:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(INDEX_KEY, "")
    return int(raw) if str(raw).isdigit() else -1


def terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in TERMINAL


def terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_for(job: Mapping[str, Any], index: int) -> dict:
    """See the module docstring."""
    meta = job["metadata"]
    template = copy.deepcopy((job.get("spec") or {}).get("template") or {})
    pod_meta = template.setdefault("metadata", {})
    labels = {**(pod_meta.get("labels") or {}), JOB_NAME_LABEL: meta["name"], "job-name": meta["name"],
              UID_LABEL: meta["uid"], "controller-uid": meta["uid"], INDEX_KEY: str(index)}
    pod_meta.update(labels=labels, annotations={**(pod_meta.get("annotations") or {}), INDEX_KEY: str(index)},
                    generateName=f"{meta['name']}-{index}-", ownerReferences=[{
                        "apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"],
                        "controller": True, "blockOwnerDeletion": True}])
    spec = template.setdefault("spec", {})
    spec["hostname"] = f"{meta['name']}-{index}"
    for container in spec.get("containers") or []:
        container.setdefault("env", []).append({"name": INDEX_ENV, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
    return template


def _exit_rule_matches(rule: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    name = rule.get("containerName")
    values = set(rule.get("values") or [])
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        code = ((status.get("state") or {}).get("terminated") or {}).get("exitCode")
        if code in (None, 0) or (name and status.get("name") != name):
            continue
        if (code in values) == (rule.get("operator", "In") == "In"):
            return True
    return False


def _condition_rule_matches(patterns: Sequence[Mapping[str, Any]], pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == p.get("type") and c.get("status") == p.get("status", "True")
               for p in patterns for c in conditions)


def failure_action(job: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """See the module docstring."""
    for rule in ((job.get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []:
        if rule.get("onExitCodes") and _exit_rule_matches(rule["onExitCodes"], pod):
            return str(rule.get("action"))
        if rule.get("onPodConditions") and _condition_rule_matches(rule["onPodConditions"], pod):
            return str(rule.get("action"))
    return "Count"


def _indexes(text: str) -> set[int]:
    """The indices of an interval list ("0,2-4")."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def success_policy_met(job: Mapping[str, Any], succeeded: set[int]) -> str | None:
    """See the module docstring: the message of the rule met, else None."""
    for number, rule in enumerate(((job.get("spec") or {}).get("successPolicy") or {}).get("rules") or []):
        named = _indexes(str(rule["succeededIndexes"])) if rule.get("succeededIndexes") else None
        done = succeeded if named is None else succeeded & named
        wanted = rule.get("succeededCount")
        if done and len(done) >= (int(wanted) if wanted is not None else len(named or ())):
            return f"Matched rules at index {number}"
    return None


def _ready_since(pod: Mapping[str, Any]) -> float | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return epoch(cond.get("lastTransitionTime"))
    return None


def removal_order(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """See the module docstring."""
    phases = {"Pending": 0, "Unknown": 1, "Running": 2}

    def rank(pod: Mapping[str, Any]) -> tuple:
        status = pod.get("status") or {}
        ready = _ready_since(pod)
        restarts = sum(int(s.get("restartCount") or 0) for s in status.get("containerStatuses") or [])
        return (bool((pod.get("spec") or {}).get("nodeName")), phases.get(status.get("phase", "Pending"), 0),
                ready is not None, -(ready or 0.0), -restarts,
                -epoch((pod.get("metadata") or {}).get("creationTimestamp")), -index_of(pod))
    return sorted(pods, key=rank)
