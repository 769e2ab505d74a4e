"""TorchDCPAdapter snapshots: buffers are allocated once and reused, and still hold the right state."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter


def train_step(model, optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def tensor_leaves(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def test_snapshots_reuse_their_buffers_and_persist_the_latest_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, optimizer, 1)  # Adam's state exists from here on
    adapter = TorchDCPAdapter(model, optimizer, store=CheckpointStore(tmp_path / "ckpt"))

    adapter.snapshot(1)
    first = [t.data_ptr() for t in tensor_leaves(adapter.held_snapshot)]
    train_step(model, optimizer, 2)
    adapter.snapshot(2)
    second = tensor_leaves(adapter.held_snapshot)
    assert [t.data_ptr() for t in second] == first  # no new allocation
    current = tensor_leaves(adapter.state())
    assert len(second) == len(current) and all(torch.equal(a, b) for a, b in zip(second, current))

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, 3)  # the live model moves on; the snapshot must not
    assert adapter.persist_snapshot(reason="notice") == 2

    torch.manual_seed(1)
    fresh = torch.nn.Linear(8, 4)
    reloaded = TorchDCPAdapter(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.01),
                               store=CheckpointStore(tmp_path / "ckpt"))
    assert reloaded.resume() == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
