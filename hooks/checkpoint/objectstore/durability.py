"""What this process knows of the *job's* checkpoints in the object store, never one rank's part.

A checkpoint is durable in the object store once the job's commit of it is there: its manifest,
written by the committing rank (rank 0) after every rank's part of this attempt. A rank's own part
in the bucket is not enough: without the commit nothing of it is visible or loadable, and a rank
other than the committer that took its uploaded part for the checkpoint would claim a tier the job
may never reach (the committer's node lost before its commit). So:
- the committing rank learns it from its own commit (`committed`);
- any other rank learns it by reading the tag's manifest in the bucket and finding this save's
  attempt there (`look`; `wait_committed` polls it until a timeout);
- `object_step`: the newest step this process knows committed in the object store (its commits,
  the manifests it read, the checkpoint it resumed from); never read from the bucket on the way
  out, where a hung request would hold a departing rank past its deadline.
"""
from __future__ import annotations

import logging
import threading
import time
from spotguard.backoff import Backoff

from .remote import RemoteCheckpoints

log = logging.getLogger(__name__)


class Durability:
    """See the module docstring."""

    def __init__(self, remote: RemoteCheckpoints):
        self.remote = remote
        self.object_step: int | None = None
        self._committed: set[str] = set()
        self._attempts: dict[str, str | None] = {}  # tag -> the attempt of this rank's part of it
        self._mutex = threading.Lock()

    def part_staged(self, tag: str, attempt: str | None) -> None:
        """This rank staged its part of `tag` (attempt `attempt`): a fresh save of the tag, not yet committed."""
        with self._mutex:
            self._attempts[tag] = attempt
            self._committed.discard(tag)

    def committed(self, tag: str, step: object) -> None:
        """The job's commit of `tag` (the checkpoint of `step`) is in the object store."""
        with self._mutex:
            self._committed.add(tag)
            self._attempts.pop(tag, None)
            self.saw_step(step)

    def saw_step(self, step: object) -> None:
        """A commit of `step` is known in the object store (under the mutex or not: one assignment)."""
        if isinstance(step, int) and not isinstance(step, bool):
            self.object_step = step if self.object_step is None else max(step, self.object_step)

    def is_committed(self, tag: str) -> bool:
        with self._mutex:
            return tag in self._committed

    def look(self, tag: str) -> bool:
        """Reads `tag`'s manifest in the bucket: True (and remembered) when it commits this rank's
        attempt at the tag (any commit when this rank wrote no part of it)."""
        if self.is_committed(tag):
            return True
        remote = self.remote.read(tag)
        if remote is None:
            return False
        with self._mutex:
            expected = self._attempts.get(tag)
        if expected is not None and remote.manifest.get("attempt") != expected:
            return False
        self.committed(tag, (remote.manifest.get("metadata") or {}).get("step"))
        return True

    def wait_committed(self, tag: str, timeout: float) -> bool:
        """Polls `look(tag)` until it is True or `timeout` seconds passed. The polls run on a daemon
        thread: a request that hangs (a server that stopped answering) never holds the caller past
        `timeout`; a failing read counts as not committed yet."""
        deadline = time.monotonic() + max(timeout, 0.0)
        found = threading.Event()

        def poll() -> None:
            backoff = Backoff(base=0.05, cap=0.5, floor=0.02)
            while time.monotonic() < deadline:
                try:
                    if self.look(tag):
                        found.set()
                        return
                except Exception as exc:  # the bucket may be unreachable now: keep asking until the timeout
                    log.debug("cannot read the manifest of %s: %s", tag, exc)
                time.sleep(min(backoff.next_delay(), max(deadline - time.monotonic(), 0.0)))

        threading.Thread(target=poll, name="spotguard-commit-watch", daemon=True).start()
        return found.wait(max(timeout, 0.0)) or self.is_committed(tag)
