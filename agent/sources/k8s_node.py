"""Kubernetes node source (`k8s.node`): the cluster's own signals that this node is going away.

Watches ONE Node object and turns these marks into `drain` notices (deadline None):
- taint `karpenter.sh/disrupted` (any effect, any value);
- taint `karpenter.sh/disruption=disrupting` (older Karpenter releases);
- taint `ToBeDeletedByClusterAutoscaler` (its value, a unix timestamp, is kept in `detail`);
- taint `cloud.google.com/impending-node-termination`;
- `spec.unschedulable: true` (a cordon, e.g. by `kubectl drain`).
Each notice's id comes from (node, the Node object's `metadata.uid`, signal), so it is stable
across watches and agent restarts, and a Node re-created under the same name (a new VM
registering) gives new ids; a removed taint or an uncordon withdraws it, as does the Node's
deletion. A Node without a uid (the API server always sets one) still yields its notices, with
the fallback instance part (`instance.py`), counted as error `instance_id:missing`.

The Kubernetes access layer (`spotguard.kube.api`) is blocking, so a daemon thread runs list + watch (field selector
`metadata.name=<node>`, also filtered by name here) and hands each new Node state, or each
error, to the event loop. After an error or a 410 (watch expired) it re-lists and re-watches,
with backoff on consecutive errors. `close()` (called when `run()` ends, cancellation
included) stops the thread: the watch socket is shut down, so it does not wait for a timeout.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.instance import FALLBACK, count_failure
from spotguard.backoff import Backoff
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, notice_id, now_utc
from spotguard.kube.api import NODES, ApiError, Kube, MalformedResponse, WatchStream

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

SOURCE_NAME = "k8s.node"
UNSCHEDULABLE = "unschedulable"
CLUSTER_AUTOSCALER_TAINT = "ToBeDeletedByClusterAutoscaler"
WATCH_SECONDS = 300  # server-side watch timeout; the client's read timeout is a little longer
HTTP_GONE = 410
MIN_HEALTHY_WATCH = 1.0  # seconds; a watch that ends sooner is treated as failing (backoff)


def drain_signals(node: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The drain signals a Node object (raw JSON dict) shows: {signal: detail}. None: no Node."""
    if not isinstance(node, Mapping):
        return {}
    spec = node.get("spec")
    if not isinstance(spec, Mapping):
        return {}
    signals: dict[str, dict[str, Any]] = {}
    taints = spec.get("taints")
    for taint in taints if isinstance(taints, list) else ():
        if not isinstance(taint, Mapping) or not isinstance(taint.get("key"), str):
            continue
        key, value = taint["key"], taint.get("value")
        if key == "karpenter.sh/disruption" and value != "disrupting":
            continue
        if key not in ("karpenter.sh/disrupted", "karpenter.sh/disruption", CLUSTER_AUTOSCALER_TAINT,
                       "cloud.google.com/impending-node-termination"):
            continue
        detail: dict[str, Any] = {"signal": "taint", "key": key}
        for field in ("value", "effect", "timeAdded"):
            if isinstance(taint.get(field), str):
                detail[field] = taint[field]
        signals[key] = detail
    metadata = node.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    # the cordon annotation is written by the node marker when it cordons
    cordoned_by_us = isinstance(annotations, Mapping) and names.ANN_CORDONED in annotations
    if spec.get("unschedulable") is True and not cordoned_by_us:
        # A cordon the agent itself made (node marking with --cordon) is an echo of a notice
        # it already has, not a new signal: reporting it would keep the node marked forever.
        signals[UNSCHEDULABLE] = {"signal": UNSCHEDULABLE, "unschedulable": True}
    return signals


def node_uid(node: Mapping[str, Any] | None) -> str | None:
    """The Node object's `metadata.uid`, or None when it has none (or is no Node)."""
    metadata = node.get("metadata") if isinstance(node, Mapping) else None
    uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
    return uid if isinstance(uid, str) and 0 < len(uid) <= 128 else None


def node_notices(node_name: str, node: Mapping[str, Any] | None, instance: str = FALLBACK) -> list[Notice]:
    """One `drain` notice per signal on the Node, with ids stable per (node, instance, signal);
    `instance` is the Node's uid."""
    now = now_utc()
    return [Notice(id=notice_id(SOURCE_NAME, node_name, instance, signal), kind=Kind.DRAIN, source=SOURCE_NAME,
                   node=node_name, detected_at=now, deadline=None, detail=detail)
            for signal, detail in sorted(drain_signals(node).items())]


@dataclass(frozen=True)
class _NodeState:
    node: dict[str, Any] | None  # None: the Node does not exist (or was deleted)


@dataclass(frozen=True)
class _WatchError:
    reason: str
    message: str


class _Stopped(Exception):
    """The watcher thread was asked to stop."""


class NodeSource(Source):
    """Drain notices for one Node, from a list + watch on the Kubernetes API.

    `api_client` is a `kubernetes.client.ApiClient` (see `spotguard.kube.load_api_client`); the
    source uses it from its own thread and does not close it. `poll()` waits until the Node
    changes (the first call returns the listed state) and raises SourceError for an error the
    watcher thread met; the thread recovers by itself, so the next poll may succeed at once.
    """

    name = SOURCE_NAME

    def __init__(self, api_client: Any, node: str, *, request_timeout: float = 10.0,
                 watch_seconds: int = WATCH_SECONDS, backoff: Backoff | None = None):
        super().__init__(node, interval=0.0)
        self.api_client = api_client
        self.kube = Kube(api_client, request_timeout=request_timeout)
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self.watch_backoff = backoff or Backoff(base=0.5, cap=10.0)
        self.lists = 0  # list calls made by the watcher thread (re-lists included)
        self._items: collections.deque[_NodeState | _WatchError] = collections.deque()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._watch_lock = threading.Lock()
        self._watch: WatchStream | None = None  # the watch in progress, to stop it from the loop

    # -- the async side ----------------------------------------------------------------------

    async def poll(self) -> list[Notice]:
        self._ensure_thread()
        while not self._items:
            self._wakeup.clear()
            await self._wakeup.wait()
        item = self._items.popleft()  # in order: states coalesce on arrival, errors are kept
        if isinstance(item, _WatchError):
            raise SourceError(item.reason, item.message)
        uid = node_uid(item.node)
        if uid is None and item.node is not None:
            first = count_failure(self.stats.errors, "missing") == 1
            log.log(logging.WARNING if first else logging.DEBUG,
                    "Node %s has no metadata.uid: its notice ids fall back to the node name", self.node)
        return node_notices(self.node, item.node, uid or FALLBACK)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()  # a fresh one: a straggler from before close() stays stopped
        self._thread = threading.Thread(target=self._watch_forever, args=(self._stop,),
                                        name=f"k8s-node-watch:{self.node}", daemon=True)
        self._thread.start()

    def _push(self, item: _NodeState | _WatchError, stop: threading.Event) -> None:
        """Hands an item to the event loop (called from the watcher thread that owns `stop`)."""
        loop = self._loop
        if loop is None or loop.is_closed() or stop.is_set():
            raise _Stopped()

        def deliver() -> None:
            if stop.is_set():  # nothing from a thread that close() already gave up on
                return
            if isinstance(item, _NodeState) and self._items and isinstance(self._items[-1], _NodeState):
                self._items[-1] = item  # only the newest state of the Node matters
            else:
                self._items.append(item)
            self._wakeup.set()
        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop closed under us
            raise _Stopped() from None

    async def close(self) -> None:
        """Stops the watcher thread; waits for it (bounded) without blocking the loop."""
        thread = self._thread
        self._stop.set()
        if thread is None:
            return
        deadline = time.monotonic() + self.request_timeout + 1.0
        while thread.is_alive() and time.monotonic() < deadline:
            self._interrupt_watch()  # repeated: the thread may be between list and watch
            await asyncio.sleep(0.02)
        if thread.is_alive():
            log.warning("k8s node watcher for %s did not stop in time", self.node)
        self._thread = None

    def _interrupt_watch(self) -> None:
        with self._watch_lock:
            watch = self._watch
        if watch is not None:
            watch.close()

    # -- the watcher thread ------------------------------------------------------------------

    def _watch_forever(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                watch_started: float | None = None
                try:
                    resource_version = self._list(stop)
                    watch_started = time.monotonic()
                    self._watch_from(resource_version, stop)
                    reason = None  # the server ended the watch (its timeout): re-list, watch again
                except _Stopped:
                    return
                except Exception as exc:  # every failure: report it, back off, re-list
                    if stop.is_set():
                        return
                    reason, message = _classify(exc)
                    if reason != "gone":
                        self._push(_WatchError(reason, message), stop)
                lasted = 0.0 if watch_started is None else time.monotonic() - watch_started
                if reason in (None, "gone") and lasted >= MIN_HEALTHY_WATCH:
                    # A watch that ran a while and then ended or expired (410) is routine.
                    log.info("k8s node watch for %s ended (%s): re-listing", self.node, reason or "timeout")
                    self.watch_backoff.reset()
                    continue
                stop.wait(self.watch_backoff.next_delay())  # never spin on a failing API
        except _Stopped:
            return

    def _list(self, stop: threading.Event) -> str | None:
        """Lists the Node; pushes its state; returns the list's resourceVersion."""
        if stop.is_set():
            raise _Stopped()
        self.lists += 1
        try:
            items, version = self.kube.list(NODES, None, field_selector=f"metadata.name={self.node}")
        except MalformedResponse:
            raise SourceError("malformed", "node list: body is not JSON") from None
        mine = [item for item in items if _name_of(item) == self.node]
        self._push(_NodeState(mine[0] if mine else None), stop)
        return version or None

    def _watch_from(self, resource_version: str | None, stop: threading.Event) -> None:
        """Streams watch events for the Node until the watch ends, fails or is stopped."""
        if stop.is_set():
            raise _Stopped()
        stream = self.kube.watch(NODES, None, resource_version or "", timeout_seconds=self.watch_seconds,
                                 field_selector=f"metadata.name={self.node}")
        with self._watch_lock:
            self._watch = stream
        try:
            if stop.is_set():
                raise _Stopped()
            for event in stream:
                if stop.is_set():
                    raise _Stopped()
                kind, obj = event.get("type"), event.get("object")
                if kind == "ERROR":
                    error = obj if isinstance(obj, dict) else {}
                    raise ApiError(int(error.get("code") or 0), str(error.get("message") or "watch error"))
                if kind == "BOOKMARK" or _name_of(obj) != self.node:
                    continue
                if kind in ("ADDED", "MODIFIED"):
                    self._push(_NodeState(obj), stop)
                elif kind == "DELETED":
                    self._push(_NodeState(None), stop)
            # The server closed the watch (its timeout): re-list and watch again.
        finally:
            with self._watch_lock:
                self._watch = None
            stream.close()  # closes this watch's connection


def _name_of(obj: Any) -> str | None:
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else None


def _classify(exc: BaseException) -> tuple[str, str]:
    """A metrics label and a message for a list/watch failure."""
    if isinstance(exc, SourceError):
        return exc.reason, str(exc)
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:  # spotguard.kube.api.ApiError
        if status == HTTP_GONE:
            return "gone", "watch expired (410)"
        label = "http_5xx" if status >= 500 else f"http_{status}"
        return label, f"Kubernetes API: {status} {getattr(exc, 'reason', '')}".strip()
    return "connect", f"Kubernetes API: {exc.__class__.__name__}: {exc}"


def k8s_node_source(node: str, api_client: Any) -> NodeSource:
    """The Kubernetes node source for `node`, using `api_client` (see spotguard.kube)."""
    return NodeSource(api_client, node)
