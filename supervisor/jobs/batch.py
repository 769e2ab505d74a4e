"""batch/v1 Jobs (Indexed, one pod per rank): replicas are `spec.parallelism`, suspension is
`spec.suspend`. The full size (default max-replicas) is `spec.completions`, else parallelism.
On suspend the Job controller deletes the active pods; on scale-down it deletes the excess
(the Guard turns that SIGTERM into a drain, so the ranks still checkpoint together).
The template's scheduling directives may change only while the Job is suspended and its
`status.startTime` is unset: the Job controller clears it once a suspended Job's pods are gone
(checked on kube-apiserver v1.36.2, tests/test_k8s_fallback.py)."""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from spotguard.supervisor.capacity_type import directives_of, merge_patch
from spotguard.supervisor.jobs.base import JobAdapter
from spotguard.kube.api import JOBS


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


ROLE = "template"


class BatchJobAdapter(JobAdapter):
    resource = JOBS
    kind = "Job"
    replica_role = ROLE
    optional = False

    def replicas(self, obj: Mapping[str, Any]) -> int:
        return _int((obj.get("spec") or {}).get("parallelism"), 1)

    def default_max(self, obj: Mapping[str, Any]) -> int:
        spec = obj.get("spec") or {}
        return _int(spec.get("completions"), 0) or self.replicas(obj)

    def suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def running_replicas(self, obj: Mapping[str, Any]) -> int | None:
        """The Job controller's `status.ready`: active pods whose Ready condition is True."""
        ready = (obj.get("status") or {}).get("ready")
        return ready if isinstance(ready, int) and not isinstance(ready, bool) and ready >= 0 else None

    def pod_spec(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        return ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}

    def directives(self, obj: Mapping[str, Any]) -> dict[str, dict]:
        return {ROLE: directives_of(self.pod_spec(obj))}

    def directives_patch(self, obj: Mapping[str, Any], desired: Mapping[str, Mapping]) -> dict:
        patch = merge_patch(self.directives(obj)[ROLE], dict(desired.get(ROLE) or {}))
        return {"spec": {"template": {"spec": patch}}} if patch else {}

    def template_mutable(self, obj: Mapping[str, Any]) -> bool:
        return self.suspended(obj) and not (obj.get("status") or {}).get("startTime")

    def scale_patch(self, replicas: int) -> dict:
        return {"spec": {"parallelism": replicas}}

    def suspend_patch(self, suspend: bool, replicas: int | None = None) -> dict:
        spec: dict = {"suspend": suspend}
        if not suspend and replicas is not None:
            spec["parallelism"] = replicas
        return {"spec": spec}
