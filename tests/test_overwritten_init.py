"""The rebuild's random initialisation is skipped only on the model's own parameters and buffers,
which the transfer overwrites (`hooks/elastic/overwritten_init.py`); the DDP and FSDP2 changes of
tests/test_in_place.py check the state after the change bit for bit against a relaunch through
this path, and `reshard_state.install` refuses a model the transfer would leave unwritten."""
from __future__ import annotations

import pytest
import torch

from spotguard.hooks.elastic.overwritten_init import skipping_random_init
from spotguard.hooks.elastic.reshard_plan import ReshardError
from spotguard.hooks.elastic.reshard_state import collect, install


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)  # its reset_parameters: kaiming_uniform_ / uniform_ on real memory
        self.register_buffer("noise", torch.empty(4))


def test_fills_on_the_models_own_tensors_are_skipped_and_the_generator_does_not_move():
    calls = []

    def build():
        calls.append(1)
        model = Model()
        with torch.no_grad():
            model.noise.fill_(7.0)  # not random: runs
            model.noise.bernoulli_(0.5).mul_(3.0).add_(1.0)  # a fill and its arithmetic: skipped
            model.linear.bias.fill_(7.0).normal_()
        return model, torch.optim.AdamW(model.parameters())

    before = torch.get_rng_state()
    model, optimizer = skipping_random_init(build)
    assert calls == [1] and torch.equal(torch.get_rng_state(), before)
    assert torch.equal(model.noise, torch.full((4,), 7.0)) and torch.equal(model.linear.bias, torch.full((8,), 7.0))
    assert isinstance(optimizer, torch.optim.AdamW)


def test_the_meta_device_path_skips_after_to_empty_and_temporaries_draw_as_written():
    """FSDP2's recipe: modules on meta, materialised by `to_empty`; `trunc_normal_` draws into a
    temporary (not the model's: it runs, the generator moves) and copies it into the weight."""
    def build():
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model.to_empty(device="cpu")
        with torch.no_grad():
            model[0].weight.fill_(2.0).mul_(3.0)  # not a fill: the product stays
            model[0].bias.fill_(5.0).normal_()
            temporary = torch.empty(4).fill_(0.0).uniform_()
            model[1].bias.copy_(temporary)
        return model

    torch.manual_seed(1)
    model = skipping_random_init(build)
    assert torch.equal(model[0].weight, torch.full((4, 4), 6.0)) and torch.equal(model[0].bias, torch.full((4,), 5.0))
    torch.manual_seed(1)
    assert torch.equal(model[1].bias, torch.empty(4).uniform_())  # the temporary's real draw


def test_a_storage_freed_and_reused_is_not_taken_for_the_models():
    def build():
        gone = torch.nn.Linear(256, 256)  # registered (known), then dropped: its storage is freed
        del gone
        reused = torch.zeros(256 * 256)  # may land at the same address
        reused.uniform_(1.0, 2.0)
        return torch.nn.Linear(2, 2), reused

    model, reused = skipping_random_init(build)
    assert bool((reused >= 1.0).all()) and isinstance(model, torch.nn.Module)


def test_a_module_tensor_kept_outside_the_model_fails_the_change_instead_of_training_on_garbage():
    kept = []

    def build():
        kept.append(torch.nn.Linear(3, 3).weight)  # a module's weight, filled at random, kept elsewhere
        return torch.nn.Linear(2, 2)

    with pytest.raises(ReshardError, match="outside the model"):
        skipping_random_init(build)


def test_install_refuses_a_rebuilt_model_with_a_tensor_the_transfer_does_not_bring():
    old = torch.nn.Linear(3, 3)
    shards = collect(old, torch.optim.SGD(old.parameters()), 1)
    new = torch.nn.Linear(3, 3)
    new.register_buffer("extra", torch.zeros(2))
    pieces = dict(enumerate(shards.pieces))
    with pytest.raises(ReshardError, match="buffer/extra"):
        install(new, torch.optim.SGD(new.parameters()), shards.manifest, pieces)
    assert len(pieces) == len(shards.pieces)  # refused before anything was taken
