"""The local API server: `LocalKube` is the `spotguard.kube.api.Kube` the supervisor and the
node agents use, over objects kept in this process.

What it does, as the API server does it (and what the product relies on):
- resources: the ones it serves (Nodes, Pods, Events, Jobs, Leases by default); another one
  (a PyTorchJob without its CRD) is 404 on every call, so the supervisor's optional informer
  keeps waiting for it;
- every write stamps a new, increasing `metadata.resourceVersion`; a patch whose body carries
  `metadata.resourceVersion` other than the stored one changes nothing and raises `Conflict`
  (409); create of an existing name is `Conflict` too (AlreadyExists); unknown objects `NotFound`;
- `patch`: JSON merge patch (null deletes), strategic merge (415 on a custom resource, as the
  API server answers), JSON patch (patches.py); `status=True` writes only `status` (the status
  subresource), and a write of the main resource leaves `status` alone; the update rules of
  validation.py (422) for Jobs and Pods;
- `list` / `watch` with label selectors (`{key: value}`) and field selectors (selectors.py);
  a watch from a version replays what happened since (410 once that history is gone), from ""
  starts with the current objects as ADDED, ends at its timeout, and `close()` ends it from any
  thread (watch.py);
- `delete` (not in the `Kube` interface: the cluster's own controllers use it): a bound, running
  Pod gets `deletionTimestamp` (now + its grace period) and stays until its kubelet deletes it
  with grace 0; anything else goes at once;
- `bind` (the scheduler's pods/binding): sets `spec.nodeName` once;
- admission: `admit(resource, hook)` runs `hook(obj)` on every create of that resource before it
  is stored (the dry-run's mutating webhook); `subscribe(listener)`: `listener(kind, resource,
  obj)` after every write, outside the lock, with the event's type, `str(resource)` and the
  object written (the deleted one for DELETED; shared: read it, never change it). The cluster's
  controllers wake on it, the dry-run follows the supervisor's records with it.
All methods are thread-safe and never block on I/O.
"""
from __future__ import annotations

import builtins
import collections
import copy
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from spotguard.kube.api import (EVENTS, JOBS, JSON_PATCH, LEASES, MERGE_PATCH, NODES, PODS, STRATEGIC_MERGE_PATCH,
                                ApiError, Conflict, Kube, NotFound, Resource)
from spotguard.trainer.cluster.patches import json_patch, merge_patch, strategic_merge_patch
from spotguard.trainer.cluster.selectors import field_terms, matches
from spotguard.trainer.cluster.validation import Invalid, check_job_update, check_pod_update
from spotguard.trainer.cluster.watch import LocalWatch

SERVED: tuple[Resource, ...] = (NODES, PODS, EVENTS, JOBS, LEASES)
BUILT_IN_GROUPS = ("", "batch", "coordination.k8s.io")
WITH_STATUS = (str(NODES), str(PODS), str(JOBS))  # resources whose status is a subresource
DEFAULT_GRACE = 30
IDENTITY = ("name", "namespace", "uid", "creationTimestamp", "resourceVersion")  # no patch changes these
HISTORY = 2000  # events a watch can resume from (older: 410, the informer lists again)
Key = tuple[str, str, str]  # (resource, namespace, name)


def rfc3339(t: float | None = None) -> str:
    """A Kubernetes timestamp (whole seconds, UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def _copy(obj: Any) -> Any:
    """A deep copy of a JSON-shaped object (dicts, lists, scalars), as copy.deepcopy makes it, in
    a fraction of its time (the dry-run copies every object it lists or watches); anything else
    goes through copy.deepcopy."""
    if isinstance(obj, dict):
        return {key: _copy(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_copy(value) for value in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return copy.deepcopy(obj)


def _meta(obj: Mapping[str, Any]) -> dict:
    return obj.setdefault("metadata", {})  # type: ignore[attr-defined]


class LocalKube(Kube):
    """See the module docstring."""

    def __init__(self, served: tuple[Resource, ...] = SERVED, history: int = HISTORY):
        self.timeout = 15.0
        self._lock = threading.RLock()
        self._served = {str(r): r for r in served}
        self._objects: dict[Key, dict] = {}
        self._version = 0
        self._history: collections.deque[tuple[int, str, str, str, dict | None, dict | None]] = \
            collections.deque(maxlen=history)
        self._forgotten = 0  # the newest resourceVersion no longer in the history
        self._watches: list[LocalWatch] = []
        self._listeners: list[Callable[[str, str, dict], None]] = []
        self._written: list[tuple[str, str, dict]] = []  # this write's events, for the listeners
        self._admission: dict[str, list[Callable[[dict], None]]] = {}
        self._checks: dict[str, Callable[[Mapping, Mapping], None]] = {str(JOBS): check_job_update,
                                                                        str(PODS): check_pod_update}

    # ---- hooks ---------------------------------------------------------------------------------
    def admit(self, res: Resource, hook: Callable[[dict], None]) -> None:
        self._admission.setdefault(str(res), []).append(hook)

    def subscribe(self, listener: Callable[[str, str, dict], None]) -> None:
        self._listeners.append(listener)

    # ---- reads ---------------------------------------------------------------------------------
    def list(self, res: Resource, namespace: str | None = None, *, label_selector: Mapping[str, str] | None = None,
             field_selector: str | None = None) -> tuple[builtins.list[dict], str]:
        key = self._served_key(res)
        fields = self._fields(field_selector)
        with self._lock:
            items = [_copy(obj) for (k, ns, _), obj in sorted(self._objects.items())
                     if k == key and (namespace is None or not res.namespaced or ns == namespace)
                     and matches(obj, label_selector, fields)]
            return items, str(self._version)

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        key = self._served_key(res)
        with self._lock:
            obj = self._objects.get((key, self._ns(res, namespace), name))
            if obj is None:
                raise NotFound(404, f'{res.plural} "{name}" not found')
            return _copy(obj)

    def watch(self, res: Resource, namespace: str | None, resource_version: str, *, timeout_seconds: int = 300,
              label_selector: Mapping[str, str] | None = None, field_selector: str | None = None) -> Any:
        key = self._served_key(res)
        stream = LocalWatch(key, namespace if res.namespaced else None, label_selector,
                            self._fields(field_selector), timeout_seconds)
        with self._lock:
            if not resource_version:
                for (k, ns, _), obj in sorted(self._objects.items()):
                    if stream.wants(k, ns):
                        stream.offer("ADDED", None, _copy(obj))
            elif int(resource_version) < self._forgotten:
                stream.error(410, f"too old resource version: {resource_version} ({self._forgotten})")
                return stream
            else:
                for version, k, ns, kind, old, new in self._history:
                    if version > int(resource_version) and stream.wants(k, ns):
                        stream.offer(kind, _copy(old), _copy(new))
            self._watches.append(stream)
        return stream

    # ---- writes --------------------------------------------------------------------------------
    def create(self, res: Resource, namespace: str | None, body: Mapping[str, Any]) -> dict:
        key = self._served_key(res)
        obj = _copy(dict(body))
        meta = _meta(obj)
        meta["namespace"] = self._ns(res, namespace)
        if not res.namespaced:
            meta.pop("namespace")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = str(meta["generateName"]) + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise ApiError(422, "metadata.name: Required value")
        for hook in self._admission.get(key, []):
            hook(obj)
        meta = _meta(obj)  # a hook may have replaced it
        with self._lock:
            where = (key, self._ns(res, namespace), meta["name"])
            if where in self._objects:
                raise Conflict(409, f'{res.plural} "{meta["name"]}" already exists')
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=rfc3339(), generation=1)
            self._store("ADDED", where, None, obj)
            result = _copy(obj)
        self._notify()
        return result

    def patch(self, res: Resource, namespace: str | None, name: str, body: Mapping[str, Any] | builtins.list, *,
              status: bool = False, content_type: str = MERGE_PATCH) -> dict:
        key = self._served_key(res)
        apply, wanted = self._patcher(res, content_type, body)
        with self._lock:
            where = (key, self._ns(res, namespace), name)
            old = self._objects.get(where)
            if old is None:
                raise NotFound(404, f'{res.plural} "{name}" not found')
            if wanted is not None and str(wanted) != old["metadata"].get("resourceVersion"):
                stored = old["metadata"].get("resourceVersion")
                raise Conflict(409, f"the object has been modified (resourceVersion {stored}, not {wanted}); "
                                    "please apply your changes to the latest version")
            new = self._patched(old, apply, status, key)
            if new == old:
                return _copy(old)
            if not status and key in self._checks:
                try:
                    self._checks[key](old, new)
                except Invalid as exc:
                    raise ApiError(422, str(exc)) from None
            if new.get("spec") != old.get("spec"):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            self._store("MODIFIED", where, old, new)
            result = _copy(new)
        self._notify()
        return result

    @staticmethod
    def _patched(old: dict, apply: Callable[[dict], Any], status: bool, key: str) -> dict:
        """`old` patched: only its status through the status subresource, all but its status
        through the main resource of one that has the subresource; its identity kept."""
        try:
            candidate = apply(old)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(candidate, dict):
            raise ApiError(422, "the patched object is not an object")
        if status:
            new = {**_copy(old), "status": candidate.get("status")}
        else:
            new = {**candidate, "status": _copy(old.get("status"))} if key in WITH_STATUS else candidate
        if new.get("status") is None:
            new.pop("status", None)
        kept = {k: old["metadata"][k] for k in IDENTITY if k in old["metadata"]}
        new["metadata"] = {**new.get("metadata", {}), **kept}
        return new

    def delete(self, res: Resource, namespace: str | None, name: str, grace_seconds: float | None = None) -> None:
        """See the module docstring; NotFound when there is no such object."""
        key = self._served_key(res)
        with self._lock:
            where = (key, self._ns(res, namespace), name)
            old = self._objects.get(where)
            if old is None:
                raise NotFound(404, f'{res.plural} "{name}" not found')
            grace = grace_seconds if grace_seconds is not None else \
                (old.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE)
            if key == str(PODS) and self._running(old) and grace > 0:
                if old["metadata"].get("deletionTimestamp"):
                    return
                new = _copy(old)
                new["metadata"].update(deletionTimestamp=rfc3339(time.time() + grace),
                                       deletionGracePeriodSeconds=int(grace))
                self._store("MODIFIED", where, old, new)
            else:
                self._store("DELETED", where, old, None)
        self._notify()

    def bind(self, namespace: str, name: str, node: str) -> dict:
        """pods/binding: `spec.nodeName` set once (409 when the pod is bound already)."""
        with self._lock:
            where = (str(PODS), namespace, name)
            old = self._objects.get(where)
            if old is None:
                raise NotFound(404, f'pods "{name}" not found')
            if (old.get("spec") or {}).get("nodeName"):
                raise Conflict(409, f'pod "{name}" is already assigned to node "{old["spec"]["nodeName"]}"')
            new = _copy(old)
            new.setdefault("spec", {})["nodeName"] = node
            self._store("MODIFIED", where, old, new)
            result = _copy(new)
        self._notify()
        return result

    # ---- internals -----------------------------------------------------------------------------
    def _store(self, kind: str, where: Key, old: dict | None, new: dict | None) -> None:
        """Under the lock: a new version, the object stored (or removed), the event recorded and
        offered to the watches."""
        self._version += 1
        if new is not None:
            new["metadata"]["resourceVersion"] = str(self._version)
            self._objects[where] = new
        else:
            self._objects.pop(where, None)
            old = _copy(old)
            if old is not None:
                old["metadata"]["resourceVersion"] = str(self._version)
        if len(self._history) == self._history.maxlen:
            self._forgotten = self._history[0][0]
        entry = (self._version, where[0], where[1], kind, _copy(old), _copy(new))
        self._history.append(entry)
        self._written.append((kind, where[0], entry[5] if entry[5] is not None else entry[4] or {}))
        self._watches = [w for w in self._watches if not w.closed]
        for stream in self._watches:
            if stream.wants(where[0], where[1]):
                stream.offer(kind, _copy(old), _copy(new))

    def _notify(self) -> None:
        with self._lock:
            written, self._written = self._written, []
        for kind, resource, obj in written:
            for listener in list(self._listeners):
                listener(kind, resource, obj)

    def _served_key(self, res: Resource) -> str:
        key = str(res)
        if key not in self._served:
            raise NotFound(404, f"the server could not find the requested resource ({res})")
        return key

    @staticmethod
    def _ns(res: Resource, namespace: str | None) -> str:
        if not res.namespaced:
            return ""
        if not namespace:
            raise ApiError(400, f"{res.plural}: a namespace is required")
        return namespace

    @staticmethod
    def _fields(selector: str | None) -> builtins.list[tuple[str, str, bool]]:
        try:
            return field_terms(selector)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @staticmethod
    def _patcher(res: Resource, content_type: str, body: Any) -> tuple[Callable[[dict], Any], str | None]:
        """How to apply `body` (a function of the stored object) and the resourceVersion it
        requires (None: unconditional)."""
        if content_type == JSON_PATCH:
            if not isinstance(body, builtins.list):
                raise ApiError(400, "a JSON patch is a list of operations")
            ops = _copy(body)
            return (lambda old: json_patch(old, ops)), None
        if content_type == STRATEGIC_MERGE_PATCH and res.group not in BUILT_IN_GROUPS:
            raise ApiError(415, f"strategic merge patch is not supported for {res} (a custom resource)")
        if content_type not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
            raise ApiError(415, f"unsupported media type {content_type!r}")
        if not isinstance(body, Mapping):
            raise ApiError(400, "the patch body is not a JSON object")
        patch = _copy(dict(body))
        wanted = (patch.get("metadata") or {}).pop("resourceVersion", None)
        merge = strategic_merge_patch if content_type == STRATEGIC_MERGE_PATCH else merge_patch
        return (lambda old: merge(old, patch)), wanted

    @staticmethod
    def _running(pod: Mapping[str, Any]) -> bool:
        """Bound to a node and not finished: its kubelet has a container to stop."""
        bound = bool((pod.get("spec") or {}).get("nodeName"))
        return bound and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
