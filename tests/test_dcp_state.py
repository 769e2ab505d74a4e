"""`StateCapture` (hooks/adapters/dcp_state.py) gives what `get_state_dict` gives, call after call:
the same keys, the same live tensors, the current hyper-parameters; it relearns when the
structure changes, and never renames what it cannot (tied weights, DDP and FSDP2 at world size 1
in a worker process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from spotguard.hooks.adapters.dcp_state import StateCapture
from spotguard.processes import free_port


def assert_same(mine, theirs, where="state"):
    """Equal trees whose tensors are views of the same memory."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor), where
        local_mine = mine.to_local() if hasattr(mine, "to_local") else mine
        local_theirs = theirs.to_local() if hasattr(theirs, "to_local") else theirs
        assert local_mine.data_ptr() == local_theirs.data_ptr(), f"{where}: another tensor"
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, where
    elif isinstance(theirs, dict):
        assert type(mine) is type(theirs), f"{where}: {type(mine)} is not {type(theirs)}"  # the snapshot's tree spec
        assert list(mine) == list(theirs), f"{where}: keys {list(mine)} != {list(theirs)}"
        assert getattr(mine, "_metadata", None) == getattr(theirs, "_metadata", None), where
        for key in theirs:
            assert_same(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (m, t) in enumerate(zip(mine, theirs)):
            assert_same(m, t, f"{where}[{i}]")
    else:
        assert mine == theirs, f"{where}: {mine!r} != {theirs!r}"


def reference(model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def train(model, optimizer, inputs=4):
    model(torch.randn(2, inputs)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def trained_captures(capture, steps):
    """`steps` training steps, each followed by a capture checked against `get_state_dict`; the last one."""
    got = None
    for _ in range(steps):
        train(capture.model, capture.optimizer)
        got = capture.capture()
        assert_same(got, reference(capture.model, capture.optimizer))
    return got


def test_every_capture_is_get_state_dict_as_the_job_trains():
    model = mlp()
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-3},
                                   {"params": list(model[1].parameters()) + list(model[3].parameters())}])
    capture = StateCapture(model, optimizer)
    for step in range(4):
        if step == 2:
            optimizer.param_groups[0]["lr"] = 5e-4  # a scheduler's change shows in the next capture
        got = capture.capture()
        assert_same(got, reference(model, optimizer))
        train(model, optimizer)
    assert capture._renaming is not None  # the calls after the first renamed, not get_state_dict
    assert got["optim"]["param_groups"][0]["lr"] == 5e-4
    assert "1.num_batches_tracked" in got["model"]


def test_a_capture_before_the_first_step_initialises_the_state_as_get_state_dict_does():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    first = StateCapture(model, optimizer).capture()
    assert set(first["optim"]["state"]) == {name for name, _ in model.named_parameters()}
    assert_same(StateCapture(model, optimizer).capture(), reference(model, optimizer))


def test_a_changed_structure_is_learnt_again():
    model = mlp()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    capture = StateCapture(model, optimizer)
    train(model, optimizer)
    capture.capture()
    optimizer.add_param_group({"params": model[3].parameters(), "lr": 0.01})
    train(model, optimizer)
    assert_same(capture.capture(), reference(model, optimizer))
    model.add_module("extra", torch.nn.Linear(3, 3))  # new model keys
    assert_same(capture.capture(), reference(model, optimizer))
    optimizer.state.clear()  # a reset optimizer
    assert_same(capture.capture(), reference(model, optimizer))
    assert_same(capture.capture(), reference(model, optimizer))


def test_a_stateless_optimizer_and_tied_weights():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    capture = StateCapture(model, optimizer)
    trained_captures(capture, 2)

    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    optimizer = torch.optim.AdamW(tied.parameters())
    capture = StateCapture(tied, optimizer)
    trained_captures(capture, 2)
    assert capture._renaming is None and not capture._renamable  # get_state_dict on every call


class WithExtraState(torch.nn.Linear):
    def get_extra_state(self):
        return {"seen": 3}

    def set_extra_state(self, state):
        pass


def test_a_model_with_non_tensor_state_stays_on_get_state_dict():
    model = torch.nn.Sequential(WithExtraState(4, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    capture = StateCapture(model, optimizer)
    got = trained_captures(capture, 2)
    assert got["model"]["0._extra_state"] == {"seen": 3} and not capture._renamable


WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    sys.path.insert(0, sys.argv[1])
    from test_dcp_state import StateCapture, mlp, trained_captures
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.AdamW(ddp.parameters())
    capture = StateCapture(ddp, optimizer)
    got = trained_captures(capture, 3)
    assert capture._renaming is not None and "0.weight" in got["model"]  # DDP's "module." is gone
    model = mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters())
    capture = StateCapture(model, optimizer)
    trained_captures(capture, 2)
    assert not capture._renamable  # DTensors: get_state_dict on every call
    dist.destroy_process_group()
    print("ok")
""")


def test_ddp_is_renamed_and_fsdp2_left_to_get_state_dict():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
