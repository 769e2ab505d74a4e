"""The NCCL recipe's checks (pure: no GPU here) and the private torch APIs in one module."""
from __future__ import annotations

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.elastic import nccl, torch_private
from spotguard.hooks.elastic.join import init_process_group


@pytest.mark.parametrize(("torch_version", "nccl_version", "refused"), [
    ("2.6.0+cu124", "2.26.2", "torch >= 2.7"),
    ("2.7.0", "2.21.5", "NCCL >= 2.26.2"),
    ("2.7.1+cu126", None, "without NCCL"),
    ("2.7.0", "2.26.2", ""),
    ("2.13.0+cu128", "2.27.3", ""),
])
def test_versions_whose_abort_is_not_safe_are_refused_with_the_minimum(torch_version, nccl_version, refused):
    if not refused:
        nccl.check_versions(torch_version, nccl_version)
        return
    with pytest.raises(nccl.NcclNotSafe, match=refused.replace(".", r"\.")):
        nccl.check_versions(torch_version, nccl_version)


@pytest.mark.parametrize(("env", "field"), [
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20"}, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    ({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "soon"}, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    ({"TORCH_NCCL_RETHROW_CUDA_ERRORS": "1"}, "TORCH_NCCL_RETHROW_CUDA_ERRORS"),
])
def test_settings_that_kill_survivors_are_refused_naming_the_variable(env, field):
    with pytest.raises(ConfigError, match=field):
        nccl.check_environment(30.0, env)


def test_the_recipe_passes_with_its_own_values_and_the_defaults():
    nccl.check_environment(30.0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"})
    nccl.check_environment(30.0, {})
    assert set(nccl.RECIPE) >= {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"}


def test_in_place_refuses_nccl_on_this_cpu_torch_before_making_anything(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_IN_PLACE", "1")
    with pytest.raises(nccl.NcclNotSafe, match=r"without NCCL|NCCL >="):
        init_process_group("nccl")
    with pytest.raises(ValueError, match="backend"):
        init_process_group("mpi")


def test_this_torch_has_every_private_api_spotguard_reaches():
    assert torch_private.missing() == []
    torch_private.forget_mesh_caches()
    torch_private.abort_groups()  # no group: nothing happens


def test_forgetting_mesh_caches_loads_no_dtensor_where_none_was_used(tmp_path):
    """A DDP process without DTensor loads none (seconds of imports on a joiner's path); with
    DTensor loaded, its sharding-propagation cache is emptied without importing its debug module."""
    import subprocess
    import sys

    code = f"""import sys, torch, torch.distributed as dist
from spotguard.hooks.elastic import torch_private
torch_private.forget_mesh_caches()
assert 'torch.distributed.tensor' not in sys.modules
dist.init_process_group('gloo', init_method='file://{tmp_path / "store"}', rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
x = distribute_tensor(torch.ones(4, 4), init_device_mesh('cpu', (1,)), [Shard(0)])
stats = torch._C._get_DTensor_sharding_propagator_cache_stats  # (hits, misses) of the cache
x + x
x + x
assert stats() == (1, 1), stats()
torch_private.forget_mesh_caches()
x + x
assert stats() == (0, 1), stats()  # the plan was forgotten: a miss
assert 'torch.distributed.tensor.debug' not in sys.modules
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
