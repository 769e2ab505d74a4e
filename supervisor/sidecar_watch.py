"""Pods that asked for the spotguard sidecar and run without it, made visible.

The injector's webhook has `failurePolicy: Ignore` (a broken injector never blocks scheduling),
so while it is not ready (being installed, its certificate not made yet, every replica down) a
pod labelled `spotguard.io/inject: "true"` is admitted as it is: no sidecar relays notices to its
ranks, no preStop hook holds its termination, and its grace period stays the pod's own
(Kubernetes' default: 30 s). The supervisor already watches every pod and may create Events, so
it tells, with no new RBAC:
- `MissingSidecars.observe(kind, payload)`, for each event of the supervisor's pod informer (on
  the event loop), keeps the live pods that asked for the sidecar and lack it (`missing_sidecar`)
  and sets the gauge `spotguard_pods_missing_sidecar{namespace}` (every replica: the alert takes
  the max);
- `warn()` (in a task after an event that needs it, `follow`, and at each resync; only the leader
  writes) posts one Warning Event `SpotguardSidecarMissing` on each such pod not warned about
  yet, named after the pod and its uid, so that another replica's or a new leader's is refused
  (409) and the pod shows it once; a failed post is tried again at the next event or resync.
  The message says what the pod lacks and what to do: delete it once the injector is ready, and
  its controller makes it again, with the sidecar.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from spotguard.kube.api import ApiError
from spotguard.metrics import Gauge
from spotguard.wire import names
from spotguard.wire.injection import UNINJECTED_NAMESPACES, wants_injection

log = logging.getLogger("spotguard.supervisor.sidecar_watch")

EVENT_SIDECAR_MISSING = "SpotguardSidecarMissing"
DEFAULT_GRACE_SECONDS = 30  # Kubernetes' terminationGracePeriodSeconds when the pod sets none

CreateEvent = Callable[..., Awaitable[bool]]  # JobEffects.create_event: False when not the leader


def missing_sidecar(pod: Mapping[str, Any]) -> bool:
    """A live pod that asked for the sidecar (in a namespace the webhook serves) and has none."""
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    return (wants_injection(pod) and meta.get("namespace") not in UNINJECTED_NAMESPACES
            and not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed"))


def warning_message(pod: Mapping[str, Any]) -> str:
    """What the Event on such a pod says."""
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
    return (f"this pod asked for the spotguard sidecar (label {names.LABEL_INJECT}=true) but was admitted "
            f"without it: the injector's webhook did not answer (failurePolicy Ignore). No reclaim notice "
            f"reaches its ranks, no preStop hook holds its termination, and its grace period is {grace}s. "
            f"Once the spotguard-injector Deployment is ready, delete the pod: its controller makes it "
            f"again, with the sidecar.")


class MissingSidecars:
    """See the module docstring. `create_event(obj, key=, reason=, message=, event_type=, action=)`
    posts an Event on `obj` (the supervisor's, which writes only while it leads)."""

    def __init__(self, gauge: Gauge, create_event: CreateEvent):
        self.gauge = gauge
        self._create_event = create_event
        self._missing: dict[str, Mapping[str, Any]] = {}  # uid -> pod
        self._warned: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def pods(self) -> list[Mapping[str, Any]]:
        return list(self._missing.values())

    def follow(self, kind: str, payload: Any) -> None:
        """`observe`, then `warn` in a task when a pod needs an Event (call on the event loop)."""
        if self.observe(kind, payload):
            task = asyncio.get_running_loop().create_task(self.warn(), name="supervisor-sidecar-warning")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def observe(self, kind: str, payload: Any) -> bool:
        """Takes one informer event (`SYNC` with every pod, or ADDED / MODIFIED / DELETED with
        one); True when a pod not yet warned about is missing its sidecar."""
        if kind == "SYNC":
            self._missing = {_uid(p): p for p in payload if missing_sidecar(p)}
        elif kind == "DELETED" or not missing_sidecar(payload):
            self._missing.pop(_uid(payload), None)
        else:
            self._missing[_uid(payload)] = payload
        self._warned &= set(self._missing)
        self.gauge.clear()
        for pod in self._missing.values():
            self.gauge.inc(namespace=(pod.get("metadata") or {}).get("namespace", ""))
        return bool(set(self._missing) - self._warned)

    async def warn(self) -> None:
        """One Warning Event on each missing pod not warned about yet (only the leader posts)."""
        for uid, pod in list(self._missing.items()):
            if uid in self._warned:
                continue
            obj = {"apiVersion": "v1", "kind": "Pod", **pod}  # a listed pod carries neither
            try:
                posted = await self._create_event(obj, key=f"sidecar-missing-{uid.replace('-', '')[:16]}",
                                                  reason=EVENT_SIDECAR_MISSING, message=warning_message(pod),
                                                  event_type="Warning", action="Admit")
            except ApiError as exc:  # tried again at the next event or resync
                log.warning("could not post %s on pod %s: %s", EVENT_SIDECAR_MISSING, uid, exc)
                continue
            if posted:
                self._warned.add(uid)
                meta = pod.get("metadata") or {}
                log.warning("pod %s/%s runs without the spotguard sidecar (the injector did not answer)",
                            meta.get("namespace"), meta.get("name"))


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
