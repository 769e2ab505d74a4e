"""One rank of tests/test_checkpoint_commit.py: the commit protocol over a real gloo group.

    python -m tests.workers.commit <store root> <out dir>     (RANK, WORLD_SIZE, MASTER_* set)

Three saves into one store directory shared by the ranks, through `CollectiveCommit` on the
formation's checkpoint group (as the adapters do): a good one; one whose write fails on rank 1;
one whose commit rank 0's store refuses (metadata that is not JSON). After each, every rank
records what it saw (the outcome, the attempt id its part carried, the writer locks still held in
the store) in `<out>/rank<r>.json`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from spotguard.hooks.agreement.collectives import GroupCollectives
from spotguard.hooks.agreement.control_group import control_groups
from spotguard.hooks.checkpoint import CheckpointFailed, CheckpointStore
from spotguard.hooks.checkpoint.commit import CollectiveCommit
from spotguard.hooks.checkpoint.locks import LOCK_DIR


class AgreeingStore(CheckpointStore):
    """The disk store, asking for an attempt id every rank agreed on (as the object store does)."""

    agrees_attempts = True


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = control_groups()
    assert groups is not None
    vote = GroupCollectives(groups.checkpoint)
    store = AgreeingStore(root, clean=rank == 0)
    vote.all_ok(True)  # rank 0's cleanup is done before anyone begins
    commit = CollectiveCommit(store, vote)
    seen: list[dict] = []

    def save(tag: str, *, fail_write_on: int | None = None, fail_commit: bool = False) -> None:
        attempts: list[str | None] = []

        def write(pending) -> None:
            attempts.append(pending.attempt)
            pending.write_bytes(f"part-{rank}.bin", bytes([rank]) * (100 + rank))
            if rank == fail_write_on:
                raise OSError("injected: the disk is full")

        def metadata() -> dict:  # what the manifest records; not JSON: the store refuses the commit
            return {"tag": tag, "unsaveable": object()} if fail_commit else {"tag": tag}

        try:
            info = commit.run(tag, write, metadata)
            outcome = "committed" if info is not None else "ok"
        except CheckpointFailed as exc:
            outcome = f"failed: {exc}"
        vote.all_ok(True)  # every rank is past the save before the locks are counted
        locks = sorted(p.name for p in (root / LOCK_DIR).glob("*.lock"))
        latest = store.latest()
        seen.append({"tag": tag, "outcome": outcome, "attempt": attempts[0] if attempts else None,
                     "live_locks": locks, "latest": latest.tag if latest else None})

    save("good")
    save("write-fails", fail_write_on=1)
    save("commit-fails", fail_commit=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    vote.all_ok(True)  # every rank wrote its results before the group goes
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
