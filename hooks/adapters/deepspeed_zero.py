"""A DeepSpeed ZeRO-1/2 engine's training state as the in-place reshard moves it, and the engine
made again on a new group: every DeepSpeed internal the in-place path reaches, in one module.

Contract:
- `facts_of(engine)` -> `EngineFacts` for `deepspeed_support.refusal`.
- `collect(engine)` -> `Shards` (elastic/reshard_state.py's form): per optimizer group `i` the
  fp32 master partition (`zero/<i>/fp32`) and every optimizer-state tensor of the partition's
  size (`zero/<i>/exp_avg`, `zero/<i>/exp_avg_sq`), each a 1-D tensor of the group's flat content
  (the parameters in DeepSpeed's order with its per-parameter padding, without the end padding,
  the same at every world size) laid out `zero_partition(2)`; the pieces are views of the live
  partitions (no copy). The manifest also carries, as JSON: the optimizer's scalar state (Adam's
  step count, as a tensor or a number as it was), the param groups' hyperparameters, the engine's
  counters (global steps and samples, skipped and micro steps) and gradient-accumulation steps,
  the LR scheduler's state and the fp16 loss scaler's. Raises `ReshardError` when a partition is
  not where the layout puts it.
- `install(engine, manifest, pieces)` on an engine built for the new group (every rank of it:
  collective): the pieces become the fp32 master partitions and the optimizer's state, the
  scalars and counters are set, and the model's parameters are made from the fp32 master as
  DeepSpeed's step makes them (its own `update_lp_params`: each rank copies its partition, one
  all-gather); the micro-step count is carried as optimizer steps times the new engine's
  accumulation steps (`carried_micro_steps`). Raises `ReshardError` when the engine's groups
  differ from the manifest's.
- `reinitialize(engine, config)` -> a new engine for the current default group, the module kept:
  the optimizer made again over the same parameter groups (the client's class, or DeepSpeed's from
  the config), the client LR scheduler re-pointed at it; the old engine is destroyed first
  (its gradient hooks removed, its pinned buffers released) and DeepSpeed's cached process groups
  of the old group are dropped (and py-cpuinfo's answer kept, `join.keep_cpu_info`: DeepSpeed's
  CPU Adam asks it again at every engine, ~1 s). Its state is not carried: `collect` / `install`
  carry it.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from spotguard.hooks.adapters.deepspeed_support import EngineFacts
from spotguard.hooks.elastic.reshard_plan import Layout, ReshardError, held_rows, piece_size, zero_partition
from spotguard.hooks.elastic.reshard_state import Shards, jsonable

log = logging.getLogger("spotguard.hooks.adapters.deepspeed")

ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor: a partition holds a multiple of 2 items
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _device_of(offload: Any) -> str:
    device = getattr(offload, "device", None) if offload is not None else None
    return str(getattr(device, "value", device) or "none")


def facts_of(engine: Any) -> EngineFacts:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    optimizer = getattr(engine, "optimizer", None)
    basic = getattr(optimizer, "optimizer", None)
    name = type(basic).__name__ if basic is not None else str(engine.optimizer_name() or "none")
    mpu = getattr(engine, "mpu", None)
    mp_size = 1
    if mpu is not None and hasattr(mpu, "get_model_parallel_world_size"):
        mp_size = int(mpu.get_model_parallel_world_size())
    return EngineFacts(
        zero_stage=int(engine.zero_optimization_stage()), pipeline=isinstance(engine, PipelineEngine),
        optimizer=name, offload_optimizer=_device_of(engine.zero_offload_optimizer()),
        offload_param=_device_of(engine.zero_offload_param()),
        round_robin_gradients=bool(getattr(optimizer, "round_robin_gradients", False)),
        model_parallel_size=mp_size, sequence_parallel_size=int(getattr(engine, "sequence_parallel_size", 1) or 1),
        expert_parallel=bool(getattr(engine, "has_moe_layers", False)))


def _world(optimizer: Any, group: int) -> tuple[int, int]:
    import deepspeed.comm as ds_dist

    pg = optimizer.real_dp_process_group[group]
    return ds_dist.get_rank(group=pg), ds_dist.get_world_size(group=pg)


def content_rows(optimizer: Any, group: int) -> int:
    """The flat content of optimizer group `group`: its parameters with DeepSpeed's per-parameter
    padding, without the end padding (the same at every world size)."""
    offsets, metas = optimizer.round_robin_bit16_offsets[group], optimizer.round_robin_bit16_meta[group]
    return int(offsets[-1] + metas[-1].numel()) if metas else 0


def _scalar(field: str, value: Any) -> Any:
    """`value` as JSON: a one-item tensor as its dtype and value, anything else as it is (ValueError
    naming `field` when it is not JSON)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "value": value.item()}
    return jsonable(field, value)


def _unscalar(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "value"}:
        return torch.tensor(value["value"], dtype=getattr(torch, value["tensor"]))
    return value


def _group_pieces(optimizer: Any, i: int, entries: list[dict[str, Any]], pieces: list[torch.Tensor]) -> dict[str, Any]:
    """Appends optimizer group `i`'s fp32 partition and partition-sized state (module docstring) to
    `entries` / `pieces`; returns the group's scalar state, as JSON."""
    fp32 = optimizer.single_partition_of_fp32_groups[i]
    rank, world = _world(optimizer, i)
    rows = content_rows(optimizer, i)
    layout = Layout((world,), (zero_partition(ALIGN),))
    start, stop = held_rows(layout, rows, rank)
    size = piece_size(rows, world, ALIGN)
    if fp32.numel() != size:
        raise ReshardError(f"ZeRO group {i}: this rank's fp32 partition holds {fp32.numel()} items, "
                           f"the layout {layout} {size}")
    scalars: dict[str, Any] = {}
    for key, value in [("fp32", fp32), *(optimizer.optimizer.state.get(fp32) or {}).items()]:
        if isinstance(value, torch.Tensor) and value.numel() == fp32.numel() and value.dim() == 1:
            dtype = str(value.dtype).removeprefix("torch.")
            entries.append({"name": f"zero/{i}/{key}", "shape": [rows], "dtype": dtype, "dtensor": False,
                            "mesh": [world], "placements": [zero_partition(ALIGN)]})
            pieces.append(value.detach().reshape(-1)[:stop - start])
        else:
            scalars[key] = _scalar(f"optimizer state of group {i}: {key}", value)
    return scalars


def collect(engine: Any) -> Shards:
    optimizer = engine.optimizer
    entries: list[dict[str, Any]] = []
    pieces: list[torch.Tensor] = []
    scalars = {str(i): _group_pieces(optimizer, i, entries, pieces)
               for i in range(len(optimizer.single_partition_of_fp32_groups))}
    groups = [{k: _scalar(f"param_groups[{i}].{k}", v) for k, v in group.items() if k != "params"}
              for i, group in enumerate(optimizer.optimizer.param_groups)]
    scheduler = engine.lr_scheduler.state_dict() if getattr(engine, "lr_scheduler", None) is not None else None
    scaler = getattr(optimizer, "loss_scaler", None)
    manifest = {"entries": entries, "optim_values": scalars, "param_groups": groups,
                "counters": {k: int(getattr(engine, k, 0) or 0) for k in COUNTERS},
                "accumulation": int(engine.gradient_accumulation_steps()),
                "scheduler": _scalar("the LR scheduler's state", scheduler),
                "loss_scaler": {k: _scalar(f"the loss scaler's {k}", getattr(scaler, k)) for k in SCALER_FIELDS
                                if scaler is not None and hasattr(scaler, k)}}
    return Shards(manifest, pieces)


def _padded(piece: torch.Tensor, size: int, like: torch.Tensor) -> torch.Tensor:
    """`piece` as a partition of `size` items (zeros past it), on `like`'s device; the piece itself
    when it already is one."""
    if piece.numel() == size and piece.device == like.device and piece.is_contiguous():
        return piece
    out = torch.zeros(size, dtype=piece.dtype, device=like.device)
    out[:piece.numel()].copy_(piece)
    return out


def install(engine: Any, manifest: dict[str, Any], pieces: dict[int, torch.Tensor]) -> None:
    optimizer = engine.optimizer
    by_name = {entry["name"]: index for index, entry in enumerate(manifest["entries"])}
    partitions = optimizer.single_partition_of_fp32_groups
    if len(partitions) != len(manifest["param_groups"]):
        raise ReshardError(f"the rebuilt engine has {len(partitions)} ZeRO groups, the manifest "
                           f"{len(manifest['param_groups'])}")
    with torch.no_grad():
        for i, fp32 in enumerate(partitions):
            rows = content_rows(optimizer, i)
            index = by_name.get(f"zero/{i}/fp32")
            if index is None or manifest["entries"][index]["shape"] != [rows]:
                raise ReshardError(f"ZeRO group {i}: the rebuilt engine's flat content holds {rows} items, the "
                                   f"manifest {manifest['entries'][index]['shape'] if index is not None else 'none'}")
            piece = pieces.pop(index)
            fp32.data[:piece.numel()].copy_(piece)
            fp32.data[piece.numel():].zero_()
            state: dict[str, Any] = {}
            for name, index in by_name.items():
                if name.startswith(f"zero/{i}/") and name != f"zero/{i}/fp32":
                    state[name.rsplit("/", 1)[1]] = _padded(pieces.pop(index), fp32.numel(), fp32)
            state.update({k: _unscalar(v) for k, v in manifest["optim_values"].get(str(i), {}).items()})
            optimizer.optimizer.state[fp32] = state
        for group, saved in zip(optimizer.optimizer.param_groups, manifest["param_groups"]):
            for key, value in saved.items():
                value = _unscalar(value)
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    optimizer._hp_optimizer_states_linked = False  # the hp mappings link the installed state at the next step
    optimizer.update_lp_params()
    counters = dict(manifest["counters"])
    counters["micro_steps"] = carried_micro_steps(int(counters.get("micro_steps", 0)),
                                                  int(manifest.get("accumulation") or 1),
                                                  int(engine.gradient_accumulation_steps()))
    for key, value in counters.items():
        setattr(engine, key, int(value))
    if manifest.get("scheduler") is not None and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(manifest["scheduler"])
    scaler = getattr(optimizer, "loss_scaler", None)
    for key, value in (manifest.get("loss_scaler") or {}).items():
        if scaler is not None:
            setattr(scaler, key, _unscalar(value))


def carried_micro_steps(micro_steps: int, old_accumulation: int, new_accumulation: int) -> int:
    """The engine's micro-step count in a group that accumulates `new_accumulation` micro-batches a
    step: the same number of optimizer steps, so DeepSpeed's boundary arithmetic
    (`(micro_steps + 1) % accumulation`) starts the next step at its first micro-batch. A change
    between two micro-batches of a step (not at the Guard's step boundary) drops the partial
    gradients, as a relaunch does: logged."""
    if micro_steps % old_accumulation:
        log.warning("an in-place change came %d micro-batches into a step of %d: their gradients are not "
                    "carried", micro_steps % old_accumulation, old_accumulation)
    return micro_steps // old_accumulation * new_accumulation


def _drop_cached_groups() -> None:
    """DeepSpeed caches process groups it cloned from the default group (`groups._WORLD_GROUP`, the
    data-parallel ones); the old group's are gone after a re-form."""
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP",
                 "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        cached = getattr(groups, name, None)
        if isinstance(cached, dict):
            cached.clear()


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """The parameter groups the engine was made with: the model's parameters (DeepSpeed's order)
    with each group's hyperparameters."""
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": list(params)}
            for group, params in zip(optimizer.optimizer.param_groups, optimizer.bit16_groups)]


def destroy(engine: Any) -> None:
    """Releases what an engine holds beyond its module (DeepSpeed #7204: the module kept the dropped
    engine alive through the forward hooks it registered on it, and the engine its buffers; its
    `destroy()` removes the gradient hooks only)."""
    optimizer = getattr(engine, "optimizer", None)
    for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        handle = getattr(engine, name, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
            setattr(engine, name, None)
    engine.destroy()
    if optimizer is not None:
        basic = getattr(optimizer, "optimizer", None)
        if basic is not None:
            basic.state.clear()
        for name in ("single_partition_of_fp32_groups", "bit16_groups_flat", "parallel_partitioned_bit16_groups",
                     "averaged_gradients", "params_in_partition", "params_not_in_partition"):
            value = getattr(optimizer, name, None)
            if isinstance(value, (list, dict)):
                value.clear()
    for param in engine.module.parameters():
        for name in ("_hp_mapping", "_zero_optimizer", "grad_accum"):
            if hasattr(param, name):
                setattr(param, name, None)
    engine.optimizer = None
    engine.basic_optimizer = None
    engine.lr_scheduler = None


def reinitialize(engine: Any, config: dict[str, Any]) -> Any:
    import deepspeed

    from spotguard.hooks.elastic.join import keep_cpu_info

    keep_cpu_info()  # DeepSpeed's CPU Adam asks for the CPU again at each engine: once per process
    module, optimizer = engine.module, engine.optimizer
    groups = _param_groups(optimizer)
    client_optimizer = engine.client_optimizer
    optimizer_class = type(optimizer.optimizer) if client_optimizer is not None else None
    scheduler = engine.client_lr_scheduler
    destroy(engine)
    _drop_cached_groups()
    new_optimizer = optimizer_class(groups) if optimizer_class is not None else None
    new, _optimizer, _loader, _scheduler = deepspeed.initialize(
        model=module, optimizer=new_optimizer, model_parameters=None if new_optimizer is not None else groups,
        lr_scheduler=scheduler, config=config)
    if scheduler is not None and hasattr(scheduler, "optimizer"):
        scheduler.optimizer = new.optimizer
    return new
