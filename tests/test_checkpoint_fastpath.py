"""The fast path (snapshot into preallocated buffers, background persist), the memory check,
and the DCP / DeepSpeed plug-ins in real multi-process gloo runs."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from spotguard.config import ConfigError
from spotguard.hooks.checkpoint import (CheckpointStore, FastCheckpointer, InsufficientHostMemory, check_host_memory,
                                        load_rank)
from spotguard.hooks.checkpoint.memory import available_host_memory


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


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_snapshot_persist_load_round_trip(tmp_path, mode):
    model, opt = training_state()
    store = CheckpointStore(tmp_path)
    with FastCheckpointer(files=3, mode=mode) as fast:
        fast.prepare(state_of(model, opt, 0))
        expected = state_of(model, opt, 11)
        _snap, done = fast.save(store, "step-11", expected, step=11, metadata={"reason": "notice", "notice_id": "n1"})
        info = done.result(60)
    assert info.tag == "step-11" and info.step == 11 and info.metadata["notice_id"] == "n1"
    store.verify(info)
    loaded, meta = load_rank(store.resolve(), verify=True)
    assert meta["step"] == 11
    assert_same_tensors(expected, loaded)
    assert isinstance(loaded["extra"]["shape"], torch.Size)
    assert list(loaded["optim"]["state"].keys()) == list(expected["optim"]["state"].keys())  # int keys survive
    fresh_model, fresh_opt = training_state(seed=1)
    fresh_model.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optim"])
    assert torch.equal(fresh_model[0].weight, model[0].weight)


def test_snapshot_is_a_copy_taken_at_the_step_boundary(tmp_path):
    model, opt = training_state()
    store = CheckpointStore(tmp_path)
    with FastCheckpointer(files=2) as fast:
        fast.prepare(state_of(model, opt, 0))
        weight_then = model[0].weight.detach().clone()
        snap = fast.snapshot(state_of(model, opt, 5), step=5)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # training goes on before the background write
        pending = store.begin("step-5")
        assert fast.persist(snap, pending, rank=0).result(60) == fast.nbytes
        store.commit("step-5", world_size=1, metadata={"step": 5})
    loaded, _ = load_rank(store.latest())
    assert torch.equal(loaded["model"]["0.weight"], weight_then)
    assert snap.stall_seconds < 60


def test_periodic_snapshots_and_the_deadline_fallback_copy(tmp_path):
    model, opt = training_state()
    with FastCheckpointer(every=3, slots=2) as fast:
        fast.prepare(state_of(model, opt, 0))
        taken = [s for step in range(1, 8) if (s := fast.maybe_snapshot(state_of(model, opt, step), step))]
        assert [s.step for s in taken] == [3, 6]
        assert fast.latest_snapshot.step == 6
        assert taken[0].valid  # two slots: step 3 still intact
        fast.snapshot(state_of(model, opt, 9), step=9)
        assert not taken[0].valid and fast.latest_snapshot.step == 9
        store = CheckpointStore(tmp_path)
        pending = store.begin("fallback")
        with pytest.raises(ValueError, match="overwritten"):
            fast.persist(taken[0], pending)
        fast.persist(fast.latest_snapshot, pending).result(60)
        store.commit("fallback", world_size=1, metadata={"step": 9, "reason": "notice"})
    assert load_rank(store.latest())[1]["step"] == 9


def test_layout_change_reallocates_instead_of_writing_garbage(tmp_path):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    with FastCheckpointer() as fast:
        fast.prepare({"model": model.state_dict(), "optim": opt.state_dict()})  # no Adam state yet
        before = fast.nbytes
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        snap = fast.snapshot(state, step=1)
        assert fast.nbytes > before
        store = CheckpointStore(tmp_path)
        fast.persist(snap, store.begin("t")).result(60)
        store.commit("t", world_size=1)
    assert_same_tensors(state, load_rank(store.latest())[0])


def test_memory_check_fails_at_start_with_a_clear_message():
    too_much = available_host_memory() * 2
    with pytest.raises(InsufficientHostMemory) as err:
        check_host_memory(too_much)
    assert isinstance(err.value, ConfigError) and err.value.field == "snapshot_buffers"
    assert "GiB" in str(err.value) and "available" in str(err.value)
    check_host_memory(1 << 20)
    with pytest.raises(ConfigError) as err:
        FastCheckpointer(mode="fork")
    assert err.value.field == "mode"


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
            writer = store.dcp_writer(pending)
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
        dcp.load(state, storage_reader=store.dcp_reader(info))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        expected = torch.load(os.path.join(root, "..", "expected.pt"))
        for k, v in model.module.state_dict().items():
            assert torch.equal(v, expected[k]), k
        print("LOADED", info.tag, info.world_size, len(info.files))
    dist.destroy_process_group()
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


DS_WORKER = textwrap.dedent("""
    import os, sys, json, torch, deepspeed, torch.distributed as dist
    from spotguard.hooks.checkpoint import CheckpointStore
    root, phase = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    store = CheckpointStore(root)
    engine.checkpoint_engine = store.deepspeed_engine(files=2)
    rank = dist.get_rank()
    def train(n):
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(n):
            loss = engine(torch.randn(2, 64, generator=g)).pow(2).mean()
            engine.backward(loss); engine.step()
    def fingerprint():
        sd = engine.optimizer.state_dict()
        flat = sd["single_partition_of_fp32_groups"][0]
        return [float(p.double().sum()) for p in engine.module.parameters()] + [float(flat.double().sum())]
    if phase == "save":
        train(3)
        engine.checkpoint_engine.prepare({"step": engine.global_steps, "reason": "notice", "notice_id": "n-1"})
        engine.save_checkpoint(root, tag="step-3", client_state={"epoch": 7}, save_latest=False)
        with open(os.path.join(root, "..", f"fp{rank}.json"), "w") as f:
            json.dump(fingerprint(), f)
    else:
        info = store.resolve(verify=True)
        _, client = engine.load_checkpoint(str(info.dir.parent), tag=info.tag)
        with open(os.path.join(root, "..", f"fp{rank}.json")) as f:
            assert fingerprint() == json.load(f), "resumed state differs"
        assert client["epoch"] == 7 and engine.global_steps == 3
        print("LOADED", info.tag, engine.global_steps)
""")


@pytest.mark.slow
def test_deepspeed_save_checkpoint_takes_the_fast_path_and_resumes_exactly(tmp_path):
    root = tmp_path / "store"
    run_ranks(DS_WORKER, 2, [str(root), "save"], timeout=240)
    store = CheckpointStore(root)
    info = store.latest()
    assert info.tag == "step-3" and info.world_size == 2 and info.metadata["reason"] == "notice"
    model_index = info.dir / "mp_rank_00_model_states.pt"
    assert model_index.read_bytes().startswith(b'{"format":"spotguard-raw"')  # raw tensor bytes + JSON index
    assert any(n.endswith("optim_states.pt.data0") for n in info.files)
    assert (root / "latest").read_text() == "step-3"
    store.verify(info)
    out = run_ranks(DS_WORKER, 2, [str(root), "load"], timeout=240)
    assert "LOADED step-3 3" in out[0]
