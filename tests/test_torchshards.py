"""A state tree as torch.save shards written by threads at once (checkpoint/torchshards.py)."""
from __future__ import annotations

import pytest
import torch

from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.hooks.checkpoint.torchshards import deal, load_torch_shards, save_torch_shards

def odd_tree():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
            "extra": {"pair": (torch.arange(4), "tag"), "half": [torch.ones(2, dtype=torch.bfloat16), None],
                      "shape": torch.Size([2, 3]), "empty": torch.empty(0), "nested": [[torch.zeros(3)], {}]}}


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def commit(store, tag, write):
    pending = store.begin(tag)
    write(pending)
    pending.finish_rank(0)
    return store.commit(tag, world_size=1)


def test_a_tree_round_trips_and_every_shard_is_a_durable_torch_file(tmp_path):
    state = odd_tree()
    store = CheckpointStore(tmp_path / "ckpt")
    info = commit(store, "t", lambda pending: save_torch_shards(pending, "state", state, shards=3))
    assert sorted(info.files) == ["state-1-of-3.pt", "state-2-of-3.pt", "state-3-of-3.pt", "state-index.pt"]
    store.verify(info)  # the CRC-32s kept as the files streamed out are those of the bytes on disk
    for k in (1, 2, 3):
        shard = torch.load(info.dir / f"state-{k}-of-3.pt", weights_only=True)
        assert shard and all(isinstance(t, torch.Tensor) for t in shard)
    assert_same(state, load_torch_shards(info.dir, "state"))


def test_dealing_balances_bytes_and_makes_no_empty_shard():
    tensors = [((i,), torch.empty(n, dtype=torch.uint8)) for i, n in enumerate((100, 60, 50, 40, 10))]
    groups = deal(tensors, 2)
    assert sorted(sum(t.nbytes for _, t in group) for group in groups) == [120, 140]
    assert len(deal(tensors, 9)) == 5 and all(deal(tensors, 9))
    assert deal([], 4) == [[]]


def test_a_tree_without_tensors_is_one_empty_shard(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    info = commit(store, "t", lambda pending: save_torch_shards(pending, "s", {"step": 3, "lr": [0.1]}))
    assert sorted(info.files) == ["s-1-of-1.pt", "s-index.pt"]
    assert load_torch_shards(info.dir, "s") == {"step": 3, "lr": [0.1]}


def test_a_missing_or_foreign_shard_is_named(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    info = commit(store, "t", lambda pending: save_torch_shards(pending, "state", odd_tree(), shards=2))
    torch.save([torch.ones(1)], info.dir / "state-2-of-2.pt")
    with pytest.raises(ValueError, match=r"state-2-of-2\.pt does not hold"):
        load_torch_shards(info.dir, "state")
    (info.dir / "state-1-of-2.pt").unlink()
    with pytest.raises(ValueError, match=r"state-1-of-2\.pt: a shard the index names is missing"):
        load_torch_shards(info.dir, "state")


def test_a_failing_shard_fails_the_save_after_the_other_writers_stopped(tmp_path):
    pending = CheckpointStore(tmp_path / "ckpt").begin("t")
    pending.path("state-2-of-3.pt").mkdir()  # a real failure: that shard cannot be opened for writing
    with pytest.raises(IsADirectoryError):
        save_torch_shards(pending, "state", odd_tree(), shards=3)
    # every other writer ran to its end before the error surfaced: whole, loadable files
    finished = sorted(p.name for p in pending.dir.iterdir() if p.is_file() and p.suffix == ".pt")
    assert finished == ["state-1-of-3.pt", "state-3-of-3.pt", "state-index.pt"]
    for name in finished:
        torch.load(pending.dir / name, weights_only=True)
    pending.close()
