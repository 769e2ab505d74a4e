"""The commit protocol across ranks: a checkpoint becomes visible only once every rank's part is
durable, and every rank learns whether it did.

A save, on every rank of a group in the same order (`CollectiveCommit.run`):
1. `attempt`: for a store that keeps attempts apart (`Store.agrees_attempts`), one fresh id, the
   same on every rank (one collective `max`); else None;
2. `write_part`, this rank alone, no collective: `store.begin(tag, attempt)`, `write(pending)`
   (this rank's files), `pending.finish_rank(rank)`: the part manifest, fsynced, is this rank's
   durable record of its part;
3. `vote.all_ok`: every rank learns whether every part is written;
4. on rank 0, `commit_parts`, no collective: the store checks every rank's part manifest and
   commits (manifest, rename, `latest`), then `after_commit(info)` runs there;
5. `vote.rank0_says`: every rank learns the commit's outcome, rank 0's word (on a group, an
   `all_ok` only rank 0 can say no in; through a store channel rank 0's key alone, so a rank that
   dies after step 3, while a change's survivors go on, cannot make the others report a visible
   checkpoint as failed).
A failure anywhere raises `CheckpointFailed` on every rank (so no rank waits for a commit that will
not come) and leaves the previous checkpoint the newest; a rank's part of a failed save is closed
(the next open's cleanup removes it). SystemExit and KeyboardInterrupt propagate at once.

Steps 2 and 4 are plain functions of the store: a committer that learns the parts from the store's
part manifests rather than from a vote (one that must not enter a collective, a deadline's) runs
`write_part` on every rank with an attempt id the ranks derive alike, and `commit_parts` on the
committing rank once the parts are there. `CollectiveCommit` is the protocol over a `Vote`:
`hooks.agreement.collectives.Collectives` on the formation's checkpoint group (or a process alone).
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .types import CheckpointFailed, CheckpointInfo, PendingCheckpoint, Store

log = logging.getLogger("spotguard.hooks.checkpoint.commit")

Write = Callable[[PendingCheckpoint], None]
AfterCommit = Callable[[CheckpointInfo], None]

ATTEMPT_BITS = 52  # an id every float64 `max` carries exactly


class Vote(Protocol):
    """The collectives the protocol needs; `Collectives` (hooks/agreement/collectives.py) is one."""

    rank: int
    world_size: int

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank."""
        ...

    def max(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum over the ranks, on every rank."""
        ...

    def rank0_says(self, ok: bool) -> bool:
        """Rank 0's `ok` on every rank."""
        ...


def reraise_interrupts(exc: BaseException) -> None:
    """Re-raises what must not be swallowed (SystemExit, KeyboardInterrupt)."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        raise exc


def write_part(store: Store, tag: str, rank: int, write: Write, attempt: str | None = None) -> PendingCheckpoint:
    """Step 2: this rank's files of checkpoint `tag` and its part manifest; returns the pending
    checkpoint (its writer lock held until the commit, or `close()`). The pending checkpoint is
    closed when `write` or `finish_rank` raises."""
    pending = store.begin(tag, attempt=attempt)
    try:
        write(pending)
        pending.finish_rank(rank)
    except BaseException:
        pending.close()  # this rank stopped writing: the next open's cleanup may remove the part
        raise
    return pending


def commit_parts(store: Store, tag: str, world_size: int, metadata: Mapping[str, Any],
                 after_commit: AfterCommit | None = None) -> CheckpointInfo:
    """Step 4, on the committing rank: the checkpoint from the parts of ranks 0..world_size-1
    (CommitError when one is missing or wrong: nothing visible), then `after_commit(info)`."""
    info = store.commit(tag, world_size=world_size, metadata=metadata)
    if after_commit is not None:
        after_commit(info)
    return info


class CollectiveCommit:
    """The protocol of the module docstring over `vote`, for saves into `store`."""

    def __init__(self, store: Store, vote: Vote):
        self.store = store
        self.vote = vote

    def attempt(self) -> str | None:
        """Step 1 (collective when the store agrees attempts): the id of this save on every rank."""
        if not self.store.agrees_attempts:
            return None
        agreed = self.vote.max([float(secrets.randbits(ATTEMPT_BITS))])[0]
        return f"{int(agreed):016x}"

    def run(self, tag: str, write: Write, metadata: Callable[[], Mapping[str, Any]], *,
            after_commit: AfterCommit | None = None) -> CheckpointInfo | None:
        """Collective: steps 1-5. `metadata()` (on rank 0, at the commit) is what the manifest
        records. Returns the checkpoint on rank 0, None on the others; CheckpointFailed on every
        rank when any rank failed. This rank's pending checkpoint is closed when it returns."""
        rank = self.vote.rank
        attempt = self.attempt()
        pending: PendingCheckpoint | None = None
        try:
            pending = write_part(self.store, tag, rank, write, attempt)
        except BaseException as exc:  # every rank must learn about the failure
            reraise_interrupts(exc)  # (DCP's CheckpointException derives from BaseException)
            log.exception("rank %d could not write its part of checkpoint %s", rank, tag)
        try:
            if not self.vote.all_ok(pending is not None):
                raise CheckpointFailed(f"checkpoint {tag}: a rank failed to write its part")
            info, committed = None, True
            if rank == 0:
                try:
                    info = commit_parts(self.store, tag, self.vote.world_size, metadata(), after_commit)
                except BaseException as exc:
                    reraise_interrupts(exc)
                    log.exception("commit of checkpoint %s failed", tag)
                    committed = False
            if not self.vote.rank0_says(committed):
                raise CheckpointFailed(f"checkpoint {tag}: commit failed")
            return info
        finally:
            if pending is not None:  # committed, or given up: the writer lock goes either way
                pending.close()
