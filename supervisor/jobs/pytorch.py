"""Kubeflow PyTorchJobs (kubeflow.org/v1), watched only while the CRD is served.

Replicas are `spec.pytorchReplicaSpecs.Worker.replicas`; defaults for min/max come from
`spec.elasticPolicy.minReplicas/maxReplicas`; suspension is `spec.runPolicy.suspend`. Only
worker pods (label `training.kubeflow.org/replica-type: worker`) count as replicas. The
scheduling directives of every replica type (Master, Worker) move together; a suspended
PyTorchJob's templates may change (the CRD sets no rule against it).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from spotguard.supervisor.capacity_type import directives_of, merge_patch
from spotguard.supervisor.jobs.base import JobAdapter
from spotguard.kube.api import PYTORCHJOBS

REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"


def _worker(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return specs.get("Worker") or {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class PyTorchJobAdapter(JobAdapter):
    resource = PYTORCHJOBS
    kind = "PyTorchJob"
    replica_role = "Worker"
    optional = True

    def replicas(self, obj: Mapping[str, Any]) -> int:
        return _int(_worker(obj).get("replicas")) or 0

    def default_max(self, obj: Mapping[str, Any]) -> int:
        elastic = (obj.get("spec") or {}).get("elasticPolicy") or {}
        return _int(elastic.get("maxReplicas")) or self.replicas(obj)

    def default_min(self, obj: Mapping[str, Any]) -> int | None:
        elastic = (obj.get("spec") or {}).get("elasticPolicy") or {}
        return _int(elastic.get("minReplicas"))

    def suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def running_replicas(self, obj: Mapping[str, Any]) -> int | None:
        """The training operator's `status.replicaStatuses.Worker.active`: Worker pods Running and
        not being deleted (None before the operator wrote a status)."""
        workers = ((obj.get("status") or {}).get("replicaStatuses") or {}).get("Worker")
        return _int(workers.get("active", 0)) if isinstance(workers, Mapping) else None

    def pod_spec(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        return (_worker(obj).get("template") or {}).get("spec") or {}

    def role_pod_specs(self, obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        return [((spec.get("template") or {}).get("spec") or {}) for _, spec in sorted(specs.items())
                if isinstance(spec, Mapping)]

    def is_replica_pod(self, pod: Mapping[str, Any]) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return str(labels.get(REPLICA_TYPE_LABEL, "worker")).lower() == "worker"

    def directives(self, obj: Mapping[str, Any]) -> dict[str, dict]:
        specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        return {role: directives_of((spec.get("template") or {}).get("spec")) for role, spec in sorted(specs.items())
                if isinstance(spec, Mapping)}

    def directives_patch(self, obj: Mapping[str, Any], desired: Mapping[str, Mapping]) -> dict:
        current = self.directives(obj)
        roles = {}
        for role, wanted in desired.items():
            if role in current and (patch := merge_patch(current[role], dict(wanted))):
                roles[role] = {"template": {"spec": patch}}
        return {"spec": {"pytorchReplicaSpecs": roles}} if roles else {}

    def scale_patch(self, replicas: int) -> dict:
        return {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": replicas}}}}

    def suspend_patch(self, suspend: bool, replicas: int | None = None) -> dict:
        patch: dict = {"spec": {"runPolicy": {"suspend": suspend}}}
        if not suspend and replicas is not None:
            patch["spec"]["pytorchReplicaSpecs"] = {"Worker": {"replicas": replicas}}
        return patch
