"""The background upload of the local tier to the object store, in submission order.

One worker thread per store runs the jobs in the order they came: a rank's part (its files, then its
part manifest) and, on rank 0, the remote commit of a tag (which waits for every rank's part).
A heartbeat thread re-puts this writer's lease while it has jobs, so `cleanup` elsewhere leaves
its tags alone. `tier(tag)` tells how far a tag got: "local" (durable on local disk, upload
queued or running), "object" (every job of the tag ended well: this rank's part and, on rank 0,
the commit are in the object store), "failed" (a job of the tag failed; the local copy remains).

A process that exits (a drained rank raising SystemExit included) waits for its uploads: the wait
is registered with `threading`'s exit callbacks, which run before `concurrent.futures` stops taking
work (boto3's transfers need it); a SIGKILL, or the node's end, loses what was not uploaded.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from .client import describe_failure
from .remote import RemoteCheckpoints

log = logging.getLogger(__name__)

LOCAL, OBJECT, FAILED = "local", "object", "failed"


class Uploader:
    """Runs upload jobs in order on one thread; see the module docstring."""

    def __init__(self, remote: RemoteCheckpoints):
        self.remote = remote
        self.writer_id = uuid.uuid4().hex
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spotguard-upload")
        self._mutex = threading.Lock()
        self._tiers: dict[str, str] = {}
        self._in_flight: dict[str, int] = {}
        self._futures: list[concurrent.futures.Future] = []
        self._wake = threading.Condition(self._mutex)
        self._closed = False
        self._heartbeat: threading.Thread | None = None
        self._exit_hooked = False

    def tier(self, tag: str) -> str | None:
        """"local", "object", "failed", or None for a tag this uploader never saw."""
        with self._mutex:
            return self._tiers.get(tag)

    def submit(self, tag: str, job: Callable[[], Any]) -> concurrent.futures.Future:
        """Queues `job` for `tag`; the tag's tier is "object" once its jobs all ended well."""
        with self._mutex:
            if self._closed:
                raise RuntimeError("the uploader is closed")
            if not self._in_flight.get(tag):  # a fresh attempt at this tag
                self._tiers[tag] = LOCAL
            self._in_flight[tag] = self._in_flight.get(tag, 0) + 1
            first = len(self._futures) == 0 or all(f.done() for f in self._futures)
            future = self._pool.submit(self._run, tag, job)
            self._futures = [f for f in self._futures if not f.done()] + [future]
            self._wake.notify_all()
        if first:
            self._ensure_heartbeat()
            self._wait_at_exit()
        return future

    def _wait_at_exit(self) -> None:
        with self._mutex:
            if self._exit_hooked:
                return
            self._exit_hooked = True
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return
        with contextlib.suppress(RuntimeError):  # already shutting down
            register(self._drain_at_exit)

    def _drain_at_exit(self) -> None:
        with self._mutex:
            pending = [f for f in self._futures if not f.done()]
        if pending:
            log.warning("waiting for %d checkpoint upload(s) to %s before exiting", len(pending), self.remote.url)
            self.wait()

    def _run(self, tag: str, job: Callable[[], Any]) -> Any:
        try:
            self.remote.put_lease(self.writer_id, self._lease_tags())
            return job()
        except BaseException as exc:
            with self._mutex:
                self._tiers[tag] = FAILED
            log.error("upload of checkpoint %s to %s failed: %s", tag, self.remote.url, describe_failure(exc),
                      extra={"tag": tag})
            raise
        finally:
            with self._mutex:
                self._in_flight[tag] -= 1
                if not self._in_flight[tag]:
                    del self._in_flight[tag]
                    if self._tiers.get(tag) != FAILED:
                        self._tiers[tag] = OBJECT
                idle = not self._in_flight
            if idle:
                try:
                    self.remote.drop_lease(self.writer_id)
                except Exception as exc:  # an expired lease is as good as a dropped one
                    log.warning("cannot drop the upload lease in %s: %s", self.remote.url, describe_failure(exc))

    def _lease_tags(self) -> list[str]:
        with self._mutex:
            return list(self._in_flight)

    def _ensure_heartbeat(self) -> None:
        with self._mutex:
            if self._heartbeat is not None and self._heartbeat.is_alive():
                return
            self._heartbeat = threading.Thread(target=self._beat, name="spotguard-upload-lease", daemon=True)
            self._heartbeat.start()

    def _beat(self) -> None:
        period = max(self.remote.lease_seconds / 3, 0.05)
        while True:
            with self._mutex:
                self._wake.wait_for(lambda: self._closed or bool(self._in_flight))
                if self._closed and not self._in_flight:
                    return
                self._wake.wait(period)
                tags = list(self._in_flight)
            if tags:
                try:
                    self.remote.put_lease(self.writer_id, tags)
                except Exception as exc:
                    log.warning("cannot renew the upload lease in %s: %s", self.remote.url, describe_failure(exc))

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every job submitted so far ended; True when all did within `timeout`."""
        with self._mutex:
            futures = list(self._futures)
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def close(self, timeout: float | None = None) -> bool:
        """Waits for the jobs (up to `timeout`), then stops taking new ones; True when all ended."""
        finished = self.wait(timeout)
        with self._mutex:
            self._closed = True
            self._wake.notify_all()
        self._pool.shutdown(wait=finished)
        return finished
