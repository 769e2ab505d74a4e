"""Snapshot buffers: host memory for one copy of a state's tensors, allocated once and reused.

Contract: `SnapshotBuffers.copy_in(state)` returns `state`'s tree (dicts, lists, tuples) with
every tensor leaf replaced by its buffer holding a copy of it; every other leaf is kept by
reference (numbers and strings, which cannot change; an object the training mutates in place
would be written as it is at persist time). A state dict's `_metadata` (module versions) is kept.
Each tensor gets a dense buffer of its own storage (so `torch.save` and DCP write exactly its
bytes, never a shared arena), allocated and touched once: a snapshot allocates nothing while
the layout stays the same. A DTensor's local shard is copied and the buffer is a DTensor of the
same spec over it, so a sharded writer (DCP) sees the same layout.
- The buffers are planned from the first state; when the tensors' layout changes (names, dtypes,
  shapes, placements: optimizer state appears, a resize re-shards the model), the next copy
  re-plans and re-allocates, with a warning. `check_host_memory` runs before every allocation:
  a state that cannot fit fails with InsufficientHostMemory (a ConfigError) naming the sizes.
- When any tensor is on a GPU the buffers are pinned host memory and the copies run on a side
  stream: `copy_in` returns once they are queued, the training stream waits for them before
  its next kernel (so the state cannot change under the copy), and `ready()` blocks the reader
  (the writer) until the bytes are on the host. On CPU `copy_in` is the copy itself.
  `gpu_copy_seconds()` is how long the last GPU copy ran on the device (CUDA events): the time
  the training stream waits for a snapshot, which the host-side time of `copy_in` does not show.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .memory import check_host_memory

log = logging.getLogger(__name__)


def _local(leaf: torch.Tensor) -> torch.Tensor:
    return getattr(leaf, "_local_tensor", leaf)


def _leaf_layout(leaf: Any) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return None
    local = _local(leaf)
    return (type(leaf), leaf.dtype, tuple(leaf.shape), tuple(local.shape), str(getattr(leaf, "placements", None)))


class SnapshotBuffers:
    """Host buffers for a state's tensors; see the module docstring."""

    def __init__(self, *, check_memory: bool = True, what: str = "snapshot buffers of the training state"):
        self.check_memory = check_memory
        self.what = what
        self._layout: tuple | None = None
        self._nbytes = 0
        self._buffers: list[Any] = []  # per leaf: the buffer (tensor leaves) or None
        self._pinned = False
        self._stream: Any = None
        self._copied: Any = None  # the CUDA event of the last copy (GPU only)
        self._copy_started: Any = None  # the CUDA event recorded before it
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (0 before the first copy)."""
        return self._nbytes

    @property
    def pinned(self) -> bool:
        return self._pinned

    def release(self) -> None:
        """Drops the buffers (the next copy allocates again)."""
        self.ready()
        self._layout, self._buffers, self._nbytes = None, [], 0

    def _allocate(self, leaves: list[Any], layout: tuple) -> None:
        locals_ = [_local(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        total = sum(t.numel() * t.element_size() for t in locals_ if t is not None)
        if self.check_memory:
            check_host_memory(total, what=self.what)
        on_gpu = any(t is not None and t.is_cuda for t in locals_)
        self.release()
        buffers: list[Any] = []
        for leaf, local in zip(leaves, locals_):
            if local is None:
                buffers.append(None)
                continue
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=on_gpu and local.numel() > 0)
            buffer.zero_()  # fault every page in now, not during a snapshot
            if local is not leaf:  # a DTensor: the same spec over a host shard
                buffer = type(leaf)(buffer, leaf._spec, requires_grad=False)
            buffers.append(buffer)
        self._buffers, self._layout, self._pinned, self._nbytes = buffers, layout, on_gpu, total
        if on_gpu and self._stream is None:
            self._stream = torch.cuda.Stream()
        self.allocations += 1
        log.info("snapshot buffers allocated: %.1f MB in %d tensors%s", total / 1e6,
                 sum(b is not None for b in buffers), " (pinned)" if on_gpu else "")

    def copy_in(self, state: Any) -> Any:
        """`state` with every tensor replaced by its buffer, holding a copy of it (see the module docstring)."""
        leaves, spec = tree_flatten(state, is_leaf=_kept_whole)
        layout = (spec, tuple(_leaf_layout(leaf) for leaf in leaves))
        if layout != self._layout:
            if self._layout is not None:
                log.warning("the training state's layout changed: re-allocating the snapshot buffers")
            self._allocate(leaves, layout)
        self.ready()  # a copy still in flight must land before the buffers are overwritten
        pairs = [(_local(b), _local(leaf).detach()) for b, leaf in zip(self._buffers, leaves) if b is not None]
        if self._pinned:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
            self._copy_started = torch.cuda.Event(enable_timing=True)
            self._copy_started.record(stream)
            with torch.cuda.stream(stream):
                for buffer, source in pairs:
                    buffer.copy_(source, non_blocking=True)
            self._copied = torch.cuda.Event(enable_timing=True)
            self._copied.record(stream)
            torch.cuda.current_stream().wait_event(self._copied)
        else:
            for buffer, source in pairs:
                buffer.copy_(source)
        copied = tree_unflatten([b if b is not None else leaf for b, leaf in zip(self._buffers, leaves)], spec)
        _carry_metadata(state, copied)
        return copied

    def ready(self) -> None:
        """Returns once the last copy's bytes are in the buffers (at once on CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def gpu_copy_seconds(self) -> float | None:
        """Seconds the last copy ran on the GPU (waits for it); None on CPU or before a copy."""
        if self._copied is None or self._copy_started is None:
            return None
        self._copied.synchronize()
        return self._copy_started.elapsed_time(self._copied) / 1000.0


def _kept_whole(node: Any) -> bool:
    """Values kept as they are instead of being taken apart (a torch.Size would come back a tuple)."""
    return isinstance(node, torch.Size)


def _carry_metadata(source: Any, copy: Any) -> None:
    """Puts each state dict's `_metadata` (module versions, read by `load_state_dict`) on its copy."""
    if isinstance(source, dict) and isinstance(copy, dict):
        if hasattr(source, "_metadata"):
            copy._metadata = source._metadata  # type: ignore[attr-defined]
        for key, value in source.items():
            if isinstance(value, (dict, list, tuple)) and key in copy:
                _carry_metadata(value, copy[key])
    elif isinstance(source, (list, tuple)) and isinstance(copy, (list, tuple)):
        for a, b in zip(source, copy):
            _carry_metadata(a, b)
