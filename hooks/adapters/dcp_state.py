"""`get_state_dict(model, optimizer)` for every snapshot, without its per-call name mapping.

torch's `get_state_dict` works out every parameter's fully qualified name (FQN) on every call: a
walk of the module tree per state entry, in Python. For 400 parameter tensors that is ~20 ms a
call against ~1.4 ms for `model.state_dict()` and `optimizer.state_dict()`; a snapshot pays it
on the training loop every `snapshot_every` steps.

Contract: `StateCapture(model, optimizer).capture()` returns what
`get_state_dict(model, optimizer)` returns (default options): {"model": {fqn: tensor},
"optim": {"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}}, the same keys
and the same tensors (views of the live parameters, buffers and optimizer state, not copies).
The first call, and any call after the structure changed, is `get_state_dict` itself; from it
the capture learns the renaming (state_dict key -> FQN, optimizer index -> FQN) and the calls
after it rename `model.state_dict()` and `optimizer.state_dict()` with what it learnt. The
structure is checked on every call: the model's state_dict keys, the optimizer's state indices
and the length of each param group; a change goes back to `get_state_dict` and learns again.
Models it never renames (always `get_state_dict`): DTensor state (FSDP2, tensor parallel),
FSDP1, entries that share storage (tied weights) and non-tensor model entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class _Renaming:
    model_keys: tuple[str, ...]  # model.state_dict()'s keys when it was learnt
    model_fqns: tuple[str, ...]  # the FQNs in get_state_dict's order
    model_sources: tuple[int, ...]  # the position of each one's entry in model.state_dict()
    state_ids: frozenset[int]  # optimizer.state_dict()["state"]'s indices
    group_sizes: tuple[int, ...]  # len(params) of each param group
    param_fqns: dict[int, str]  # optimizer index -> FQN
    model_in_order: bool  # model_sources is 0, 1, 2, ...: the renamed dict keeps model.state_dict()'s order


class StateCapture:
    """See the module docstring. One per (model, optimizer) pair."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._renaming: _Renaming | None = None
        self._renamable = True  # False: this model is one `get_state_dict` always serves

    def serves(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        return model is self.model and optimizer is self.optimizer

    def capture(self) -> dict[str, Any]:
        renaming = self._renaming
        if renaming is not None:
            model_state = self.model.state_dict()
            optim_state = self.optimizer.state_dict()
            if self._unchanged(renaming, model_state, optim_state):
                return _renamed(renaming, model_state, optim_state)
            self._renaming = None
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        if self._renamable:
            self._renaming = self._learn(model_state, optim_state)
            self._renamable = self._renaming is not None
        return {"model": model_state, "optim": optim_state}

    @staticmethod
    def _unchanged(renaming: _Renaming, model_state: dict, optim_state: dict) -> bool:
        return (tuple(model_state) == renaming.model_keys
                and optim_state["state"].keys() == renaming.state_ids
                and tuple(len(g["params"]) for g in optim_state["param_groups"]) == renaming.group_sizes)

    def _learn(self, fqn_model: dict[str, Any], fqn_optim: dict[str, Any]) -> _Renaming | None:
        """The renaming that turns this pair's own state_dicts into `fqn_model` / `fqn_optim`
        (which `get_state_dict` just returned), or None when this model needs `get_state_dict`."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        if FullyShardedDataParallel.fsdp_modules(self.model):
            return None
        if any(isinstance(leaf, DTensor) for leaf in tree_leaves([fqn_model, fqn_optim])):
            return None
        model_state = self.model.state_dict()
        by_view: dict[tuple, str] = {}
        for fqn, value in fqn_model.items():
            if not isinstance(value, torch.Tensor) or value.numel() == 0:
                return None
            view = _view_of(value)
            if view in by_view:  # shared storage: tied weights
                return None
            by_view[view] = fqn
        if len(model_state) != len(fqn_model):
            return None
        position: dict[str, int] = {}
        for index, value in enumerate(model_state.values()):
            source = by_view.get(_view_of(value)) if isinstance(value, torch.Tensor) else None
            if source is None:
                return None
            position[source] = index
        if len(position) != len(fqn_model):
            return None
        optim_state = self.optimizer.state_dict()
        groups, fqn_groups = optim_state["param_groups"], fqn_optim["param_groups"]
        if len(groups) != len(fqn_groups) or any(len(g["params"]) != len(f["params"])
                                                 for g, f in zip(groups, fqn_groups)):
            return None
        param_fqns = {index: fqn for g, f in zip(groups, fqn_groups) for index, fqn in zip(g["params"], f["params"])}
        if {param_fqns.get(i) for i in optim_state["state"]} != set(fqn_optim["state"]):
            return None
        sources = tuple(position[fqn] for fqn in fqn_model)
        return _Renaming(tuple(model_state), tuple(fqn_model), sources, frozenset(optim_state["state"]),
                         tuple(len(g["params"]) for g in groups), param_fqns, sources == tuple(range(len(sources))))


def _renamed(renaming: _Renaming, model_state: dict, optim_state: dict) -> dict[str, Any]:
    fqns = renaming.param_fqns
    if renaming.model_in_order:
        model = type(model_state)(zip(renaming.model_fqns, model_state.values()))
    else:
        values = list(model_state.values())
        model = type(model_state)((fqn, values[i]) for fqn, i in zip(renaming.model_fqns, renaming.model_sources))
    if hasattr(model_state, "_metadata"):
        model._metadata = model_state._metadata  # type: ignore[attr-defined]
    return {"model": model,
            "optim": {"state": {fqns[i]: v for i, v in optim_state["state"].items()},
                      "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]}
                                       for g in optim_state["param_groups"]]}}


def _view_of(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())

