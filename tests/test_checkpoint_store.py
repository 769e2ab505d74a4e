"""The checkpoint store: atomic commit, invisibility of partial checkpoints, verification with
fallback, retention, and cleanup of dead writers' leftovers (with a live writer left alone)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.checkpoint import CheckpointCorrupt, CheckpointStore, CommitError, Store, TieredStore, open_store
from spotguard.hooks.checkpoint.store import MANIFEST


def save(store: CheckpointStore, tag: str, step: int, reason: str = "periodic", ranks: int = 1) -> None:
    pendings = [store.begin(tag) for _ in range(ranks)]
    for rank, pending in enumerate(pendings):
        pending.write_bytes(f"shard-{rank}.bin", bytes([step % 256]) * (1000 + rank))
        pending.write_bytes(f"sub/dir/extra-{rank}", memoryview(bytearray(b"x" * 10)))
        pending.finish_rank(rank)
    store.commit(tag, world_size=ranks, metadata={"step": step, "reason": reason})
    for pending in pendings:
        pending.close()


def test_commit_makes_a_complete_checkpoint_with_manifest_and_pointer(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    save(store, "step-10", 10, ranks=2)
    info = store.latest()
    assert info.tag == "step-10" and info.step == 10 and info.world_size == 2
    assert info.dir == tmp_path / "ck" / "step-10"
    assert set(info.files) == {"shard-0.bin", "shard-1.bin", "sub/dir/extra-0", "sub/dir/extra-1"}
    assert info.files["shard-1.bin"]["size"] == 1001 and info.files["shard-1.bin"]["rank"] == 1
    manifest = json.loads((info.dir / MANIFEST).read_text())
    assert manifest["metadata"] == {"step": 10, "reason": "periodic"} and manifest["sequence"] == 1
    assert (tmp_path / "ck" / "latest").read_text() == "step-10"
    assert not list((tmp_path / "ck").glob(".pending-*"))
    assert store.resolve().tag == "step-10"


def test_open_store_on_a_directory_is_the_disk_store_one_tier_only(tmp_path):
    store = open_store(tmp_path / "ck", keep_last=2)
    assert type(store) is CheckpointStore and store.keep_last == 2 and store.root == tmp_path / "ck"
    assert isinstance(store, Store) and not isinstance(store, TieredStore) and not store.agrees_attempts


def test_uncommitted_and_refused_commits_stay_invisible(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    save(store, "a", 1)
    pending = store.begin("b")
    pending.write_bytes("shard-0.bin", b"data")
    assert store.latest().tag == "a"  # no manifest: invisible
    pending.finish_rank(0)
    with pytest.raises(CommitError, match="rank 1 has not finished"):
        store.commit("b", world_size=2)
    assert store.latest().tag == "a"
    # a file that changed size after its rank finished is refused too
    (pending.dir / "shard-0.bin").write_bytes(b"dat")
    with pytest.raises(CommitError, match="3 bytes"):
        store.commit("b", world_size=1)
    assert [c.tag for c in store.list()] == ["a"]


def test_resolve_falls_back_to_the_previous_complete_checkpoint_and_says_so(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, "s1", 1)
    save(store, "s2", 2)
    damaged = store.latest()
    assert damaged.tag == "s2"
    path = damaged.dir / "shard-0.bin"
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        store.verify(damaged)
    assert store.latest().tag == "s2"  # latest() does no checksum pass
    with caplog.at_level(logging.WARNING):
        assert store.resolve(verify=True).tag == "s1"
    assert "s2" in caplog.text and "falling back" in caplog.text
    (store.read("s1").dir / "sub/dir/extra-0").unlink()
    with pytest.raises(CheckpointCorrupt, match="no checkpoint verifies"):
        store.resolve(verify=True)


def test_retention_keeps_the_last_n_and_every_notice_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in range(1, 8):
        save(store, f"step-{step}", step, reason="notice" if step in (2, 3) else "periodic")
    assert [c.tag for c in store.list()] == ["step-2", "step-3", "step-6", "step-7"]
    assert store.removals_done(timeout=60)  # a commit's retention deletes behind it, on the store's thread
    assert not list(tmp_path.glob(".trash-*"))


def test_recommit_of_a_tag_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    save(store, "same", 1)
    save(store, "same", 2)
    assert [(c.tag, c.step) for c in store.list()] == [("same", 2)]
    store.verify(store.latest())


WRITER = textwrap.dedent("""
    import sys, time
    from spotguard.hooks.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1])
    pending = store.begin(sys.argv[2])
    pending.write_bytes("half-written", b"x" * 100)
    print("writing", flush=True)
    time.sleep(120)
""")


def start_writer(root, tag):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), tag], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_open_cleans_dead_writers_leftovers_but_not_a_live_writer(tmp_path):
    dead = start_writer(tmp_path, "dead")
    live = start_writer(tmp_path, "live")
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        (tmp_path / ".trash-old-1234").mkdir()
        (tmp_path / ".latest.tmp-abc").write_text("x")
        store = CheckpointStore(tmp_path)
        names = {p.name for p in tmp_path.iterdir()}
        assert ".pending-dead" not in names and ".trash-old-1234" not in names and ".latest.tmp-abc" not in names
        assert ".pending-live" in names, "a live writer's pending dir must survive another process's open"
        assert (tmp_path / ".pending-live" / "half-written").exists()
        live.kill()
        live.wait(10)
        store.cleanup()
        assert not (tmp_path / ".pending-live").exists()
        assert not list((tmp_path / ".locks").iterdir())
    finally:
        for proc in (dead, live):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_bad_configuration_and_names_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        CheckpointStore(tmp_path, keep_last=0)
    assert err.value.field == "keep_last"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as err:
        CheckpointStore(tmp_path / "file" / "sub")
    assert err.value.field == "checkpoint_root"
    store = CheckpointStore(tmp_path / "ok")
    for tag in ("../x", ".hidden", "a/b", "", "latest"):
        with pytest.raises(ValueError):
            store.begin(tag)
    pending = store.begin("t")
    for name in ("../escape", "/abs", MANIFEST, ".spotguard-part-0.json"):
        with pytest.raises(ValueError):
            pending.write_bytes(name, b"x")
    with pytest.raises(ValueError, match="JSON"):
        pending.finish_rank(0)
        store.commit("t", world_size=1, metadata={"bad": object()})
    assert store.latest() is None


def build_copy(store: CheckpointStore, info, content: bytes = b"converted"):
    return store.derived("universal").build(
        info, lambda out: (out / "ds").mkdir() or (out / "ds" / "x").write_bytes(content))


def test_derived_copy_is_reused_only_for_the_commit_it_was_made_from(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    copies = store.derived("universal")
    save(store, "t", 1)
    first = store.read("t")
    assert copies.lookup(first) is None
    path = build_copy(store, first)
    assert path == tmp_path / "_universal" / "t" and (path / "ds" / "x").read_bytes() == b"converted"
    assert copies.lookup(store.read("t")) == path  # read again: the same commit, the same fingerprint
    save(store, "t", 2)  # re-committed: same tag, another commit
    second = store.read("t")
    assert second.fingerprint != first.fingerprint
    assert copies.lookup(second) is None and copies.lookup(first) is None
    assert not path.exists(), "retention keeps no copy of a commit that is gone"
    build_copy(store, second, b"again")
    assert copies.lookup(second) == path and (path / "ds" / "x").read_bytes() == b"again"


def test_retention_and_open_remove_derived_copies_of_gone_or_old_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, "s1", 1, reason="notice")  # kept forever by retention, but its copy only while it is recent
    save(store, "s2", 2)
    build_copy(store, store.read("s1"))
    build_copy(store, store.read("s2"))
    (tmp_path / "_universal" / "stray").mkdir()  # e.g. a copy made by an older version, no source record
    CheckpointStore(tmp_path, keep_last=2)  # open: prunes what no kept commit made
    assert sorted(p.name for p in (tmp_path / "_universal").iterdir() if not p.name.startswith(".")) == ["s1", "s2"]
    save(store, "s3", 3)
    assert [c.tag for c in store.list()] == ["s1", "s2", "s3"]
    assert sorted(p.name for p in (tmp_path / "_universal").iterdir() if not p.name.startswith(".")) == ["s2"]
    save(store, "s4", 4)
    assert not [p for p in (tmp_path / "_universal").iterdir() if not p.name.startswith(".")]


BUILDER = textwrap.dedent("""
    import sys, time
    from spotguard.hooks.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1])

    def make(out):
        (out / "ds").mkdir()
        (out / "ds" / "x").write_bytes(b"half")
        print("building", flush=True)
        time.sleep(120)

    store.derived("universal").build(store.read(sys.argv[2]), make)
""")


def test_a_failed_or_killed_derived_build_stays_invisible(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    save(store, "t", 1)
    info = store.read("t")

    def failing(out):
        (out / "ds").mkdir()
        raise RuntimeError("converter failed")

    with pytest.raises(RuntimeError, match="converter failed"):
        store.derived("universal").build(info, failing)
    assert not [
        p for p in (tmp_path / "_universal").iterdir() if not p.name.startswith(".") or p.name.startswith(".build-")]
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), "t"], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "building"
        CheckpointStore(tmp_path)  # open while it builds: its hidden dir is left alone
        assert len(list((tmp_path / "_universal").glob(".build-t-*"))) == 1
        assert store.derived("universal").lookup(info) is None
        builder.kill()
        builder.wait(10)
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait(10)
    assert store.derived("universal").lookup(info) is None
    CheckpointStore(tmp_path)
    assert not list((tmp_path / "_universal").glob(".build-*"))
    assert store.derived("universal").lookup(info) is None
