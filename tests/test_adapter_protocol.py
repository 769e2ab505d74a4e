"""What an in-place change calls on an adapter is declared, not found by duck typing: every
`adapter.<name>` the state transfer (hooks/elastic/transfer.py) uses is a member of
`ResizableAdapter`, and `TorchDCPAdapter` implements the protocol (resizable with `build=`)."""
from __future__ import annotations

import ast
import inspect

from typing import Protocol

import torch

from spotguard.hooks.adapters.base import CheckpointAdapter, ResizableAdapter, resizable_adapter
from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
from spotguard.hooks.elastic import transfer


def protocol_members(protocol: type) -> set[str]:
    """The methods, properties and annotated attributes `protocol` and the protocols it extends declare."""
    members: set[str] = set()
    for base in protocol.__mro__:
        if base.__dict__.get("_is_protocol") and base is not Protocol:
            members |= {name for name in vars(base) if not name.startswith("_")}
            members |= set(inspect.get_annotations(base))
    return members


def adapter_calls(module) -> set[str]:
    """Every `<name>` of `adapter.<name>` (an `adapter` variable or attribute) in `module`'s code."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "adapter") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "adapter"):
                names.add(node.attr)
    return names


def test_resizable_adapter_declares_everything_the_transfer_calls_on_an_adapter():
    assert {"save", "resume", "snapshot_step"} <= protocol_members(CheckpointAdapter)
    calls = adapter_calls(transfer)
    assert {"shard_state", "shard_device", "load_shards", "full_state", "load_full_state"} <= calls
    assert calls <= protocol_members(ResizableAdapter), calls - protocol_members(ResizableAdapter)


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters())


def test_the_dcp_adapter_is_resizable_with_build_only_and_hands_its_shards_over_alone(tmp_path):
    model, optimizer = _build()
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=tmp_path / "a", build=_build)
    fixed = TorchDCPAdapter(model, optimizer, checkpoint_dir=tmp_path / "b")
    try:
        assert isinstance(adapter, ResizableAdapter) and resizable_adapter(adapter) is adapter
        assert resizable_adapter(fixed) is None
        shards = adapter.shard_state()
        assert adapter.shard_device() == torch.device("cpu")
        names = [entry["name"] for entry in shards.manifest["entries"]]
        assert any(n.startswith("model/") for n in names) and any("exp_avg" in n for n in names), names
        weights = {n: p.clone() for n, p in zip(names, shards.pieces)}
        adapter.rebuild()  # a fresh model and optimizer (world size 1: no group)
        assert adapter.model is not model and not torch.equal(adapter.model.weight, model.weight)  # before the step
        adapter.load_shards(shards.manifest, dict(enumerate(weights.values())))
        again = adapter.shard_state()
        assert all(torch.equal(again.pieces[i], piece) for i, piece in enumerate(weights.values()))
    finally:
        adapter.close()
        fixed.close()
