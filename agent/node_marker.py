"""Marks the Kubernetes Node with the live notices: annotation, taint, Events, optional cordon.

The marker is a level-triggered reconciler. `notify(live)` records the desired state (the set
of live notices) and wakes it; the latest state wins, whatever came before. Each pass reads the
Node and, only where it differs, patches it to:
- annotation `spotguard.io/notice`: the wire JSON of the most urgent live notice (earliest
  deadline; none sorts last; ties by detection time, then id); absent when none is live;
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

Besides the notices, `event(reason, message, type)` posts a one-off Event on the Node, and
`warn(reason, message)` does the same without blocking (for callbacks such as GPU warnings),
at most once per `warn_interval` seconds for the same text.

RBAC the agent needs: nodes get/patch, pods list (all namespaces), events create.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid as uuidlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.wire.notice import Kind, Notice, NoticeFormatError, format_time, now_utc
from spotguard.backoff import Backoff
from spotguard.wire import names
from spotguard.wire.urgency import most_urgent

log = logging.getLogger(__name__)

PATCH_TYPE = "application/strategic-merge-patch+json"

@dataclass
class _Pass:
    """What one reconcile pass found: when to look again for a removal held back (seconds)."""

    recheck_in: float | None = None


class _Conflict(Exception):
    """The Node kept changing under us: 409 on every immediate retry."""


class NodeMarker:
    """See the module docstring. `api_client`: a kubernetes ApiClient (spotguard.kube)."""

    def __init__(self, api_client, node: str, cordon: bool = False, event_pods: bool = True,
                 backoff: Backoff | None = None, *, startup_grace: float = 10.0,
                 event_namespace: str = "default", request_timeout: float = 5.0, conflict_retries: int = 5):
        import kubernetes

        self.core = kubernetes.client.CoreV1Api(api_client)
        self._api_exception = kubernetes.client.rest.ApiException
        self.node = node
        self.cordon = cordon
        self.event_pods = event_pods
        self.backoff = backoff or Backoff(base=0.5, cap=30.0)
        self.startup_grace = startup_grace
        self.event_namespace = event_namespace
        self.request_timeout = request_timeout
        self.conflict_retries = conflict_retries
        self.stats: dict[str, int] = {"marked": 0, "unmarked": 0, "conflicts": 0, "errors": 0, "events": 0}
        self.last_error: str | None = None
        self.in_sync = False  # the last pass applied the latest desired state
        self._desired: list[Notice] | None = None  # None until the first notify()
        self._version = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._started_at = time.monotonic()
        self._mine: set[str] = set()  # notice ids this process wrote into the annotation
        self._events_done: dict[str, set[tuple[str, str, str]]] = {}
        self.warn_interval = 60.0
        self._warned: dict[tuple[str, str], float] = {}
        self._pending: set[asyncio.Task] = set()

    # ---- the interface the agent uses --------------------------------------------------------
    def notify(self, live: list[Notice]) -> None:
        """Records the live notices as the desired state and wakes the reconciler. Non-blocking;
        call it from the event loop's thread."""
        self._desired = list(live)
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
            created = await asyncio.to_thread(self._create_event, name, self._node_ref(None), reason, message, type)
        except Exception as exc:  # counted and logged: an Event is advisory
            self.stats["errors"] += 1
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
            for old in sorted(self._warned, key=self._warned.get)[:512]:
                del self._warned[old]
        task = asyncio.get_running_loop().create_task(self.event(reason, message, type))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # ---- the reconciler ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()
            version, desired = self._version, self._desired
            try:
                result = await asyncio.to_thread(self._sync, desired)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: count, back off, retry the latest state
                self.stats["errors"] += 1
                self.last_error = _describe(exc)
                delay = self.backoff.next_delay()
                log.warning("node %s: marking failed (%s); retrying in %.2fs", self.node, self.last_error, delay,
                            extra={"node": self.node})
                await self._pause(delay)
                continue
            self.backoff.reset()
            if self._version != version:
                continue
            self.in_sync = desired is not None and result.recheck_in is None
            await self._pause(result.recheck_in)

    async def _pause(self, seconds: float | None) -> None:
        """Sleeps `seconds` (None: until woken); a notify() wakes it early."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _sync(self, desired: list[Notice] | None) -> _Pass:
        """One pass (worker thread): mark/unmark the Node, then post the missing Events."""
        result = _Pass()
        for _ in range(self.conflict_retries):
            node = self._read_node()
            patch, marked, result = self._plan(node, desired)
            if patch is None:
                break
            try:
                self._patch_node(patch, marked)
            except self._api_exception as exc:
                if exc.status == 409:
                    self.stats["conflicts"] += 1
                    log.info("node %s: conflict on patch; re-reading", self.node)
                    continue
                raise
            break
        else:
            raise _Conflict(f"409 on {self.conflict_retries} patches in a row")
        if desired:
            self._post_events(desired, node)
        live_ids = {n.id for n in desired or ()}
        for gone in self._events_done.keys() - live_ids:
            del self._events_done[gone]
        return result

    def _plan(self, node: dict, desired: list[Notice] | None) -> tuple[dict | None, str | None, _Pass]:
        """The patch that brings `node` to the desired marks (None: already there or held back),
        the id of the notice it marks (None: it unmarks), and when to look again."""
        meta = node.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        spec = node.get("spec") or {}
        taints = list(spec.get("taints") or [])
        boot_id = ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID") or None
        current_text = annotations.get(names.ANN_NOTICE)
        current = _parse_notice(current_text)
        urgent = most_urgent(desired or ())
        result = _Pass()

        if urgent is not None:
            want_marked = True
        elif current_text is None and names.ANN_CORDONED not in annotations and not _our_taints(taints):
            return None, None, result  # nothing of ours on the Node
        elif self._rebooted_past(current, annotations.get(names.ANN_NOTICE_BOOT_ID), boot_id, desired):
            log.info("node %s: maintenance notice %s ended with a reboot: cleaning up", self.node,
                     current.id if current else "?")
            want_marked = False
        elif desired is None:
            return None, None, result  # no view of the live notices yet: keep what is there
        elif current is None or current.id in self._mine:
            want_marked = False
        else:
            held = self.startup_grace - (time.monotonic() - self._started_at)
            if held > 0:
                result.recheck_in = held
                return None, None, result
            want_marked = False

        changes: dict[str, Any] = {}
        spec_changes: dict[str, Any] = {}
        others = [t for t in taints if t.get("key") != names.TAINT_RECLAIM]
        if want_marked:
            text = urgent.to_json()
            if current_text != text:
                changes[names.ANN_NOTICE] = text
            if boot_id and annotations.get(names.ANN_NOTICE_BOOT_ID) != boot_id:
                changes[names.ANN_NOTICE_BOOT_ID] = boot_id
            ours = _our_taints(taints)
            wanted = {"key": names.TAINT_RECLAIM, "value": str(urgent.kind), "effect": names.TAINT_EFFECT}
            if len(ours) != 1 or {k: ours[0].get(k) for k in wanted} != wanted:
                spec_changes["taints"] = others + [wanted]
            if self.cordon and not spec.get("unschedulable") and names.ANN_CORDONED not in annotations:
                spec_changes["unschedulable"] = True
                changes[names.ANN_CORDONED] = "true"
        else:
            for key in (names.ANN_NOTICE, names.ANN_NOTICE_BOOT_ID, names.ANN_CORDONED):
                if key in annotations:
                    changes[key] = None
            if len(others) != len(taints):
                spec_changes["taints"] = others
            if annotations.get(names.ANN_CORDONED) == "true" and spec.get("unschedulable"):
                spec_changes["unschedulable"] = False
        if not changes and not spec_changes:
            if want_marked:
                self._mine.add(urgent.id)
            return None, None, result
        patch: dict[str, Any] = {"metadata": {}}
        if meta.get("resourceVersion"):
            patch["metadata"]["resourceVersion"] = meta["resourceVersion"]
        if changes:
            patch["metadata"]["annotations"] = changes
        if spec_changes:
            patch["spec"] = spec_changes
        return patch, urgent.id if want_marked else None, result

    def _rebooted_past(self, current: Notice | None, marked_boot: str | None, boot_id: str | None,
                       desired: list[Notice] | None) -> bool:
        """The maintenance-reboot rule (see the module docstring)."""
        if current is None or current.kind is not Kind.MAINTENANCE or current.id in self._mine:
            return False
        if current.deadline is None or current.deadline > now_utc():
            return False
        if desired is not None and any(n.id == current.id for n in desired):
            return False
        return not (marked_boot and boot_id and marked_boot == boot_id)

    # ---- Kubernetes calls (worker thread) ------------------------------------------------------
    def _read_node(self) -> dict:
        resp = self.core.read_node(self.node, _preload_content=False, _request_timeout=self.request_timeout)
        return json.loads(resp.data)

    def _patch_node(self, patch: dict, marked: str | None) -> None:
        self.core.patch_node(self.node, patch, _content_type=PATCH_TYPE, _preload_content=False,
                             _request_timeout=self.request_timeout)
        if marked is not None:
            self._mine.add(marked)
            self.stats["marked"] += 1
            log.info("node %s: marked with notice %s", self.node, marked, extra={"notice_id": marked})
        else:
            self.stats["unmarked"] += 1
            log.info("node %s: marks removed", self.node)

    def _post_events(self, desired: list[Notice], node: dict) -> None:
        targets = [self._node_ref(node)]
        if self.event_pods:
            targets += self._opted_in_pods()
        for notice in desired:
            done = self._events_done.setdefault(notice.id, set())
            for ref in targets:
                key = (ref["kind"], ref.get("namespace", ""), ref["name"])
                if key in done:
                    continue
                digest = hashlib.sha256(json.dumps([notice.id, *key]).encode()).hexdigest()[:16]
                name = f"{ref['name'][:200]}.{digest}"
                self._create_event(name, ref, names.EVENT_NOTICE, _message(notice), "Warning",
                                   annotations={names.ANN_NOTICE + "-id": notice.id})
                done.add(key)

    def _opted_in_pods(self) -> list[dict]:
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", label_selector=f"{names.LABEL_INJECT}=true",
            _preload_content=False, _request_timeout=self.request_timeout)
        refs = []
        for pod in json.loads(resp.data).get("items") or []:
            meta = pod.get("metadata") or {}
            if (pod.get("spec") or {}).get("nodeName") != self.node:
                continue  # the field selector is a request, not a promise: filter again
            if (meta.get("labels") or {}).get(names.LABEL_INJECT) != "true":
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or not meta.get("name"):
                continue
            ref = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                   "namespace": meta.get("namespace") or "default"}
            if meta.get("uid"):
                ref["uid"] = meta["uid"]
            refs.append(ref)
        return refs

    def _node_ref(self, node: dict | None) -> dict:
        ref = {"apiVersion": "v1", "kind": "Node", "name": self.node}
        uid = ((node or {}).get("metadata") or {}).get("uid")
        if uid:
            ref["uid"] = uid
        return ref

    def _create_event(self, name: str, ref: dict, reason: str, message: str, type: str,
                      annotations: dict | None = None) -> bool:
        """Creates one Event; True if created, False if it already existed (409)."""
        namespace = ref.get("namespace") or self.event_namespace
        stamp = now_utc().strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"name": name, "namespace": namespace, **({"annotations": annotations} if annotations else {})},
            "involvedObject": ref,
            "reason": reason,
            "message": message[:1024],
            "type": type,
            "source": {"component": names.COMPONENT_AGENT, "host": self.node},
            "reportingComponent": names.COMPONENT_AGENT,
            "reportingInstance": self.node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(namespace, body, _preload_content=False,
                                              _request_timeout=self.request_timeout)
        except self._api_exception as exc:
            if exc.status == 409:
                return False
            raise
        self.stats["events"] += 1
        return True


def _our_taints(taints: list[dict]) -> list[dict]:
    return [t for t in taints if t.get("key") == names.TAINT_RECLAIM]


def _parse_notice(text: str | None) -> Notice | None:
    if not text:
        return None
    try:
        return Notice.from_json(text)
    except NoticeFormatError:
        return None  # not ours to read: treated as a foreign mark that we replace or remove


def _message(notice: Notice) -> str:
    deadline = "no deadline" if notice.deadline is None else f"deadline {format_time(notice.deadline)}"
    return f"{notice.kind} notice from {notice.source} ({deadline}); id {notice.id}"


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]
