"""The small job in-place membership changes are tried on: one model, its DDP/FSDP2 build, the
data of a step, and the membership file a harness pushes (what a sidecar would relay).

Shared by the in-place tests' worker (`tests/workers/elastic.py`) and the membership_change
bench (`bench/_membership_worker.py`), so both measure and check the same job.

Contract:
- `base_model()`: the same small MLP (seed 0) on every call, unwrapped.
- `build_for(mode)`: a `build()` for `TorchDCPAdapter(build=...)`: the model wrapped for the
  CURRENT default group ("ddp": DistributedDataParallel; "fsdp2": `fully_shard` per Linear and
  the root, on a 1-D CPU mesh of the whole world) and its AdamW (lr 1e-2).
- `deepspeed_config(world, stage, offload, bf16)` / `build_deepspeed(stage, offload, bf16)`: the
  same model under DeepSpeed ZeRO `stage` on the current default group, rank `r`'s micro-batch its
  share of the global batch; a client torch AdamW (lr 1e-2), or with `offload` DeepSpeed's own
  AdamW from the config, its state on the CPU (DeepSpeedCPUAdam); `bf16`: bf16 parameters over an
  fp32 master (inputs are cast by the caller).
- `batch(step, rank, world)`: rank's contiguous share of step `step`'s global batch of 16
  samples, a function of the step alone (the same samples at any world size dividing 16).
- `membership_reader(path)`: a callable returning the JSON membership at `path`, None while the
  file is missing or half written.
- `watch_memberships(read, view)`: a daemon thread offering every new membership `read()`
  returns to the Guard's membership view (`guard.view.offer`), every 50 ms.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

GLOBAL_BATCH = 16
MODES = ("ddp", "fsdp2")


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def build_for(mode: str) -> Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")

    def build():
        model = base_model()
        world = dist.get_world_size()
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    return build


def deepspeed_config(world: int, stage: int = 2, offload: bool = False, bf16: bool = False) -> dict:
    zero: dict = {"stage": stage}
    config: dict = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                    "train_batch_size": GLOBAL_BATCH // world * world, "zero_optimization": zero,
                    "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def build_deepspeed(stage: int = 2, offload: bool = False, bf16: bool = False):
    """The engine of `deepspeed_config` for the current default group (module docstring)."""
    import deepspeed

    model = base_model()
    optimizer = None if offload else torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _optimizer, _loader, _scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters() if offload else None,
        config=deepspeed_config(dist.get_world_size(), stage, offload, bf16))
    return engine


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def membership_reader(path: Path) -> Callable[[], dict | None]:
    def read() -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    return read


def watch_memberships(read: Callable[[], dict | None], view) -> threading.Thread:
    def watch() -> None:
        seen = None
        while True:
            data = read()
            if data is not None and data != seen:
                seen = data
                view.offer(data)
            time.sleep(0.05)

    thread = threading.Thread(target=watch, name="membership-watch", daemon=True)
    thread.start()
    return thread
