"""NCCL for in-place changes, built to the recipe known to work (torchft's reconfigurable NCCL
group, `torchft/process_group.py` in github.com/pytorch/torchft; NVIDIA resiliency-ext's in-process
restart, `inprocess/abort.py` in github.com/NVIDIA/nvidia-resiliency-ext).

Contract:
- `check_versions(torch_version, nccl_version)` (pure): raises `NcclNotSafe`, naming both
  versions and the minimum, below torch 2.7 / NCCL 2.26.2 (older aborts can deadlock).
- `check_environment(reform_timeout, env)` (pure): raises `ConfigError` naming the variable when
  `TORCH_NCCL_ASYNC_ERROR_HANDLING` is set to 1 or 3 (tears the process down: it must only abort
  communicators, 2), when `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` (default 480) is not longer than the
  re-form timeout, or when `TORCH_NCCL_RETHROW_CUDA_ERRORS` is not 0. `RECIPE` lists the
  variables a user sets, with the values; docs/in-place.md repeats it.
- `check(reform_timeout)`: both checks on this process's torch and NCCL (called by
  `join.init_process_group("nccl")` before anything is made).
- `eager_kwargs(local_rank)`: `device_id` for `init_process_group`, so communicators are made
  eagerly at the formation (where a missing peer costs the re-form timeout), not at first use.
- `quiesce_and_abort()`: synchronises this device's stream, then aborts every group
  (`torch_private.abort_groups`): never a blocking destroy while a peer may be gone.
The Guard's control traffic (agreement, votes, host lists) stays on the formation's gloo control
group (`agreement.control_group`), the adapters' on its gloo checkpoint group; each formation
uses a fresh store prefix (`rendezvous`).
"""
from __future__ import annotations

import os
import re
from typing import Any

from spotguard.config import ConfigError

MIN_TORCH = (2, 7)
MIN_NCCL = (2, 26, 2)
DEFAULT_HEARTBEAT_SECONDS = 480.0  # torch's TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC default

RECIPE = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2 (abort the communicators on an error, keep the process)",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "longer than SPOTGUARD_REFORM_TIMEOUT (default 480 s > 30 s)",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0 (a CUDA error in the watchdog must not kill the survivors)",
    "SPOTGUARD_REFORM_TIMEOUT": "the longest a change waits for a peer (default 30 s)",
}


class NcclNotSafe(RuntimeError):
    """This torch or NCCL cannot abort a communicator safely: in-place changes on NCCL refused."""


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def check_versions(torch_version: str, nccl_version: str | None) -> None:
    """See the module docstring."""
    if _parse(torch_version)[:2] < MIN_TORCH:
        raise NcclNotSafe(f"in-place changes on NCCL need torch >= {'.'.join(map(str, MIN_TORCH))} "
                          f"(its abort is safe from there), this is torch {torch_version}: use gloo or upgrade")
    if nccl_version is None:
        raise NcclNotSafe(f"torch {torch_version} was built without NCCL: use backend='gloo'")
    if _parse(nccl_version) < MIN_NCCL:
        raise NcclNotSafe(f"in-place changes on NCCL need NCCL >= {'.'.join(map(str, MIN_NCCL))} (older "
                          f"aborts can deadlock), this torch has NCCL {nccl_version}: use gloo or upgrade")


def check_environment(reform_timeout: float, env: dict[str, str] | None = None) -> None:
    """See the module docstring."""
    env = dict(os.environ if env is None else env)
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "")
    if handling in ("1", "3"):
        raise ConfigError("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                          f"{handling} tears the process down on a peer's loss; in place needs 2")
    raw = env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC") or str(DEFAULT_HEARTBEAT_SECONDS)
    try:
        heartbeat = float(raw)
    except ValueError:
        raise ConfigError("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", f"expected seconds, got {raw!r}") from None
    if heartbeat <= reform_timeout:
        raise ConfigError("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
                          f"{heartbeat:g}s must be longer than the re-form timeout ({reform_timeout:g}s), or the "
                          "watchdog kills a survivor waiting for a change")
    if env.get("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0") != "0":
        raise ConfigError("TORCH_NCCL_RETHROW_CUDA_ERRORS", "must be 0 for in-place changes")


def nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def check(reform_timeout: float) -> None:
    import torch

    check_versions(torch.__version__, nccl_version())
    check_environment(reform_timeout)


def eager_kwargs(local_rank: int) -> dict[str, Any]:
    import torch

    torch.cuda.set_device(local_rank)
    return {"device_id": torch.device("cuda", local_rank)}


def quiesce_and_abort() -> None:
    import torch

    from spotguard.hooks.elastic.torch_private import abort_groups

    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    abort_groups()
