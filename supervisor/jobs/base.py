"""The job adapter interface: what the supervisor needs to know and change about a job kind.

An adapter is stateless and works on plain API dicts. To support another kind (e.g. JobSet),
implement these members and add an instance to `ADAPTERS` in jobs/__init__.py; the controller
watches `resource` (optional: skipped while the API server does not serve it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any
from collections.abc import Mapping

from spotguard.kube.api import Resource


class JobAdapter(ABC):
    """See the module docstring. `obj` is the job as the API returns it."""

    resource: Resource
    kind: str
    optional: bool = True  # a CRD-backed kind may not be installed
    replica_role: str  # the key of `directives()` whose pods are the scalable replicas

    @abstractmethod
    def replicas(self, obj: Mapping[str, Any]) -> int:
        """The replicas the job asks for now (elastic target)."""

    @abstractmethod
    def default_max(self, obj: Mapping[str, Any]) -> int:
        """max-replicas when the annotation is absent: the job's full size."""

    def default_min(self, obj: Mapping[str, Any]) -> int | None:
        """min-replicas when the annotation is absent (None: the policy's default)."""
        return None

    @abstractmethod
    def suspended(self, obj: Mapping[str, Any]) -> bool: ...

    def running_replicas(self, obj: Mapping[str, Any]) -> int | None:
        """How many replica pods run, as the job's own status reports it (None: it reports none)."""
        return None

    @abstractmethod
    def pod_spec(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        """The pod spec of one replica (requests, nodeSelector, tolerations)."""

    def role_pod_specs(self, obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """The pod spec of every pod role the job makes (each role runs a Guard): where the
        settings the job's pods must share are read (the notice horizon)."""
        return [self.pod_spec(obj)]

    def is_replica_pod(self, pod: Mapping[str, Any]) -> bool:
        """Whether a pod owned by the job counts as one of its scalable replicas."""
        return True

    @abstractmethod
    def scale_patch(self, replicas: int) -> dict:
        """Merge-patch body that sets the replicas."""

    @abstractmethod
    def suspend_patch(self, suspend: bool, replicas: int | None = None) -> dict:
        """Merge-patch body that suspends, or resumes (at `replicas` when given)."""

    @abstractmethod
    def directives(self, obj: Mapping[str, Any]) -> dict[str, dict]:
        """{pod role: its scheduling directives (capacity_type.DIRECTIVES)}."""

    @abstractmethod
    def directives_patch(self, obj: Mapping[str, Any], desired: Mapping[str, Mapping]) -> dict:
        """Merge-patch body that sets each role's directives to exactly `desired[role]`."""

    def template_mutable(self, obj: Mapping[str, Any]) -> bool:
        """Whether the API server accepts a change of the pod templates' scheduling directives now."""
        return self.suspended(obj)

    def finished(self, obj: Mapping[str, Any]) -> bool:
        """True once the job completed or failed for good: no decisions any more."""
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond.get("type") in ("Complete", "Failed", "Succeeded") and cond.get("status") == "True":
                return True
        return False

    def owns(self, owner_ref: Mapping[str, Any]) -> bool:
        api_version = str(owner_ref.get("apiVersion", ""))
        group = api_version.split("/")[0] if "/" in api_version else ""
        return owner_ref.get("kind") == self.kind and group == self.resource.group


def merge(*patches: Mapping[str, Any]) -> dict:
    """Deep-merges merge-patch bodies (later wins)."""
    out: dict = {}
    for patch in patches:
        for key, value in patch.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = dict(value) if isinstance(value, Mapping) else value
    return out
