"""A rebuild's random initialisation, skipped where the transfer overwrites it.

After an in-place change the survivors call the user's `build()` for the new group, then the
shard transfer copies the agreed step's values into every parameter and buffer of the model it
returned (`reshard_state.install`, which refuses a model with a parameter or buffer the
transfer does not bring). The random fills `build()` makes on those tensors (`normal_`,
`uniform_`, the `nn.init` functions) are work thrown away at the worst moment: every rank of the
job waits for them.

Contract: `skipping_random_init(build)` returns `build()`'s result, built once (it is collective
on the new group). While it runs, the storages of the parameters and buffers its modules
register or materialise (`Module.to_empty`) are known as state; an in-place random fill on a
known storage is skipped (the tensor keeps the memory it held), and so is `nn.init`'s in-place
arithmetic on a storage whose fill was skipped. A fill on anything else (a temporary such as
`trunc_normal_` draws into, a tensor the build keeps for itself) runs as written. Afterwards
a skipped storage still alive that is not a parameter or buffer of the returned model (a
module's tensor the build kept elsewhere) raises `ReshardError`, so the change takes the restart
path rather than train on unwritten memory.
The CPU generator does not advance for the fills skipped (the transfer brings the state, not
the draws).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode

from spotguard.hooks.elastic.reshard_plan import ReshardError

_aten = torch.ops.aten
RANDOM_FILLS = frozenset({
    _aten.normal_.default, _aten.uniform_.default, _aten.bernoulli_.float, _aten.random_.default,
    getattr(_aten.random_, "from"), _aten.random_.to, _aten.exponential_.default, _aten.geometric_.default,
    _aten.log_normal_.default, _aten.cauchy_.default,
})
# What nn.init does in place after a fill (trunc_normal_'s erfinv_/mul_/add_/clamp_, scaling):
# after a skipped fill on the same storage, its only effect is on memory the transfer overwrites.
FOLLOW_UPS = frozenset({
    _aten.erfinv_.default, _aten.mul_.Scalar, _aten.mul_.Tensor, _aten.add_.Scalar, _aten.add_.Tensor,
    _aten.sub_.Scalar, _aten.sub_.Tensor, _aten.div_.Scalar, _aten.div_.Tensor, _aten.clamp_.default,
    _aten.clamp_.Tensor, _aten.fmod_.Scalar, _aten.abs_.default, _aten.neg_.default, _aten.sign_.default,
})
SKIPPABLE = RANDOM_FILLS | FOLLOW_UPS


def _untyped(tensor: torch.Tensor) -> torch.UntypedStorage:
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard's storage
    return (local if isinstance(local, torch.Tensor) else tensor).untyped_storage()


class _SkipFills(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.state: dict[int, StorageWeakRef] = {}  # weak: a storage the build drops is freed
        self.skipped: set[int] = set()

    def know(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = _untyped(tensor)
                self.state[int(storage.data_ptr())] = StorageWeakRef(storage)

    def known(self, tensor: torch.Tensor) -> int | None:
        """The storage's address when it is one of the known state storages (alive, the same one)."""
        storage = _untyped(tensor)
        pointer = int(storage.data_ptr())
        ref = self.state.get(pointer)
        if ref is None or ref.expired() or ref.cdata != StorageWeakRef(storage).cdata:
            return None
        return pointer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if func in SKIPPABLE and isinstance(target, torch.Tensor) and not target.is_meta:
            pointer = self.known(target)
            if pointer is not None and (func in RANDOM_FILLS or pointer in self.skipped):
                self.skipped.add(pointer)
                return target
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _learning_state(mode: _SkipFills) -> Iterator[None]:
    """The storages of parameters and buffers registered (eager modules) or materialised
    (`to_empty` after the meta device, as FSDP2 builds do) while the build runs, as state."""
    handles = [nn_module.register_module_parameter_registration_hook(lambda m, n, p: mode.know([p])),
               nn_module.register_module_buffer_registration_hook(lambda m, n, b: mode.know([b]))]
    to_empty = torch.nn.Module.to_empty

    def materialising(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        result = to_empty(self, *args, **kwargs)
        mode.know([*self.parameters(), *self.buffers()])
        return result

    torch.nn.Module.to_empty = materialising  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.to_empty = to_empty  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def _state_storages(result: Any) -> set[int]:
    models = result if isinstance(result, tuple) else (result,)
    return {int(_untyped(t).data_ptr()) for model in models if isinstance(model, torch.nn.Module)
            for t in (*model.parameters(), *model.buffers()) if not t.is_meta}


def skipping_random_init(build: Callable[[], Any]) -> Any:
    """See the module docstring."""
    mode = _SkipFills()
    with _learning_state(mode), mode:
        result = build()
    kept = _state_storages(result)
    stray = [p for p in mode.skipped - kept if not mode.state[p].expired()]
    if stray:
        raise ReshardError(f"build() keeps {len(stray)} tensor(s) of its modules outside the model it returns, "
                           "initialised at random (skipped: the transfer writes only the model's): the change "
                           "falls back")
    return result
