"""Leader election on a coordination.k8s.io/v1 Lease, so two replicas never act twice.

Protocol (the one client-go uses):
- the holder renews `spec.renewTime` every `renew_period`; every write is a merge patch with
  `metadata.resourceVersion` as precondition, so of two candidates writing the same version
  only one succeeds (the other gets 409 and stays a follower);
- a candidate takes the lease only after it has seen the same lease record (holder, renewTime,
  resourceVersion) unchanged for `lease_duration` on its own monotonic clock (no clock skew);
- the holder counts itself leader only until `renew_deadline` (< lease_duration) after the
  start of its last successful write, so it stops acting before anyone else may start;
- on a clean stop the holder releases the lease (empty holder), so a successor starts at once.
`is_leader()` is cheap; call it right before each action.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, UTC
from collections.abc import Callable

from spotguard.kube.api import LEASES, ApiError, Conflict, Kube, NotFound

log = logging.getLogger(__name__)


def _micro_time(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """See the module docstring."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, lease_duration: float = 15.0,
                 renew_deadline: float | None = None, renew_period: float | None = None,
                 on_change: Callable[[bool], None] | None = None, clock: Callable[[], float] = time.monotonic):
        if lease_duration <= 0:
            raise ValueError("lease_duration must be > 0")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline if renew_deadline is not None else lease_duration * 2 / 3
        self.renew_period = renew_period if renew_period is not None else lease_duration / 5
        if not 0 < self.renew_period < self.renew_deadline < lease_duration:
            raise ValueError("need 0 < renew_period < renew_deadline < lease_duration")
        self.on_change = on_change
        self.clock = clock
        self._valid_until = 0.0
        self._observed: tuple | None = None
        self._observed_at = 0.0
        self._was_leader = False
        self.transitions = 0

    def is_leader(self) -> bool:
        return self.clock() < self._valid_until

    def _notify(self) -> None:
        leader = self.is_leader()
        if leader != self._was_leader:
            self._was_leader = leader
            log.info("leadership %s", "acquired" if leader else "lost", extra={"identity": self.identity})
            if self.on_change is not None:
                self.on_change(leader)

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking). True when we hold the lease afterwards."""
        started = self.clock()
        now = datetime.now(UTC)
        spec_new = {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.lease_duration)),
                    "renewTime": _micro_time(now)}
        try:
            lease = self.kube.get(LEASES, self.namespace, self.name)
        except NotFound:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec_new, "acquireTime": _micro_time(now), "leaseTransitions": 0}}
            try:
                self.kube.create(LEASES, self.namespace, body)
            except Conflict:
                return False
            self._valid_until = started + self.renew_deadline
            return True
        spec = lease.get("spec") or {}
        meta = lease.get("metadata") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), meta.get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, started
        if holder and holder != self.identity:
            duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
            if started < self._observed_at + duration:
                self._valid_until = 0.0
                return False
        if holder == self.identity:
            spec_new["acquireTime"] = spec.get("acquireTime") or _micro_time(now)
            spec_new["leaseTransitions"] = spec.get("leaseTransitions") or 0
        else:
            spec_new["acquireTime"] = _micro_time(now)
            spec_new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        body = {"spec": spec_new}
        if meta.get("resourceVersion"):
            body["metadata"] = {"resourceVersion": meta["resourceVersion"]}
        try:
            self.kube.patch(LEASES, self.namespace, self.name, body)
        except (Conflict, NotFound):
            return False
        if holder != self.identity:
            self.transitions += 1
        self._valid_until = started + self.renew_deadline
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Campaigns and renews until `stop` is set; then releases the lease if held."""
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.try_acquire_or_renew)
            except ApiError as exc:
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            except Exception:
                log.exception("lease %s/%s: election attempt crashed", self.namespace, self.name)
            self._notify()
            delay = self.renew_period
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
        await self.release()

    async def release(self) -> None:
        """Gives the lease up if we hold it (best effort)."""
        if not self.is_leader():
            return
        self._valid_until = 0.0
        self._notify()
        try:
            lease = await asyncio.to_thread(self.kube.get, LEASES, self.namespace, self.name)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            body = {"spec": {"holderIdentity": "", "leaseDurationSeconds": 1}}
            rv = (lease.get("metadata") or {}).get("resourceVersion")
            if rv:
                body["metadata"] = {"resourceVersion": rv}
            await asyncio.to_thread(self.kube.patch, LEASES, self.namespace, self.name, body)
        except ApiError as exc:
            log.warning("releasing lease %s/%s failed: %s", self.namespace, self.name, exc)
