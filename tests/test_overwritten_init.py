"""The rebuild's random initialisation is skipped only where the transfer overwrites it
(`hooks/elastic/overwritten_init.py`); the FSDP2 and DDP shrinks of tests/test_in_place.py check
the state after the change bit for bit against a relaunch, through this path."""
from __future__ import annotations

import logging

import pytest
import torch

from spotguard.hooks.elastic import overwritten_init
from spotguard.hooks.elastic.overwritten_init import skipping_random_init


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(overwritten_init, "_disabled", False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("noise", torch.empty(4))
        self.register_buffer("steps", torch.zeros(()))


def build_into(sentinel: float, calls: list, keep_elsewhere: list | None = None, view: bool = False):
    def build():
        calls.append(1)
        model = Model()  # Linear's own reset_parameters (kaiming_uniform_, uniform_) on real memory
        with torch.no_grad():
            for tensor in (model.linear.weight, model.linear.bias, model.noise):
                tensor.fill_(sentinel)
            torch.nn.init.trunc_normal_(model.linear.weight, std=0.02)  # uniform_, erfinv_, mul_, add_, clamp_
            model.linear.bias.normal_()
            model.noise.bernoulli_(0.5)
            if keep_elsewhere is not None:
                kept = torch.empty(6).uniform_()
                keep_elsewhere.append(kept[2:4] if view else kept)  # a view alone keeps the storage too
        return model, torch.optim.AdamW(model.parameters())
    return build


def test_random_fills_on_the_models_tensors_are_skipped_and_the_generator_does_not_move():
    calls: list = []
    torch.manual_seed(3)
    before = torch.get_rng_state()
    model, optimizer = skipping_random_init(build_into(7.0, calls))
    assert calls == [1] and torch.equal(torch.get_rng_state(), before)  # trunc_normal_'s temporary too
    for tensor in (model.linear.bias, model.noise):  # the memory as it was (the weight got the temporary's)
        assert torch.equal(tensor, torch.full_like(tensor, 7.0))
    assert isinstance(optimizer, torch.optim.AdamW) and not overwritten_init._disabled


@pytest.mark.parametrize("view", [False, True])
def test_a_random_tensor_kept_elsewhere_makes_the_build_run_again_as_written_from_then_on(caplog, view):
    calls: list = []
    kept: list = []
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="spotguard.hooks.elastic"):
        model, _ = skipping_random_init(build_into(7.0, calls, kept, view))
    assert calls == [1, 1] and "built again with its initialisation" in caplog.text
    torch.manual_seed(3)
    expected, _ = build_into(7.0, [], [])()
    assert torch.equal(model.linear.weight, expected.linear.weight)  # the build as written: real draws
    assert not torch.equal(model.linear.weight, torch.full_like(model.linear.weight, 7.0))
    skipping_random_init(build_into(7.0, calls))  # never skipped again in this process
    assert calls == [1, 1, 1]


def test_meta_tensors_and_arithmetic_on_tensors_not_filled_are_left_to_torch():
    calls: list = []

    def build():
        calls.append(1)
        with torch.device("meta"):
            model = torch.nn.Linear(4, 4)  # its reset_parameters: fills on meta, nothing to skip
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.weight.fill_(2.0).mul_(3.0)  # no fill skipped on this storage: the product stays
            model.bias.normal_().mul_(0.0).add_(1.0)  # all skipped: the memory as to_empty left it
        return model

    before = torch.get_rng_state()
    model = skipping_random_init(build)
    assert calls == [1] and torch.equal(model.weight, torch.full((4, 4), 6.0))
    assert torch.equal(torch.get_rng_state(), before)
