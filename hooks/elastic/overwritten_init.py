"""A rebuild's random initialisation, skipped where the transfer overwrites it.

After an in-place change the survivors call the user's `build()` for the new group, then the
shard transfer copies the agreed step's values into every parameter and buffer of the model it
returned (`reshard_state.install`). The random fills `build()` makes on those tensors
(`normal_`, `uniform_`, `nn.init.trunc_normal_`'s arithmetic that follows its `uniform_`, ...)
are work thrown away at the worst moment: every rank of the job waits for them.

Contract: `skipping_random_init(build)` returns `build()`'s result, made with every in-place
random fill on a tensor that is not on the meta device skipped (the tensor keeps whatever memory
it held), and the in-place pointwise arithmetic `nn.init` applies after such a fill skipped on
the same storage. Afterwards every skipped storage still alive must belong to a parameter or
buffer of the returned model (the tensors the transfer overwrites; a temporary, as
`trunc_normal_` draws into, is freed by then): when one does not (a random tensor the build
kept elsewhere), the result is dropped, one warning says so, and `build()` runs again as
written, as it will in this process from then on. The CPU generator does not advance for the
fills skipped (the transfer brings the state, not the draws).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("spotguard.hooks.elastic")

_aten = torch.ops.aten
RANDOM_FILLS = frozenset({
    _aten.normal_.default, _aten.uniform_.default, _aten.bernoulli_.float, _aten.random_.default,
    getattr(_aten.random_, "from"), _aten.random_.to, _aten.exponential_.default, _aten.geometric_.default,
    _aten.log_normal_.default, _aten.cauchy_.default,
})
# What nn.init does in place after a fill (trunc_normal_: erfinv_, mul_, add_, clamp_; others
# scale): skipped only on a storage whose fill was skipped, and only with no other tensor input.
FOLLOW_UPS = frozenset({
    _aten.erfinv_.default, _aten.mul_.Scalar, _aten.add_.Scalar, _aten.sub_.Scalar, _aten.div_.Scalar,
    _aten.clamp_.default, _aten.fmod_.Scalar, _aten.abs_.default, _aten.neg_.default, _aten.sign_.default,
})

_disabled = False  # a build that kept a skipped tensor: never skip again in this process


def _untyped(tensor: torch.Tensor) -> torch.UntypedStorage:
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard's storage
    return (local if isinstance(local, torch.Tensor) else tensor).untyped_storage()


def _storage(tensor: torch.Tensor) -> int:
    return int(_untyped(tensor).data_ptr())


class _SkipFills(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[int, StorageWeakRef] = {}  # no strong reference: a temporary's storage is freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and not target.is_meta:
            if func in RANDOM_FILLS:
                storage = _untyped(target)
                self.skipped[int(storage.data_ptr())] = StorageWeakRef(storage)
                return target
            if func in FOLLOW_UPS and _storage(target) in self.skipped and \
                    not any(isinstance(a, torch.Tensor) for a in (*args[1:], *(kwargs or {}).values())):
                return target
        return func(*args, **(kwargs or {}))


def _state_storages(result: Any) -> set[int]:
    models: Iterable[Any] = result if isinstance(result, tuple) else (result,)
    storages: set[int] = set()
    for model in models:
        if isinstance(model, torch.nn.Module):
            storages.update(_storage(t) for t in (*model.parameters(), *model.buffers()))
    return storages


def skipping_random_init(build: Callable[[], Any]) -> Any:
    """See the module docstring."""
    global _disabled
    if _disabled:
        return build()
    mode = _SkipFills()
    with mode:
        result = build()
    state = _state_storages(result)
    stray = [p for p, ref in mode.skipped.items() if p not in state and not ref.expired()]
    if not stray:
        return result
    _disabled = True
    log.warning("build() filled %d tensor(s) at random that are not the model's parameters or buffers: built "
                "again with its initialisation, as it will be at every change of this process", len(stray))
    del result
    return build()
