"""Which instance a notice belongs to: the first of the fields a source's notice ids hash.

A cloud re-creates a VM under the same name (a managed instance group, a scale set, an Auto
Scaling group), and an event on the new VM can look exactly like one on the old: GCP's
`preempted` TRUE has the same ETag on every VM, AWS's `target-lifecycle-state` Terminated is the
same text. A Guard that resumed from the checkpoint answering the old VM's notice would take the
new one for already answered. So every source builds its ids as
`notice_id(source, node, instance, *event fields)`: a re-created VM gives new ids, the same VM
the same ids across polls and agent restarts.

Where `instance` comes from: the cloud's metadata service (GCP `instance/id`, AWS and Alibaba
`instance-id`, Azure `compute/vmId`), read by `InstanceIdentity`; the Node's `metadata.uid`
(k8s.node); the kernel's boot id (the GPU source, `read_boot_id`).

`InstanceIdentity` reads the id once for all the sources sharing one metadata client:
- a read starts beside a source's poll (`InstancePin.prefetch`, then the poll's own read), so a
  healthy metadata service costs a poll nothing; once read, the id is kept for the life of the
  process: an instance's id never changes under a running agent (a re-created VM boots a new
  agent; the dry-run restarts its agent with the instance);
- an unreadable id (no answer, an error status, a body that is not an id of that cloud) is
  counted in the stats of the source whose poll started the read, as `instance_id:<reason>`
  (`spotguard_source_errors_total`), logged as a warning (once until a read succeeds), and read
  again beside a later poll after a backoff (1 s doubling to 60 s, with jitter).

`InstancePin` (one per source) is the instance part that source puts in its ids
(`InstancePin.identify`):
- the read id once known; it replaces the fallback only at a poll when the source has no live
  notice, so a live notice never changes its id;
- while the id is unknown and an answer shows a notice, a read is made at once (backoff or not)
  and the poll waits for it at most `INSTANCE_GRACE` (0.5 s; a failing read answers within a
  round trip, only a hanging one costs that much): an agent restarted during a metadata outage
  gives its notices the ids they had before, not new ones, once the service answers again;
- if that read fails too, the notices go out at once under the fallback `FALLBACK` ("": the
  node name alone identifies the instance, as in the ids of earlier releases): a notice is never
  held longer for its instance, nor lost. The price: a re-created VM may reuse the fallback ids
  of its predecessor, and a notice published under the fallback gets a new id if the agent
  restarts and reads the id then: consumers may act on it twice, never miss it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from spotguard.agent.sources.base import SourceError
from spotguard.agent.sources.http import parse_text_leaf
from spotguard.backoff import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")

FALLBACK = ""  # the instance part of the ids while the instance id is unknown
INSTANCE_GRACE = 0.5  # seconds a poll showing a notice waits for a read of the unknown instance id
ERROR_PREFIX = "instance_id:"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def parse_instance_id(status: int, headers: Mapping[str, str], body: bytes, *, path: str,
                      pattern: re.Pattern[str]) -> str:
    """The instance id a metadata leaf answered (`path`, for messages); SourceError unless it is a
    200 whose stripped UTF-8 body matches `pattern` in full."""
    return parse_text_leaf(status, headers, body, path=path, pattern=pattern, what="an instance id")


def count_failure(errors: collections.Counter, reason: str) -> int:
    """Counts an unreadable instance id in a source's error counters, by reason; returns the count."""
    errors[ERROR_PREFIX + reason] += 1
    return errors[ERROR_PREFIX + reason]


class InstanceIdentity:
    """The id of the instance this agent runs on, read with `read()` (see the module docstring).

    `read` returns the id or raises SourceError; `what` names it in logs (e.g. "GCP instance/id").
    Use from one event loop.
    """

    def __init__(self, read: Callable[[], Awaitable[str]], what: str, backoff: Backoff | None = None):
        self._read = read
        self.what = what
        self.value: str | None = None
        self.failures = 0  # failed reads since the last success
        self._backoff = backoff or Backoff(base=1.0, cap=60.0)
        self._retry_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self, errors: collections.Counter, now: bool = False) -> None:
        """Starts a read in the background unless the id is known, a read is in flight, or (unless
        `now`) the retry time has not come; a failure is counted in `errors`."""
        if self.value is not None or (not now and time.monotonic() < self._retry_at):
            return
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._attempt(errors), name=f"read {self.what}")

    async def settle(self, grace: float) -> None:
        """Waits at most `grace` seconds for the read in flight, if any, to end."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=grace)

    async def close(self) -> None:
        """Cancels a read in flight (before its client closes). Safe to call more than once."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _attempt(self, errors: collections.Counter) -> None:
        try:
            value = await self._read()
        except SourceError as exc:
            reason, message = exc.reason, str(exc)
        except Exception as exc:  # a bug: counted and retried like any failure, never raised
            log.exception("reading %s failed unexpectedly", self.what)
            reason, message = "internal", repr(exc)
        else:
            if self.failures:
                log.info("%s is %s after %d failed reads: new notices use it", self.what, value, self.failures)
            self.value, self.failures = value, 0
            self._backoff.reset()
            return
        count_failure(errors, reason)
        self.failures += 1
        delay = self._backoff.next_delay()
        self._retry_at = time.monotonic() + delay
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "%s unreadable (%s): notice ids fall back to the node name; trying again in %.1fs",
                self.what, message, delay, extra={"reason": reason})


class InstancePin:
    """The instance part one source puts in its notice ids: `FALLBACK` until the identity is read,
    then its id, switched only at a poll when the source has no live notice.

    `identity` None: the source has no instance id to read (always the fallback).
    """

    def __init__(self, identity: InstanceIdentity | None, errors: collections.Counter):
        self.identity = identity
        self.errors = errors
        self.value = FALLBACK

    def prefetch(self) -> None:
        """Starts reading the instance id, if due, beside the poll's own read."""
        if self.identity is not None and self.value == FALLBACK:
            self.identity.start(self.errors)

    async def identify(self, parse: Callable[[str], T], has_live: bool,
                       shows: Callable[[T], Any] = bool) -> T:
        """`parse(instance)` of this poll's answer, with the instance part the module docstring
        gives (call after the poll's own read). `shows(result)`: whether it shows a notice;
        `has_live`: whether the source has live notices."""
        identity = self.identity
        if identity is None or self.value != FALLBACK or has_live:
            return parse(self.value)
        if identity.value is None:
            result = parse(FALLBACK)
            if not shows(result):
                return result
            identity.start(self.errors, now=True)
            await identity.settle(INSTANCE_GRACE)
            if identity.value is None:
                return result
        self.value = identity.value
        return parse(self.value)

    async def close(self) -> None:
        if self.identity is not None:
            await self.identity.close()


def read_boot_id(path: str, errors: collections.Counter) -> str:
    """This machine's boot id (blocking: call it in a thread), or FALLBACK after counting why
    not (`instance_id:<reason>`) and logging a warning."""
    try:
        with open(path, "rb") as f:
            value = f.read(128).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason, message = "unreadable", f"{exc.__class__.__name__}: {exc}"
    else:
        if UUID.fullmatch(value):
            return value.lower()
        reason, message = "malformed", f"not a boot id: {value!r:.60}"
    count_failure(errors, reason)
    log.warning("boot id %s unreadable (%s): GPU notice ids fall back to the node name", path, message,
                extra={"reason": reason})
    return FALLBACK
