"""The commit protocol across ranks (hooks/checkpoint/commit.py): a checkpoint is visible only once
every rank's part is durable, every rank learns the outcome, a failure anywhere raises
CheckpointFailed on every rank with the previous checkpoint still the newest, and no rank keeps a
writer lock after a save. One process (`Collectives`, the identity), and 2 gloo ranks."""
from __future__ import annotations

import json

import pytest

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.checkpoint import CheckpointFailed, CheckpointStore
from spotguard.hooks.checkpoint.commit import CollectiveCommit, write_part
from spotguard.hooks.checkpoint.locks import LOCK_DIR
from tests.workers.launch import run_ranks


class AgreeingStore(CheckpointStore):
    """The disk store, asking for an attempt id every rank agreed on (as the object store does)."""

    agrees_attempts = True


def live_locks(store: CheckpointStore) -> list[str]:
    return sorted(p.name for p in (store.root / LOCK_DIR).glob("*.lock"))


def writes(data: bytes, seen: list | None = None):
    def write(pending) -> None:
        if seen is not None:
            seen.append(pending.attempt)
        pending.write_bytes("state.bin", data)
    return write


def test_a_save_alone_commits_what_it_wrote_and_keeps_no_writer_lock(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    info = CollectiveCommit(store, Collectives()).run("s1", writes(b"abc"), lambda: {"step": 1})
    assert info is not None and info.tag == "s1" and info.metadata == {"step": 1} and info.world_size == 1
    assert store.latest() == info and (info.dir / "state.bin").read_bytes() == b"abc"
    store.verify(info)
    assert live_locks(store) == []


def test_a_failed_write_raises_checkpoint_failed_and_the_previous_checkpoint_stays_the_newest(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    commit = CollectiveCommit(store, Collectives())
    commit.run("s1", writes(b"one"), lambda: {"step": 1})

    def broken(pending) -> None:
        pending.write_bytes("state.bin", b"half")
        raise OSError("injected: no space left")

    with pytest.raises(CheckpointFailed, match="a rank failed to write its part"):
        commit.run("s2", broken, lambda: {"step": 2})
    assert [c.tag for c in store.list()] == ["s1"] and live_locks(store) == []
    assert (store.root / ".pending-s2").is_dir()  # given up: the next open's cleanup removes it
    CheckpointStore(store.root)
    assert not (store.root / ".pending-s2").exists() and store.latest().tag == "s1"


def test_a_refused_commit_raises_checkpoint_failed_and_an_after_commit_failure_too(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    commit = CollectiveCommit(store, Collectives())
    with pytest.raises(CheckpointFailed, match="commit failed"):
        commit.run("s1", writes(b"x"), lambda: {"step": object()})  # not JSON: the store refuses it
    assert store.list() == [] and live_locks(store) == []

    def after_commit(_info) -> None:
        raise RuntimeError("injected: the framework's name for it could not be made")

    with pytest.raises(CheckpointFailed, match="commit failed"):
        commit.run("s2", writes(b"y"), lambda: {"step": 2}, after_commit=after_commit)


def test_an_interrupt_while_writing_propagates_as_itself(tmp_path):
    store = CheckpointStore(tmp_path / "ck")

    def interrupted(pending) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        CollectiveCommit(store, Collectives()).run("s1", interrupted, dict)
    assert store.list() == [] and live_locks(store) == []


def test_attempt_ids_only_for_a_store_that_agrees_attempts_and_fresh_for_each_save(tmp_path):
    seen: list = []
    CollectiveCommit(CheckpointStore(tmp_path / "plain"), Collectives()).run("s", writes(b"a", seen), dict)
    agreeing = CollectiveCommit(AgreeingStore(tmp_path / "agreeing"), Collectives())
    agreeing.run("s", writes(b"b", seen), dict)
    agreeing.run("s", writes(b"c", seen), dict)  # a re-commit of the tag: another attempt
    assert seen[0] is None
    assert all(isinstance(a, str) and len(a) == 16 and int(a, 16) >= 0 for a in seen[1:]) and seen[1] != seen[2]


def test_write_part_closes_its_pending_checkpoint_when_the_write_fails(tmp_path):
    store = CheckpointStore(tmp_path / "ck")

    def broken(pending) -> None:
        raise ValueError("injected")

    with pytest.raises(ValueError):
        write_part(store, "s1", 0, broken)
    assert live_locks(store) == []
    pending = write_part(store, "s2", 0, writes(b"ok"))  # a good part keeps its lock until the commit
    assert len(live_locks(store)) == 1 and (pending.dir / ".spotguard-part-0.json").is_file()
    pending.close()


def test_two_ranks_agree_on_every_outcome_and_keep_no_writer_lock(tmp_path):
    """2 gloo ranks, one shared store dir (tests/workers/commit.py): a good save commits on rank 0
    with one attempt id on both ranks; a write failing on rank 1 and a commit refused on rank 0
    raise CheckpointFailed on both, and `good` stays the newest; after every save no writer lock
    is held (rank 1's part of a committed save included)."""
    out = tmp_path / "out"
    out.mkdir()
    codes, tail = run_ranks(2, [str(tmp_path / "ck"), str(out)], out / "logs", timeout=120,
                            module="tests.workers.commit")
    assert codes == [0, 0], tail
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    good, write_fails, commit_fails = zip(*ranks)
    assert [s["outcome"] for s in good] == ["committed", "ok"]
    assert good[0]["attempt"] == good[1]["attempt"] is not None
    assert all(s["outcome"].startswith("failed") and "failed to write its part" in s["outcome"] for s in write_fails)
    assert all(s["outcome"].startswith("failed") and "commit failed" in s["outcome"] for s in commit_fails)
    assert write_fails[0]["attempt"] == write_fails[1]["attempt"] != good[0]["attempt"]
    assert all(s["latest"] == "good" and s["live_locks"] == [] for s in (*good, *write_fails, *commit_fails)), ranks
