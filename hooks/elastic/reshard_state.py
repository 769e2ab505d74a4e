"""A torch model and optimizer as the reshard sees them: a manifest (names, global shapes, dtypes,
layouts, and the optimizer's non-tensor state, as JSON-able data) plus this rank's local pieces,
and back.

Contract:
- `collect(model, optimizer, world)` -> `Shards`: every parameter (`model/<name>`), buffer
  (`buffer/<name>`) and tensor of the optimizer's per-parameter state (`optim/<param>/<key>`:
  Adam's moments, sharded like their parameter, and its `step`, a replicated scalar), in one
  order on every rank (the model's order). A DTensor contributes its local piece (a view, no
  copy) and its mesh and placements as data; a plain tensor is a replica. Nothing is copied or
  communicated. A mesh that is not the whole group in rank order is recorded as a placement the
  plan refuses.
- `specs(manifest)`: the plan's `TensorSpec`s; `local_shape(entry, rows)`: the local shape of
  `rows` rows of an entry.
- `install(model, optimizer, manifest, pieces)`: copies `pieces` (entry index -> this rank's new
  local piece) into the parameters and buffers of a freshly built model (dropping each piece once
  copied), and makes the rest the optimizer's state (the pieces themselves, no copy; DTensors on
  their parameter's mesh), with the optimizer's non-tensor state and hyperparameters from the
  manifest. Raises `ReshardError` naming the tensor when the rebuilt model's piece has another
  shape than the plan's or when the rebuilt model has a parameter or buffer the manifest lacks
  (checked before any piece is taken), or `ValueError` naming the field when the optimizer holds
  state that is not JSON-able.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from spotguard.hooks.elastic.reshard_plan import Layout, ReshardError, TensorSpec


@dataclass
class Shards:
    manifest: dict[str, Any]  # {"entries": [...], "optim_values": {...}, "param_groups": [...]}
    pieces: list[torch.Tensor]  # this rank's local piece of every entry, in entry order

    @property
    def device(self) -> torch.device:
        return self.pieces[0].device if self.pieces else torch.device("cpu")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ReshardError(f"unknown dtype {name!r} in the reshard manifest")
    return dtype


def _entry(name: str, value: torch.Tensor, world: int) -> tuple[dict[str, Any], torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        placements = [repr(p) for p in value.placements]
        if mesh.mesh.flatten().tolist() != list(range(world)):
            placements = [f"{p} over ranks {mesh.mesh.flatten().tolist()}" for p in placements]
        layout: dict[str, Any] = {"mesh": list(mesh.shape), "placements": placements}
        piece = value.to_local().detach()
    else:
        layout = {"mesh": [world], "placements": [str(Layout.replicated(world).placements[0])]}
        piece = value.detach()
    return ({"name": name, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
             "dtensor": isinstance(value, DTensor), **layout}, piece)


def jsonable(field: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: {type(value).__name__} {value!r} cannot travel in the reshard manifest "
                         "(JSON values only)") from None
    return value


def _canonical(name: str) -> str:
    """A parameter's name without DDP's `module.` wrapper: a model may be wrapped at one world size
    and not at another (the same rule as torch's state-dict FQNs)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _named_parameters(model: torch.nn.Module) -> dict[str, Any]:
    return {_canonical(n): p for n, p in model.named_parameters()}


def _named_buffers(model: torch.nn.Module) -> dict[str, Any]:
    return {_canonical(n): b for n, b in model.named_buffers()}


def collect(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int) -> Shards:
    entries, pieces = [], []

    def add(name: str, value: torch.Tensor) -> None:
        entry, piece = _entry(name, value, world)
        entries.append(entry)
        pieces.append(piece)

    params = _named_parameters(model)
    for name, param in params.items():
        add(f"model/{name}", param)
    for name, buffer in _named_buffers(model).items():
        add(f"buffer/{name}", buffer)
    optim_values: dict[str, dict[str, Any]] = {}
    for name, param in params.items():
        for key, value in (optimizer.state.get(param) or {}).items():
            if isinstance(value, torch.Tensor):
                add(f"optim/{name}/{key}", value)
            else:
                optim_values.setdefault(name, {})[key] = jsonable(f"optimizer state {name}/{key}", value)
    groups = [{k: jsonable(f"param_groups[{i}].{k}", v) for k, v in group.items() if k != "params"}
              for i, group in enumerate(optimizer.param_groups)]
    return Shards({"entries": entries, "optim_values": optim_values, "param_groups": groups}, pieces)


def specs(manifest: dict[str, Any]) -> list[TensorSpec]:
    out = []
    for entry in manifest["entries"]:
        shape = entry["shape"]
        item = torch.empty((), dtype=_dtype(entry["dtype"])).element_size()
        out.append(TensorSpec(entry["name"], shape[0] if shape else 1, math.prod(shape[1:]) * item,
                              Layout(tuple(entry["mesh"]), tuple(entry["placements"]))))
    return out


def local_shape(entry: dict[str, Any], rows: int) -> list[int]:
    shape = entry["shape"]
    return [rows, *shape[1:]] if shape else []


def empty_piece(entry: dict[str, Any], rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(local_shape(entry, rows), dtype=_dtype(entry["dtype"]), device=device)


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def install(model: torch.nn.Module, optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
            pieces: dict[int, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor

    params = _named_parameters(model)
    live = {f"model/{n}": p for n, p in params.items()} | {f"buffer/{n}": b for n, b in _named_buffers(model).items()}
    unwritten = sorted(set(live) - {entry["name"] for entry in manifest["entries"]})
    if unwritten:  # the rebuild skipped their initialisation (overwritten_init): never trained on as they are
        raise ReshardError(f"the rebuilt model holds {', '.join(unwritten)[:300]}, which the old group did not hold")
    state: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for index, entry in enumerate(manifest["entries"]):
            name = entry["name"]
            piece = pieces.pop(index)
            if name in live:
                target = _local(live[name])
                if list(target.shape) != list(piece.shape):
                    raise ReshardError(f"tensor {name!r}: the rebuilt model holds a piece of shape "
                                       f"{list(target.shape)}, the plan one of {list(piece.shape)}")
                target.copy_(piece)
                continue
            kind, _, rest = name.partition("/")
            pname, _, key = rest.rpartition("/")
            if kind != "optim" or pname not in params:
                raise ReshardError(f"tensor {name!r} has no counterpart in the rebuilt model and optimizer")
            param = params[pname]
            value: torch.Tensor = piece
            if entry["dtensor"]:
                if not isinstance(param, DTensor):
                    raise ReshardError(f"tensor {name!r} is a DTensor but its parameter is not")
                value = DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False,
                                           shape=torch.Size(entry["shape"]), stride=param.stride())
            state.setdefault(pname, {})[key] = value
        del piece
    for pname, values in manifest["optim_values"].items():
        state.setdefault(pname, {}).update(values)
    for pname, values in state.items():
        optimizer.state[params[pname]] = values
    for group, saved in zip(optimizer.param_groups, manifest["param_groups"]):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
