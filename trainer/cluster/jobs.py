"""The Job controller of the local cluster: batch/v1 Indexed Jobs, as the supervisor and the
example manifests use them (tests/test_k8s_in_place.py and tests/test_k8s_fallback.py show the
real controller doing the same).

`JobController(kube).sync()` is one level-triggered pass over every Job:
- suspended: every active pod is deleted (its kubelet stops it within its grace period);
  once none is left, `status.startTime` is cleared (then the template's scheduling directives
  may change) and the condition `Suspended` is True;
- running: `status.startTime` is set; each completion index in [0, completions) that has not
  succeeded gets one pod (job_pods.pod_for), the lowest indices first, at most `parallelism`
  at a time (an index whose pod is still terminating waits for it: podReplacementPolicy
  Failed); beyond parallelism the pods of job_pods.removal_order are deleted, as are the newer
  pods of an index that has two;
- a Failed pod is handled once, by `podFailurePolicy` (job_pods.failure_action): `Ignore`
  (an 83 exit, a `DisruptionTarget`) counts against nothing, `Count` against
  `backoffLimitPerIndex` (the index fails past it; more than `maxFailedIndexes` failed
  indices fail the Job), `FailIndex` fails the index, `FailJob` the Job; either way the index is
  re-created no sooner than `failure_backoff` seconds later (Kubernetes: 10 s, doubling; Ignore
  does not skip it);
- a rule of the Job's `successPolicy` met (job_pods.success_policy_met; what a torchrun job on
  the restart path uses: after a scale-down the Job still has indices that never ran, and the
  training already finished): conditions `SuccessCriteriaMet` and `Complete` with reason
  `SuccessPolicy`, every pod still active deleted, no pod made for the indices left;
- every index succeeded: conditions `SuccessCriteriaMet` and `Complete`, `completionTime`;
  failed: condition `Failed`. A finished Job is left alone.
`sync()` returns the seconds until a backoff ends (when to look again), or None.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from spotguard.kube.api import JOBS, PODS, NotFound
from spotguard.trainer.cluster import job_pods
from spotguard.trainer.cluster.job_pods import index_of, terminal, terminating
from spotguard.trainer.cluster.kube import LocalKube, rfc3339

log = logging.getLogger(__name__)


def _condition(kind: str, reason: str, message: str = "") -> dict:
    now = rfc3339()
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastProbeTime": now,
            "lastTransitionTime": now}


class JobController:
    """See the module docstring."""

    def __init__(self, kube: LocalKube, failure_backoff: float = 0.5):
        self.kube = kube
        self.failure_backoff = failure_backoff
        self._handled: set[str] = set()  # uids of Failed pods already counted
        self._failures: dict[tuple[str, int], int] = {}  # (job uid, index) -> counted failures
        self._failed_indexes: dict[str, set[int]] = {}
        self._not_before: dict[tuple[str, int], float] = {}  # (job uid, index) -> monotonic time

    def sync(self) -> float | None:
        jobs, _ = self.kube.list(JOBS)
        waits = [self._sync_job(job) for job in jobs if not self._finished(job)]
        due = [w for w in waits if w is not None]
        return min(due) if due else None

    @staticmethod
    def _finished(job: Mapping[str, Any]) -> bool:
        return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                   for c in (job.get("status") or {}).get("conditions") or [])

    def _pods(self, job: Mapping[str, Any]) -> list[dict]:
        meta = job["metadata"]
        pods, _ = self.kube.list(PODS, meta["namespace"], label_selector={job_pods.UID_LABEL: meta["uid"]})
        return pods

    def _sync_job(self, job: dict) -> float | None:
        pods = self._pods(job)
        if (job.get("spec") or {}).get("suspend"):
            self._suspend(job, pods)
            return None
        outcome = self._count_failures(job, pods)
        if outcome is not None:
            self._finish(job, pods, "Failed", outcome)
            return None
        completions = int(job["spec"].get("completions") or 1)
        succeeded = {index_of(p) for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"}
        met = job_pods.success_policy_met(job, succeeded)
        if met is not None:
            self._finish(job, pods, "Complete", met, reason="SuccessPolicy")
            return None
        if len(succeeded & set(range(completions))) == completions:
            self._finish(job, pods, "Complete", "every index succeeded")
            return None
        wait = self._scale(job, pods, completions, succeeded)
        self._write_status(job, pods, succeeded)
        return wait

    def _suspend(self, job: dict, pods: list[dict]) -> None:
        for pod in pods:
            if not terminal(pod) and not terminating(pod):
                self._delete(pod)
        status = job.get("status") or {}
        left = [p for p in pods if not terminal(p)]
        suspended = any(c.get("type") == "Suspended" and c.get("status") == "True"
                        for c in status.get("conditions") or [])
        if not left and (status.get("startTime") or not suspended):
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Suspended"]
            self.kube.patch(JOBS, job["metadata"]["namespace"], job["metadata"]["name"], {"status": {
                "startTime": None, "active": 0, "ready": 0,
                "conditions": [*conditions, _condition("Suspended", "JobSuspended", "Job suspended")]}}, status=True)

    def _count_failures(self, job: Mapping[str, Any], pods: list[dict]) -> str | None:
        """Handles each new Failed pod (module docstring); the reason the Job failed, or None."""
        uid, spec = job["metadata"]["uid"], job.get("spec") or {}
        failed = self._failed_indexes.setdefault(uid, set())
        for pod in pods:
            pod_uid = pod["metadata"]["uid"]
            if (pod.get("status") or {}).get("phase") != "Failed" or pod_uid in self._handled:
                continue
            self._handled.add(pod_uid)
            index, action = index_of(pod), job_pods.failure_action(job, pod)
            self._not_before[(uid, index)] = time.monotonic() + self.failure_backoff
            log.info("job %s: pod %s (index %d) failed: %s", job["metadata"]["name"], pod["metadata"]["name"],
                     index, action)
            if action == "FailJob":
                return f"pod {pod['metadata']['name']} matched a FailJob rule"
            if action == "FailIndex":
                failed.add(index)
            elif action == "Count":
                self._failures[(uid, index)] = self._failures.get((uid, index), 0) + 1
                if self._failures[(uid, index)] > int(spec.get("backoffLimitPerIndex", 6)):
                    failed.add(index)
        limit = spec.get("maxFailedIndexes")
        if limit is not None and len(failed) > int(limit):
            return f"{len(failed)} failed indexes, more than maxFailedIndexes {limit}"
        return None

    def _scale(self, job: dict, pods: list[dict], completions: int, succeeded: set[int]) -> float | None:
        """Creates and deletes pods toward the wanted active ones; seconds until a backoff ends."""
        uid = job["metadata"]["uid"]
        failed = self._failed_indexes.get(uid, set())
        live = [p for p in pods if not terminal(p)]
        active = [p for p in live if not terminating(p)]
        seen: set[int] = set()
        for pod in sorted(active, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])):
            if index_of(pod) in seen or index_of(pod) >= completions:  # a duplicate, or beyond completions
                self._delete(pod)
                active.remove(pod)
            seen.add(index_of(pod))
        wanted = min(int(job["spec"].get("parallelism", 1)), completions - len(succeeded) - len(failed))
        for pod in job_pods.removal_order(active)[:max(0, len(active) - wanted)]:
            self._delete(pod)
        occupied = {index_of(p) for p in live}
        now, waits = time.monotonic(), []
        free = [i for i in range(completions) if i not in succeeded | failed | occupied]
        for index in free[:max(0, wanted - len(active))]:
            not_before = self._not_before.get((uid, index), 0.0)
            if not_before > now:
                waits.append(not_before - now)
                continue
            self.kube.create(PODS, job["metadata"]["namespace"], job_pods.pod_for(job, index))
        return min(waits) if waits else None

    def _write_status(self, job: dict, pods: list[dict], succeeded: set[int]) -> None:
        status = job.get("status") or {}
        active = [p for p in pods if not terminal(p) and not terminating(p)]
        ready = [p for p in active if any(c.get("type") == "Ready" and c.get("status") == "True"
                                          for c in (p.get("status") or {}).get("conditions") or [])]
        wanted = {"startTime": status.get("startTime") or rfc3339(), "active": len(active), "ready": len(ready),
                  "succeeded": len(succeeded), "failed": sum(1 for p in pods if (p.get("status") or {}).get("phase")
                                                             == "Failed"),
                  "completedIndexes": ",".join(str(i) for i in sorted(succeeded)),
                  "conditions": [c for c in status.get("conditions") or [] if c.get("type") != "Suspended"]}
        if any(status.get(k) != v for k, v in wanted.items()):
            self.kube.patch(JOBS, job["metadata"]["namespace"], job["metadata"]["name"], {"status": wanted},
                            status=True)

    def _finish(self, job: dict, pods: list[dict], kind: str, message: str, reason: str | None = None) -> None:
        for pod in pods:
            if not terminal(pod) and not terminating(pod):
                self._delete(pod)
        conditions = list((job.get("status") or {}).get("conditions") or [])
        reason = reason or ("CompletionsReached" if kind == "Complete" else "PodFailurePolicy")
        if kind == "Complete":
            conditions.append(_condition("SuccessCriteriaMet", reason, message))
        conditions.append(_condition(kind, reason, message))
        log.info("job %s: %s (%s)", job["metadata"]["name"], kind, message)
        self.kube.patch(JOBS, job["metadata"]["namespace"], job["metadata"]["name"], {"status": {
            "conditions": conditions, "completionTime": rfc3339(), "active": 0}}, status=True)

    def _delete(self, pod: Mapping[str, Any]) -> None:
        try:
            self.kube.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
        except NotFound:
            pass
