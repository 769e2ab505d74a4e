"""The background upload of the local tier to the object store, in submission order.

One worker thread per store runs the jobs in the order they came: a rank's part (its files, then its
part manifest) and, on rank 0, the remote commit of a tag (which waits for every rank's part).
A heartbeat thread re-puts this writer's lease while it has jobs, so `cleanup` elsewhere leaves
its tags alone. `tier(tag)` tells how far this process's jobs of a tag got: "local" (durable on
local disk, upload queued, running or being retried), "object" (every job of the tag ended well),
"failed" (a job of the tag failed for good, or its part was dropped; the local copy remains).

Retries (upload_policy.py): a job that fails with a transport error (an outage, a reset, a 5xx) is
tried again after a backoff (`spotguard.backoff.Backoff`, full jitter, `retry_base`..`retry_cap`
seconds) until `retry_seconds` after its first failure; the jobs behind it wait (order matters: a
commit needs its parts). So an upload interrupted by an outage goes on when the server answers
again, within the notice's grace when the outage is shorter. Every failed try counts in
`metrics` (`spotguard_checkpoint_upload_failures_total`) and is logged; a job that fails for good
is passed to every `on_failure` listener (the adapters' `async_error`; a part dropped by the bound
below is no failure: it is by design, logged and counted).

The bound of the local tier: at most `max_queued_parts` of this rank's parts wait or upload at a
time (their staged hard links are what the local tier holds beyond the `keep_last` checkpoints).
Queuing one more drops the oldest part not yet started, never the newest and never the one
uploading (`parts_to_drop`): its job and the tag's queued commit are cancelled, its `on_drop`
runs (the store removes the staged files and tells the committing rank), a warning is logged and
`spotguard_checkpoint_uploads_dropped_total` counts it.

A process that exits (a drained rank raising SystemExit included) waits for its uploads, without
new retries: the wait is registered with `threading`'s exit callbacks, which run before
`concurrent.futures` stops taking work (boto3's transfers need it); a SIGKILL, or the node's end,
loses what was not uploaded.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotguard.backoff import Backoff
from spotguard.metrics import Registry

from .client import describe_failure
from .remote import RemoteCheckpoints
from .upload_policy import QueuedPart, RetryBudget, parts_to_drop, retriable

log = logging.getLogger(__name__)

LOCAL, OBJECT, FAILED = "local", "object", "failed"
PART, COMMIT = "part", "commit"


@dataclass(frozen=True)
class RetryPolicy:
    """How failing jobs are retried: backoff from `base` to `cap` seconds, for `seconds` in all."""

    seconds: float = 300.0
    base: float = 0.2
    cap: float = 5.0


@dataclass
class _Job:
    tag: str
    kind: str
    run: Callable[[], Any]
    size: int = 0
    on_drop: Callable[[], None] | None = None
    on_end: Callable[[], None] | None = None
    started: bool = False
    future: concurrent.futures.Future | None = None


class UploadMetrics:
    """The uploader's metrics (Prometheus text through `registry.render()`)."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.failures = self.registry.counter("spotguard_checkpoint_upload_failures_total",
                                              "Failed tries of checkpoint uploads and commits to the object store",
                                              ["kind"])
        self.dropped = self.registry.counter("spotguard_checkpoint_uploads_dropped_total",
                                             "Queued part uploads dropped to keep the local tier within its bound")
        self.queued = self.registry.gauge("spotguard_checkpoint_uploads_queued",
                                          "Part uploads held in staging (waiting or uploading)")
        self.queued_bytes = self.registry.gauge("spotguard_checkpoint_upload_queued_bytes",
                                                "Bytes of the part uploads held in staging")


class Uploader:
    """Runs upload jobs in order on one thread; see the module docstring."""

    def __init__(self, remote: RemoteCheckpoints, *, retry: RetryPolicy | None = None, max_queued_parts: int = 2):
        if max_queued_parts < 2:
            raise ValueError("max_queued_parts must be at least 2 (the part uploading and the newest)")
        self.remote = remote
        self.retry = retry or RetryPolicy()
        self.max_queued_parts = max_queued_parts
        self.writer_id = uuid.uuid4().hex
        self.metrics = UploadMetrics()
        self.on_failure: list[Callable[[str, BaseException], None]] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spotguard-upload")
        self._mutex = threading.Lock()
        self._tiers: dict[str, str] = {}
        self._in_flight: dict[str, int] = {}
        self._jobs: list[_Job] = []
        self._wake = threading.Condition(self._mutex)
        self._closed = False
        self._no_retries = False
        self._heartbeat: threading.Thread | None = None
        self._exit_hooked = False

    def tier(self, tag: str) -> str | None:
        """"local", "object", "failed", or None for a tag this uploader never saw."""
        with self._mutex:
            return self._tiers.get(tag)

    def submit(self, tag: str, job: Callable[[], Any], *, kind: str = COMMIT, size: int = 0,
               on_drop: Callable[[], None] | None = None,
               on_end: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """Queues `job` for `tag` (`kind` PART: a rank's part of `size` bytes, counted against the
        bound, `on_drop` run if it is dropped); `on_end` runs once it ended, retries done, well or
        not. The tag's tier is "object" once its jobs all ended well."""
        entry = _Job(tag, kind, job, size, on_drop, on_end)
        with self._mutex:
            if self._closed:
                raise RuntimeError("the uploader is closed")
            if not self._in_flight.get(tag):  # a fresh attempt at this tag
                self._tiers[tag] = LOCAL
            self._in_flight[tag] = self._in_flight.get(tag, 0) + 1
            first = not self._jobs
            entry.future = self._pool.submit(self._run, entry)
            self._jobs.append(entry)
            dropped = self._drop_excess() if kind == PART else []
            self._measure()
            self._wake.notify_all()
        for job_dropped in dropped:
            self._dropped(job_dropped)
        if first:
            self._ensure_heartbeat()
            self._wait_at_exit()
        return entry.future

    def _parts(self) -> list[_Job]:
        return [j for j in self._jobs if j.kind == PART]

    def _drop_excess(self) -> list[_Job]:
        """Under the mutex: cancels the parts the bound drops and their tags' queued commits."""
        parts = self._parts()
        tags = set(parts_to_drop([QueuedPart(j.tag, j.started, j.size) for j in parts], self.max_queued_parts))
        dropped = []
        for job in list(self._jobs):
            if job.tag in tags and not job.started and job.future is not None and job.future.cancel():
                self._jobs.remove(job)
                self._finish(job.tag, ok=False)
                if job.kind == PART:
                    dropped.append(job)
        return dropped

    def _dropped(self, job: _Job) -> None:
        self.metrics.dropped.inc()
        log.warning("local checkpoint tier full (%d part uploads queued): dropped the queued upload of checkpoint "
                    "%s; it stays on local disk only, a newer checkpoint goes up instead", self.max_queued_parts,
                    job.tag, extra={"tag": job.tag})
        if job.on_drop is not None:
            try:
                job.on_drop()
            except Exception as exc:
                log.warning("cleaning up the dropped upload of %s: %s", job.tag, describe_failure(exc))

    def _measure(self) -> None:
        parts = self._parts()
        self.metrics.queued.set(len(parts))
        self.metrics.queued_bytes.set(sum(j.size for j in parts))

    def queued_parts(self) -> int:
        """How many of this rank's part uploads are held in staging now (waiting or uploading)."""
        with self._mutex:
            return len(self._parts())

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
            pending = [j for j in self._jobs if j.future is not None and not j.future.done()]
            self._no_retries = True
            self._wake.notify_all()
        if pending:
            log.warning("waiting for %d checkpoint upload(s) to %s before exiting", len(pending), self.remote.url)
            self.wait()

    def _run(self, job: _Job) -> Any:
        with self._mutex:
            job.started = True
        budget, backoff = RetryBudget(self.retry.seconds), Backoff(self.retry.base, self.retry.cap)
        ok = False
        try:
            while True:
                try:
                    self.remote.put_lease(self.writer_id, self._lease_tags())
                    result = job.run()
                    ok = True
                    return result
                except BaseException as exc:
                    self.metrics.failures.inc(kind=job.kind)
                    if not self._retry_after(job, exc, budget, backoff):
                        raise
        finally:
            if job.on_end is not None:
                try:
                    job.on_end()
                except Exception as exc:
                    log.warning("cleaning up after the upload of %s: %s", job.tag, exc)
            with self._mutex:
                if job in self._jobs:
                    self._jobs.remove(job)
                self._measure()
                idle = self._finish(job.tag, ok) and not self._jobs
            if idle:
                try:
                    self.remote.drop_lease(self.writer_id)
                except Exception as exc:  # an expired lease is as good as a dropped one
                    log.warning("cannot drop the upload lease in %s: %s", self.remote.url, describe_failure(exc))

    def _retry_after(self, job: _Job, exc: BaseException, budget: RetryBudget, backoff: Backoff) -> bool:
        """After a failed try: waits the backoff and returns True to try again, or logs the failure for
        good and returns False."""
        with self._mutex:
            stop = self._no_retries or self._closed
        if not stop and retriable(exc) and budget.allows(time.monotonic()):
            delay = backoff.next_delay()
            log.warning("upload of checkpoint %s to %s failed (%s): retrying in %.1fs", job.tag, self.remote.url,
                        describe_failure(exc), delay, extra={"tag": job.tag})
            with self._mutex:
                self._wake.wait_for(lambda: self._no_retries or self._closed, timeout=delay)
            return True
        log.error("upload of checkpoint %s to %s failed: %s", job.tag, self.remote.url, describe_failure(exc),
                  extra={"tag": job.tag})
        self._notify_failure(job.tag, exc)
        return False

    def _notify_failure(self, tag: str, exc: BaseException) -> None:
        for listener in list(self.on_failure):
            try:
                listener(tag, exc)
            except Exception:
                log.exception("an upload failure listener failed")

    def _finish(self, tag: str, ok: bool) -> bool:
        """Under the mutex: one job of `tag` ended; True when no job of any tag is in flight."""
        if not ok:
            self._tiers[tag] = FAILED
        self._in_flight[tag] -= 1
        if not self._in_flight[tag]:
            del self._in_flight[tag]
            if self._tiers.get(tag) != FAILED:
                self._tiers[tag] = OBJECT
        return not self._in_flight

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
            futures = [j.future for j in self._jobs if j.future is not None]
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
