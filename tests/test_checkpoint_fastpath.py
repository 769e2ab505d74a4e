"""The snapshot engine (buffers allocated once, background persist through the store's commit), the
adapters on it, the memory check, and the DCP plug-in in a real multi-process gloo run."""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from spotguard.config import ConfigError
from spotguard.hooks.adapters.base import CheckpointFailed, tag_for
from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
from spotguard.hooks.checkpoint import CheckpointStore, InsufficientHostMemory, check_host_memory
from spotguard.hooks.checkpoint.engine import SnapshotEngine
from spotguard.hooks.checkpoint.memory import available_host_memory
from spotguard.hooks.checkpoint.torchfile import save_torch_file
from spotguard.hooks.checkpoint.torchshards import load_torch_shards


def training_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    model.register_buffer("counts", torch.arange(5, dtype=torch.int64))
    model.half_precision = torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[0](torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def state_of(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "extra": {"tuple": (1, "a"), "shape": torch.Size([2, 3]), "inf": float("inf"), "nan_free": 0.5}}


def assert_same_tensors(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y)
    else:
        assert a == b


def persist_into(store, tag, meta):
    """A persist job: the copy as `state.pt` through the store's commit."""
    def write(copy):
        pending = store.begin(tag)
        save_torch_file(pending, "state.pt", copy)
        pending.finish_rank(0)
        return store.commit(tag, world_size=1, metadata=meta)
    return write


def test_snapshot_persist_load_round_trip(tmp_path):
    model, opt = training_state()
    store = CheckpointStore(tmp_path)
    engine = SnapshotEngine()
    try:
        expected = state_of(model, opt, 11)
        snap = engine.snapshot(expected, step=11)
        info = engine.persist(snap, persist_into(store, "step-11", {"step": 11, "notice_id": "n1"})).result(60)
    finally:
        engine.close()
    assert info.tag == "step-11" and info.step == 11 and info.metadata["notice_id"] == "n1"
    store.verify(info)
    loaded = torch.load(store.resolve().dir / "state.pt", weights_only=True)
    assert_same_tensors(expected, loaded)
    assert isinstance(loaded["extra"]["shape"], torch.Size)
    assert list(loaded["optim"]["state"].keys()) == list(expected["optim"]["state"].keys())  # int keys survive
    fresh_model, fresh_opt = training_state(seed=1)
    fresh_model.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optim"])
    assert torch.equal(fresh_model[0].weight, model[0].weight)


def test_buffers_are_allocated_once_and_hold_the_state_of_the_step(tmp_path):
    model, opt = training_state()
    store = CheckpointStore(tmp_path)
    engine = SnapshotEngine()
    try:
        first = engine.snapshot(state_of(model, opt, 4), step=4)
        pointers = [t.data_ptr() for t in first.state["model"].values()]
        weight_then = model[0].weight.detach().clone()
        snap = engine.snapshot(state_of(model, opt, 5), step=5)
        assert not first.valid and snap.valid
        assert [t.data_ptr() for t in snap.state["model"].values()] == pointers  # no new allocation
        assert engine.buffers.allocations == 1 and not engine.buffers.pinned
        assert engine.buffers.gpu_copy_seconds() is None  # timed by CUDA events only for a GPU state
        assert all(t.data_ptr() != b.data_ptr() for t, b in zip(model.state_dict().values(),
                                                                snap.state["model"].values()))
        with torch.no_grad():
            model[0].weight.add_(1.0)  # training goes on before the background write
        with pytest.raises(ValueError, match="overwritten"):
            engine.persist(first, persist_into(store, "stale", {"step": 4}))
        engine.persist(snap, persist_into(store, "step-5", {"step": 5})).result(60)
        parts = engine.estimate()
        assert parts.snapshot is not None and parts.persist is not None and parts.fresh > parts.persist
    finally:
        engine.close()
    loaded = torch.load(store.latest().dir / "state.pt", weights_only=True)
    assert torch.equal(loaded["model"]["0.weight"], weight_then)


def test_a_snapshot_waits_for_the_persist_that_reads_the_buffers(tmp_path):
    model, opt = training_state()
    engine = SnapshotEngine()
    release, seen = threading.Event(), []
    try:
        snap = engine.snapshot(state_of(model, opt, 1), step=1)

        def slow_write(copy):
            release.wait(30)
            seen.append(copy["model"]["0.weight"].clone())

        done = engine.persist(snap, slow_write)
        weight_then = model[0].weight.detach().clone()
        with torch.no_grad():
            model[0].weight.add_(1.0)
        later = threading.Thread(target=lambda: engine.snapshot(state_of(model, opt, 2), step=2))
        later.start()
        assert not done.done()
        release.set()
        later.join(60)
        done.result(60)
    finally:
        engine.close()
    assert torch.equal(seen[0], weight_then)  # the persist read step 1's copy, untouched by step 2's


def test_layout_change_reallocates_instead_of_writing_garbage(tmp_path):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    engine = SnapshotEngine()
    store = CheckpointStore(tmp_path)
    try:
        engine.snapshot({"model": model.state_dict(), "optim": opt.state_dict()}, step=0)  # no Adam state yet
        before = engine.buffers.nbytes
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        snap = engine.snapshot(state, step=1)
        assert engine.buffers.nbytes > before and engine.buffers.allocations == 2
        engine.persist(snap, persist_into(store, "t", {"step": 1})).result(60)
    finally:
        engine.close()
    assert_same_tensors(state, torch.load(store.latest().dir / "state.pt", weights_only=True))


def test_plain_adapter_saves_through_the_engine_and_loads_the_old_format(tmp_path):
    model, opt = training_state()
    old_state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    store = CheckpointStore(tmp_path / "ckpt")
    pending = store.begin(tag_for(3, "notice"))  # what PlainTorchAdapter wrote before the engine
    buffer = io.BytesIO()
    torch.save(old_state, buffer)
    pending.write_bytes("state.pt", buffer.getbuffer())
    pending.finish_rank(0)
    store.commit(tag_for(3, "notice"), world_size=1, metadata={"step": 3, "extra": {"pos": 7}})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt = training_state(seed=2)
    adapter = PlainTorchAdapter(fresh, fresh_opt, store=CheckpointStore(tmp_path / "ckpt"),
                                extra_state=lambda: {"pos": 9})
    try:
        assert adapter.resume() == 4 and adapter.extra == {"pos": 7}
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
        assert adapter.estimate_save_seconds() is None  # nothing measured yet
        adapter.prepare()
        info = adapter.save(4, reason="notice")
        parts = adapter.save_parts()
        assert parts.snapshot is not None and parts.persist is not None
        assert adapter.estimate_save_seconds() == pytest.approx(1.25 * parts.fresh)
        assert adapter.snapshot_step == 4 and adapter.snapshot_engine.buffers.allocations == 1
        assert "state.pt" not in info.files and "state-index.pt" in info.files  # the shards' layout now
        saved = load_torch_shards(info.dir, "state")
        assert saved["step"] == 4 and info.metadata["extra"] == {"pos": 9}
        assert_same_tensors(saved["model"], fresh.state_dict())
        adapter.save_async(5)
        adapter.wait(60)
        assert adapter.async_error is None and adapter.store.latest().step == 5
    finally:
        adapter.close()


def test_a_failed_copy_fails_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    model, opt = training_state()
    adapter = PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ckpt")
    try:
        adapter.save(1)
        adapter.scheduler = object()  # its state_dict() fails: the copy raises
        with pytest.raises(CheckpointFailed):
            adapter.save(2, reason="notice")
        assert adapter.store.latest().step == 1 and adapter.snapshot_step is None
        with pytest.raises(CheckpointFailed, match="no snapshot"):
            adapter.persist_snapshot()
    finally:
        adapter.close()


def test_removed_names_say_what_replaces_them(tmp_path):
    with pytest.raises(ImportError, match="PlainTorchAdapter"):
        from spotguard.hooks.checkpoint import FastCheckpointer  # noqa: F401
    with pytest.raises(RuntimeError, match="DeepSpeedAdapter"):
        CheckpointStore(tmp_path).deepspeed_engine()


def test_memory_check_fails_at_start_with_a_clear_message():
    too_much = available_host_memory() * 2
    with pytest.raises(InsufficientHostMemory) as err:
        check_host_memory(too_much)
    assert isinstance(err.value, ConfigError) and err.value.field == "snapshot_buffers"
    assert "GiB" in str(err.value) and "available" in str(err.value)
    check_host_memory(1 << 20)


# ---- framework plug-ins in real multi-process runs ----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, args: list[str], timeout: float = 150, extra_env=None) -> list[str]:
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       DS_ACCELERATOR="cpu", **(extra_env or {}))
            procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
        for rank, (proc, out) in enumerate(zip(procs, outputs)):
            assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


DCP_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from spotguard.hooks.checkpoint import CheckpointStore
    from spotguard.hooks.checkpoint.dcp import StoreDcpReader, StoreDcpWriter
    root, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters())
    store = CheckpointStore(root)
    if phase == "save":
        for step in (1, 2):
            model(torch.randn(8, 256)).sum().backward(); opt.step(); opt.zero_grad()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            pending = store.begin(f"step-{step}")
            writer = StoreDcpWriter(pending)
            if step == 1:
                dcp.save(state, storage_writer=writer)
            else:  # async: staged into the store's buffers, written in the background
                group = dist.new_group(backend="gloo")
                dcp.async_save(state, storage_writer=writer, process_group=group).result()
            dist.barrier()
            if rank == 0:
                store.commit(f"step-{step}", world_size=world, metadata={"step": step})
            pending.close()
            dist.barrier()
        if rank == 0:
            final_state = {k: v.clone() for k, v in model.module.state_dict().items()}
            torch.save(final_state, os.path.join(root, "..", "expected.pt"))
    else:
        info = store.resolve(verify=True)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=StoreDcpReader(info.dir))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        expected = torch.load(os.path.join(root, "..", "expected.pt"))
        for k, v in model.module.state_dict().items():
            assert torch.equal(v, expected[k]), k
        print("LOADED", info.tag, info.world_size, len(info.files))
    dist.destroy_process_group()
    # torch's teardown of its C++ threads at interpreter exit sometimes aborts ("terminate called
    # without an active exception", ci8) after all of the above passed: the rank leaves as
    # spotguard's own workers do (trainer/train.py), with its work done and its output flushed
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.slow
def test_dcp_save_and_async_save_commit_through_the_store_and_load_resharded(tmp_path):
    root = tmp_path / "store"
    run_ranks(DCP_WORKER, 2, [str(root), "save"])
    store = CheckpointStore(root)
    info = store.latest()
    assert info.tag == "step-2" and info.world_size == 2
    assert ".metadata" in info.files and any(n.startswith("__1_") for n in info.files)
    store.verify(info)
    out = run_ranks(DCP_WORKER, 1, [str(root), "load"])
    assert "LOADED step-2 2" in out[0]


def test_the_store_dcp_writer_puts_each_item_where_dcps_own_writer_does_and_plain_dcp_loads_it(tmp_path):
    """StoreDcpWriter writes DCP's files itself (items laid out without a copy or the zip CRC): the
    same files of the same sizes and every item at the same offset and length as DCP's own
    FileSystemWriter (single file per rank, 4 threads), the store's CRC-32s are of what is on disk,
    and DCP's plain FileSystemReader loads every value back (a strided view, an empty tensor and
    non-tensor items included)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from spotguard.hooks.checkpoint.dcp import StoreDcpWriter

    torch.manual_seed(0)
    state = {"w": torch.randn(600, 700), "view": torch.randn(800, 300)[::2], "ids": torch.arange(10),
             "empty": torch.empty(0), "half": torch.randn(3000).half(), "meta": {"step": 7, "name": "run"}}
    store = CheckpointStore(tmp_path / "store")
    pending = store.begin("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group: one process
        dcp.save(state, storage_writer=StoreDcpWriter(pending))
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "own", single_file_per_rank=True, thread_count=4))
        info = store.commit("dcp", world_size=1)
        store.verify(info)
        ours, own = FileSystemReader(info.dir), FileSystemReader(tmp_path / "own")
        assert ours.read_metadata().storage_data == own.read_metadata().storage_data
        for name in (p.name for p in (tmp_path / "own").glob("*.distcp")):
            assert (info.dir / name).stat().st_size == (tmp_path / "own" / name).stat().st_size, name
        loaded = {"w": torch.zeros(600, 700), "view": torch.zeros(400, 300), "ids": torch.zeros(10, dtype=torch.long),
                  "empty": torch.empty(0), "half": torch.zeros(3000).half(), "meta": {"step": 0, "name": ""}}
        dcp.load(loaded, storage_reader=ours)
    for key in ("w", "view", "ids", "empty", "half"):
        assert torch.equal(loaded[key], state[key]), key
    assert loaded["meta"] == {"step": 7, "name": "run"}


def test_the_stores_dcp_plugin_names_still_work_and_say_what_replaces_them(tmp_path):
    """`store.dcp_writer(pending)` / `store.dcp_reader(info)` (the plug-ins now live in dcp.py, for
    any PendingCheckpoint) warn with the replacement and give the same writer and reader."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from spotguard.hooks.checkpoint.dcp import StoreDcpReader, StoreDcpWriter

    store = CheckpointStore(tmp_path / "store")
    pending = store.begin("dcp")
    with pytest.warns(DeprecationWarning, match=r"dcp\.StoreDcpWriter\(pending\)"):
        writer = store.dcp_writer(pending)
    assert isinstance(writer, StoreDcpWriter) and writer.pending is pending
    state = {"w": torch.arange(12.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group: one process
        dcp.save(state, storage_writer=writer)
        info = store.commit("dcp", world_size=1)
        with pytest.warns(DeprecationWarning, match=r"StoreDcpReader\(info\.dir\)"):
            reader = store.dcp_reader(info)
        loaded = {"w": torch.zeros(12)}
        dcp.load(loaded, storage_reader=reader)
    assert isinstance(reader, StoreDcpReader) and torch.equal(loaded["w"], state["w"])


def test_a_torch_file_written_with_flush_behind_is_whole_and_its_checksum_is_of_what_is_on_disk(tmp_path):
    """`save_torch_file` overlaps the write-back with torch.save's write: the recorded size and
    CRC-32 are those of the file, and torch.load reads the exact tensors back."""
    import zlib

    store = CheckpointStore(tmp_path / "ckpt")
    state = {"w": torch.randn(1 << 18), "b": torch.arange(1000), "step": 7}
    pending = store.begin("step-7")
    size = save_torch_file(pending, "state.pt", state)
    on_disk = pending.path("state.pt").read_bytes()
    assert size == len(on_disk)
    assert pending._files["state.pt"] == {"size": len(on_disk), "crc32": f"{zlib.crc32(on_disk):08x}"}
    loaded = torch.load(pending.path("state.pt"), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 7


def test_a_torch_file_written_in_pieces_by_several_threads_loads_and_its_record_is_of_what_is_on_disk(tmp_path):
    """`save_torch_file_spread` (pieces cut small and 4 writers here, so that they interleave) writes what
    `torch.save` makes without the zip records' own CRC-32s: torch.load reads the exact state back, the
    recorded size and CRC-32 are the file's, and torch.save's switch is back on afterwards."""
    import zlib

    from torch.utils.serialization import config

    from spotguard.hooks.checkpoint import torchfile

    store = CheckpointStore(tmp_path / "ckpt")
    state = {"w": torch.randn(1 << 16), "parts": [torch.arange(5000), torch.ones(3)], "step": 7, "name": "x"}
    pending = store.begin("step-7")
    size = torchfile.save_torch_file_spread(pending, "state.pt", state, min_kept=4096, chunk=8192, writers=4)
    on_disk = pending.path("state.pt").read_bytes()
    assert pending.files["state.pt"] == {"size": size, "crc32": f"{zlib.crc32(on_disk):08x}"} and size == len(on_disk)
    loaded = torch.load(pending.path("state.pt"), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["parts"][0], state["parts"][0])
    assert loaded["step"] == 7 and loaded["name"] == "x" and config.save.compute_crc32


def test_a_write_back_error_behind_the_writer_is_raised_not_swallowed():
    """Linux reports a write-back error to one fsync only: the flusher's error must surface."""
    from spotguard.hooks.checkpoint import fsutil

    read_end, write_end = os.pipe()  # fdatasync on a pipe fails (EINVAL) on the first pass
    try:
        with pytest.raises(OSError), fsutil.flushing_behind(write_end):
            pass
    finally:
        os.close(read_end)
        os.close(write_end)
