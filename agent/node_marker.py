"""Marks the Kubernetes Node with the live notices: annotation, taint, Events, optional cordon.

The marker is a level-triggered reconciler. `notify(live)` records the desired state (the set
of live notices) and wakes it; the latest state wins, whatever came before. Each pass reads the
Node and, only where it differs, patches it to:
- annotation `spotguard.io/notice`: the wire JSON of the live notice the supervisor must see
  (node_marks.marked_notice: the first to depart whatever a job's horizon, per
  `spotguard.wire.notice_policy.departure_order`: a departing kind before a risk or an advisory;
  among them no deadline (any moment) first, then the earliest deadline; ties by detection time,
  then id); absent when none is live;
- taint `spotguard.io/reclaim=<kind of that notice>:NoSchedule`: the taint list is patched as
  a WHOLE list (other taints kept as the server returned them) in a strategic-merge patch that
  carries the Node's resourceVersion, so a concurrent change makes the API server answer 409:
  the marker then re-reads and retries;
- with `cordon=True`: `spec.unschedulable: true`, recorded in annotation `spotguard.io/cordoned`
  only when the marker made it; when no notice is live it undoes only a cordon so recorded;
- annotation `spotguard.io/notice-boot-id`: the Node's bootID when marked (for the rule below).
Then it posts a core/v1 Event (reason SpotguardNotice) about each live notice on the Node and on
each pod running there with label `spotguard.io/inject: "true"` (pods listed with the field
selector spec.nodeName=<node> and filtered again client-side), once per notice and object:
Event names are derived from (notice id, object), so a restarted agent gets 409 AlreadyExists
instead of posting twice.

The parts: the marks are planned by pure functions (`agent/node_marks.py`), applied here by
one conditional patch per pass (409: `spotguard.kube.conflict.retry_on_conflict` re-reads and
re-plans), and the Events are posted by `agent/node_events.py`.

Failures (API errors, an unreachable server, 409s beyond a few immediate retries) are counted
and retried with exponential backoff and jitter, always with the latest desired state: nothing
is dropped. All Kubernetes calls run in a worker thread, never on the event loop.

When marks are removed (the restart rules):
- a mark this process placed is removed as soon as its notice is no longer live (withdrawn);
- a mark found at start (placed by an earlier agent) is kept until `notify()` has been called
  and `startup_grace` seconds have passed without its notice coming back, so a restarted agent
  whose sources have not polled yet does not flap the annotation;
- maintenance reboot: a mark found at start whose notice is a maintenance notice whose deadline
  has passed, on a Node whose bootID differs from the one recorded at marking (or where either
  is unknown), is removed at once, even before the first `notify()` — unless a live notice has
  that id (then it is kept, as live).
`stop()` stops the reconciler and KEEPS the marks (a restarted agent takes them over).

Advisory notices (`Notice.advisory`, e.g. GPU warnings) are information, never marks: they
set no annotation, taint or cordon and post no SpotguardNotice Events. Each advisory that
becomes live posts one Warning Event on the Node (reason: its detail's `signal`; message: the
GPU and the detail, which says `"cordon": true` when the policy recommends a cordon), again
only after it was withdrawn and came back.

Besides the notices, `event(reason, message, type)` posts a one-off Event on the Node, and
`warn(reason, message)` does the same without blocking, at most once per `warn_interval`
seconds for the same text.

RBAC the agent needs: nodes get/patch, pods list (all namespaces), events create.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib

from spotguard.agent.node_events import NodeEventPoster
from spotguard.agent.node_marks import MarkPlan, plan_marks
from spotguard.wire.notice import Notice, now_utc
from spotguard.backoff import Backoff
from spotguard.kube.api import NODES, STRATEGIC_MERGE_PATCH, Kube
from spotguard.kube.conflict import retry_on_conflict

log = logging.getLogger(__name__)

PATCH_TYPE = STRATEGIC_MERGE_PATCH


class NodeMarker:
    """See the module docstring. `api_client`: a kubernetes ApiClient (spotguard.kube), or `kube`:
    a `Kube` to use instead (the dry-run's local API)."""

    def __init__(self, api_client, node: str, cordon: bool = False, event_pods: bool = True,
                 backoff: Backoff | None = None, *, startup_grace: float = 10.0,
                 event_namespace: str = "default", request_timeout: float = 5.0, conflict_retries: int = 5,
                 kube: Kube | None = None):
        self.kube = kube if kube is not None else Kube(api_client, request_timeout=request_timeout)
        self.node = node
        self.cordon = cordon
        self.backoff = backoff or Backoff(base=0.5, cap=30.0)
        self.startup_grace = startup_grace
        self.conflict_retries = conflict_retries
        self.events = NodeEventPoster(self.kube, node, event_pods=event_pods, event_namespace=event_namespace)
        self._stats: dict[str, int] = {"marked": 0, "unmarked": 0, "conflicts": 0, "errors": 0}
        self.last_error: str | None = None
        self.in_sync = False  # the last pass applied the latest desired state
        self._desired: list[Notice] | None = None  # None until the first notify()
        self._version = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started_at = time.monotonic()
        self._mine: set[str] = set()  # notice ids this process wrote into the annotation
        self.warn_interval = 60.0
        self._warned: dict[tuple[str, str], float] = {}
        self._pending: set[asyncio.Task] = set()
        self._advised: set[str] = set()  # ids of the live advisories already posted as Events

    @property
    def stats(self) -> dict[str, int]:
        """Counters: marked, unmarked, conflicts, errors, events."""
        return {**self._stats, "events": self.events.stats["events"]}

    # ---- the interface the agent uses --------------------------------------------------------
    def notify(self, live: list[Notice]) -> None:
        """Records the live notices as the desired state and wakes the reconciler. Non-blocking;
        call it from the event loop's thread. Advisories only post their Events (module docstring)."""
        self._advise([n for n in live if n.advisory])
        self._desired = [n for n in live if not n.advisory]
        self._version += 1
        self.in_sync = False
        self._wake.set()

    async def start(self) -> None:
        """Starts the reconciler task (one pass at once: the maintenance-reboot rule)."""
        if self._task is None or self._task.done():
            self._started_at = time.monotonic()
            self._task = asyncio.create_task(self._run(), name=f"node-marker:{self.node}")

    async def stop(self) -> None:
        """Stops the reconciler; the marks stay on the Node."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._pending:  # warn() posts in flight: give them a moment, then drop them
            _, late = await asyncio.wait(set(self._pending), timeout=1.0)
            for t in late:
                t.cancel()

    async def event(self, reason: str, message: str, type: str = "Warning") -> bool:
        """Posts one Event on the Node (e.g. a GPU warning); True if posted. Never raises; the
        caller rate-limits (each call is one Event)."""
        name = f"{self.node}.{uuidlib.uuid4().hex[:16]}"
        try:
            created = await asyncio.to_thread(self.events.post, name, self.events.node_ref(None), reason, message, type)
        except Exception as exc:  # counted and logged: an Event is advisory
            self._stats["errors"] += 1
            self.last_error = _describe(exc)
            log.warning("node %s: event %s not posted: %s", self.node, reason, self.last_error)
            return False
        return created

    def warn(self, reason: str, message: str, type: str = "Warning") -> None:
        """Non-blocking `event()` for callbacks (GPU warnings): schedules the post on the running
        loop. The same (reason, message) is posted at most once per `warn_interval` seconds."""
        now = time.monotonic()
        key = (reason, message)
        if now - self._warned.get(key, -self.warn_interval) < self.warn_interval:
            return
        self._warned[key] = now
        if len(self._warned) > 1024:  # forget the oldest: bounded memory
            for old in sorted(self._warned, key=self._warned.__getitem__)[:512]:
                del self._warned[old]
        task = asyncio.get_running_loop().create_task(self.event(reason, message, type))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _advise(self, advisories: list[Notice]) -> None:
        """Posts a Warning Event for each advisory not live at the last notify()."""
        for notice in advisories:
            if notice.id not in self._advised:
                detail = {k: v for k, v in notice.detail.items() if k != "gpu"}
                reason = str(detail.get("signal") or notice.kind.value)
                self.warn(reason, f"GPU {notice.detail.get('gpu', 'unknown')}: {reason} {detail}")
        self._advised = {n.id for n in advisories}

    # ---- the reconciler ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()
            version, desired = self._version, self._desired
            try:
                plan = await asyncio.to_thread(self._sync, desired)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: count, back off, retry the latest state
                self._stats["errors"] += 1
                self.last_error = _describe(exc)
                delay = self.backoff.next_delay()
                log.warning("node %s: marking failed (%s); retrying in %.2fs", self.node, self.last_error, delay,
                            extra={"node": self.node})
                await self._pause(delay)
                continue
            self.backoff.reset()
            if self._version != version:
                continue
            self.in_sync = desired is not None and plan.recheck_in is None
            await self._pause(plan.recheck_in)

    async def _pause(self, seconds: float | None) -> None:
        """Sleeps `seconds` (None: until woken); a notify() wakes it early."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    def _sync(self, desired: list[Notice] | None) -> MarkPlan:
        """One pass (worker thread): mark/unmark the Node, then post the missing Events."""
        seen: list[dict] = []

        def mark() -> MarkPlan:
            node = self.kube.get(NODES, None, self.node)
            seen[:] = [node]
            plan = plan_marks(node, desired, mine=self._mine, cordon=self.cordon, now=now_utc(),
                              grace_left=self.startup_grace - (time.monotonic() - self._started_at))
            if plan.adopted is not None:
                self._mine.add(plan.adopted)
            if plan.patch is not None:
                self._patch_node(plan.patch, plan.marked)
            return plan

        plan = retry_on_conflict(mark, self.conflict_retries, self._count_conflict)
        self.events.post_notices(desired or [], seen[0])
        return plan

    def _count_conflict(self) -> None:
        self._stats["conflicts"] += 1
        log.info("node %s: conflict on patch; re-reading", self.node)

    def _patch_node(self, patch: dict, marked: str | None) -> None:
        self.kube.patch(NODES, None, self.node, patch, content_type=STRATEGIC_MERGE_PATCH)
        if marked is not None:
            self._mine.add(marked)
            self._stats["marked"] += 1
            log.info("node %s: marked with notice %s", self.node, marked, extra={"notice_id": marked})
        else:
            self._stats["unmarked"] += 1
            log.info("node %s: marks removed", self.node)


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if status:
        return f"HTTP {status}"
    return f"{type(exc).__name__}: {exc}"[:300]
