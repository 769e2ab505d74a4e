"""In place for Accelerate: what an in-place membership change does to an `Accelerator`'s objects.

The survivors keep their processes, their model's module, their optimizer and scheduler objects;
only what is bound to the old process group is made again. The agreed-step machine
(`hooks/machine/table.py`) runs the change; `AcceleratorSave` (accelerate.py) is the adapter it
drives, and these are its parts:

- `check(accelerator)`: ConfigError naming what to change unless the job can change in place: a
  group made by spotguard (`spotguard.hooks.elastic.init_process_group()` before the
  `Accelerator`), plain DDP or a single process (not DeepSpeed, FSDP, Megatron or XLA: their
  engines lay the state out for one world size when `prepare` builds them), exactly one prepared
  optimizer (the transfer carries one optimizer's state with the model's).
- `rewrap(accelerator, old)`: the module under `old` (the prepared DDP model) in a new
  `DistributedDataParallel` on the current default group, made as `Accelerator.prepare_model`
  makes it (the DDP kwargs handler, device ids on a GPU; collective: DDP broadcasts rank 0's
  parameters, as a joiner's `prepare` does), put in `old`'s place among the Accelerator's
  prepared models; then the Accelerator's world (`num_processes`, `process_index`, kept in
  Accelerate's shared state and read by `save_state`, `is_main_process`, `wait_for_everyone`) is
  the new group's. The optimizer, scheduler and grad scaler objects stay: they hold the module's
  parameters, which do not change.
- `Carried(accelerator)`: what the shard transfer (parameters and optimizer state) does not carry
  to a joiner, as the adapter's data position (`data=`: JSON, the same on every rank, in every
  checkpoint's metadata and every hand-over): `state_dict()` holds the schedulers' states, the
  states of the objects registered for checkpointing (the `ElasticSampler` among them: the data
  position) and the grad scaler's; `load_state_dict` loads them into this process's objects in
  the same order (a joiner's, or at a resume the same values `load_state` read). `check` refuses
  a state that is not JSON at construction (ConfigError naming the object).
- `optimizer(accelerator)`: the torch optimizer under the prepared one.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from spotguard.config import ConfigError

# Accelerate's distributed types whose engine is laid out for one world size (DistributedType's values).
ONE_WORLD_ENGINES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def check(accelerator: Any) -> None:
    """See the module docstring."""
    from spotguard.hooks.elastic.join import elastic_process

    if elastic_process() is None:
        raise ConfigError("in_place", "needs the process group made by spotguard: call "
                          "spotguard.hooks.elastic.init_process_group() before Accelerator(), and launch with "
                          "`spotguard launch` for an in-place job (SPOTGUARD_IN_PLACE=1)")
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in ONE_WORLD_ENGINES:
        raise ConfigError("in_place", f"Accelerate's {kind} engine lays the state out for one world size when "
                          "prepare() builds it: this job keeps the restart path (in_place=False)")
    if len(accelerator._optimizers) != 1:
        raise ConfigError("in_place", f"needs exactly one prepared optimizer, found {len(accelerator._optimizers)}")
    for name, state in Carried(accelerator).parts():
        try:
            json.dumps(state)
        except (TypeError, ValueError) as exc:
            raise ConfigError("in_place", f"a joiner receives the state of {name} as JSON, and it is not ({exc}): "
                              "make its state_dict() JSON values, or keep the restart path") from None


def optimizer(accelerator: Any) -> torch.optim.Optimizer:
    """The torch optimizer under the (one) prepared optimizer."""
    found = accelerator._optimizers[0]
    while hasattr(found, "optimizer"):
        found = found.optimizer
    return found


def module_of(model: Any) -> torch.nn.Module:
    """The module under DDP's wrapper (the model itself when it is none)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def rewrap(accelerator: Any, old: Any) -> torch.nn.Module:
    """See the module docstring."""
    import torch.distributed as dist

    module = module_of(old)
    model: torch.nn.Module = module
    if dist.is_available() and dist.is_initialized():
        kwargs = accelerator.ddp_handler.to_kwargs() if accelerator.ddp_handler is not None else {}
        device = next(module.parameters()).device
        if device.type != "cpu":
            kwargs.update(device_ids=[device.index], output_device=device.index)
        model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
        if accelerator.ddp_handler is not None:
            accelerator.ddp_handler.register_comm_hook(model)
    accelerator._models[:] = [model if m is old else m for m in accelerator._models]
    set_world(*_group_world())
    return model


def _group_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def set_world(rank: int, world_size: int) -> None:
    """Accelerate's shared state (PartialState's and AcceleratorState's, each a dict of its own)
    and the launcher's environment say `rank` of `world_size`."""
    from accelerate.state import AcceleratorState, PartialState

    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared["process_index"], shared["num_processes"] = rank, world_size
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)


class Carried:
    """See the module docstring."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def parts(self) -> list[tuple[str, Any]]:
        """(what, its state) of every object carried, by name (the JSON check names them)."""
        acc, state = self.accelerator, self.state_dict()
        return [*zip((f"scheduler {type(s).__name__}" for s in acc._schedulers), state["schedulers"]),
                *zip((f"registered object {type(o).__name__}" for o in acc._custom_objects), state["custom"]),
                ("grad scaler", state["scaler"])]

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        scaler = getattr(acc, "scaler", None)
        return {"schedulers": [_scheduler(s).state_dict() for s in acc._schedulers],
                "custom": [obj.state_dict() for obj in acc._custom_objects],
                "scaler": scaler.state_dict() if scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        schedulers, custom = self.accelerator._schedulers, self.accelerator._custom_objects
        if len(state["schedulers"]) != len(schedulers) or len(state["custom"]) != len(custom):
            raise RuntimeError(f"the peer's Accelerator prepared {len(state['schedulers'])} schedulers and registered "
                               f"{len(state['custom'])} objects for checkpointing, this one {len(schedulers)} and "
                               f"{len(custom)}: every rank (joiners too) runs the same script")
        for scheduler, saved in zip(schedulers, state["schedulers"]):
            _scheduler(scheduler).load_state_dict(saved)
        for obj, saved in zip(custom, state["custom"]):
            obj.load_state_dict(saved)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])


def _scheduler(prepared: Any) -> Any:
    """The torch scheduler under Accelerate's AcceleratedScheduler."""
    return getattr(prepared, "scheduler", prepared)
