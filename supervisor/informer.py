"""List-then-watch of one resource in a dedicated thread, delivering to the event loop.

Contract: `on_event(kind, payload)` runs on the event loop: first ("SYNC", [objects]) with the
complete current list (after every relist too, so the receiver can drop objects deleted while
the watch was down), then ("ADDED"|"MODIFIED"|"DELETED", object) for each change. A watch that
ends is resumed from the last resourceVersion; a 410 Gone or any error relists after a jittered
backoff. An `optional` resource that is not served (404, e.g. a CRD not installed) is retried
every `absent_retry` seconds. `stop()` ends the thread promptly (it closes the open stream).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any
from collections.abc import Callable, Mapping

from spotguard.backoff import Backoff
from spotguard.kube.api import ApiError, Kube, NotFound, Resource, WatchStream, matches_labels

log = logging.getLogger(__name__)


class Informer:
    """See the module docstring."""

    def __init__(self, kube: Kube, res: Resource, namespace: str | None, on_event: Callable[[str, Any], None],
                 loop: asyncio.AbstractEventLoop, *, label_selector: Mapping[str, str] | None = None,
                 optional: bool = False, absent_retry: float = 60.0, watch_timeout: int = 300):
        self.kube, self.res, self.namespace = kube, res, namespace
        self.on_event, self.loop = on_event, loop
        self.label_selector = dict(label_selector or {})
        self.optional, self.absent_retry, self.watch_timeout = optional, absent_retry, watch_timeout
        self.synced = asyncio.Event()
        self.served = True
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{res.plural}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Blocking: ends the watch and joins the thread (call via asyncio.to_thread)."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        self._thread.join(timeout)

    def _deliver(self, kind: str, payload: Any) -> None:
        if self._stop.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(self.on_event, kind, payload)
        except RuntimeError:  # loop closed
            self._stop.set()

    def _wanted(self, obj: Mapping[str, Any]) -> bool:
        return not self.label_selector or matches_labels(obj, self.label_selector)

    def _set_synced(self) -> None:
        self.loop.call_soon_threadsafe(self.synced.set)

    def _run(self) -> None:
        backoff = Backoff(base=0.2, cap=10.0)
        while not self._stop.is_set():
            try:
                items, version = self.kube.list(self.res, self.namespace, label_selector=self.label_selector)
                self.served = True
                self._deliver("SYNC", [i for i in items if self._wanted(i)])
                self._set_synced()
                backoff.reset()
                self._watch(version)
            except NotFound:
                if not self.optional:
                    log.error("%s is not served by the API server; retrying", self.res)
                self.served = False
                self._deliver("SYNC", [])
                self._set_synced()
                self._stop.wait(self.absent_retry)
            except ApiError as exc:
                if self._stop.is_set():
                    return
                delay = backoff.next_delay()
                log.warning("watch of %s failed (%s); relisting in %.1fs", self.res, exc, delay)
                self._stop.wait(delay)
            except Exception:  # never let the thread die
                log.exception("watch of %s crashed; relisting", self.res)
                self._stop.wait(backoff.next_delay())

    def _watch(self, version: str) -> None:
        """Streams events until the watch must be relisted (410) or stop() is called."""
        while not self._stop.is_set():
            stream = self.kube.watch(self.res, self.namespace, version, timeout_seconds=self.watch_timeout,
                                     label_selector=self.label_selector)
            self._stream = stream
            if self._stop.is_set():
                stream.close()
                return
            for event in stream:
                kind, obj = event.get("type"), event["object"]
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        return  # too old: relist
                    raise ApiError(int(code or 0), str(obj.get("message", "watch error")))
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    version = str(new_version)
                if kind == "BOOKMARK":
                    continue
                if kind in ("ADDED", "MODIFIED") and not self._wanted(obj):
                    kind = "DELETED"  # a label was removed: the object left the selection
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._deliver(kind, obj)
            self._stream = None
