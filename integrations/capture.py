"""A framework's own checkpoint files, captured at the step boundary and written later from the
snapshot engine's buffers.

    with captured_saves(root) as captured:       # at the step boundary
        trainer._save_checkpoint(...)            # the framework's own save, aimed at `root`
    state = captured.state()                     # -> the engine copies its tensors
    write_captured(pending, state, root)         # later, on the engine's writer thread

Contract:
- Inside `captured_saves(root)`, a `torch.save(obj, path)` or a safetensors `save_file(tensors,
  path, metadata=...)` whose `path` lies under `root` writes nothing: it is recorded as
  (path relative to `root`, format, the object by reference, safetensors metadata). Every
  other call goes to the real function (another directory, a stream), and so does everything on
  other threads that is not aimed at `root`. The names patched are `torch.save`,
  `safetensors.torch.save_file` and the aliases the frameworks bind at import
  (`CAPTURED_ALIASES`); they are restored when the block ends, also on an error. What the
  framework writes by other means (its JSON state, DeepSpeed's `latest`) lands under `root` as
  files: small ones, left for `write_captured` to move.
- `captured.state()` is the tree the engine copies: {"objects": {relpath: obj}, "formats":
  {relpath: [format, metadata]}}; the engine swaps the objects' tensors for its buffers.
- `write_captured(pending, state, root)` makes them this rank's files of a pending checkpoint,
  at the same paths relative to `root`: each file the framework wrote under `root`
  is renamed into the pending directory and fsynced; each recorded object is written in the
  framework's format (`torch.save` through `save_torch_file_spread`: laid out without a copy, written
  while its CRC-32 is computed beside the writer, written back behind; safetensors
  through `safetensors.torch.save_file`, then checksummed and fsynced), all files at once. It
  returns once every file is durable and recorded; on an error it waits for the other writers,
  then raises the first error.
- `loose_bytes(root)`: bytes of the files lying under `root` (the integrations warn when a
  framework wrote a large file there directly: a save path this capture does not know).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from spotguard.hooks.checkpoint.types import PendingCheckpoint
from spotguard.hooks.checkpoint.torchfile import save_torch_file_spread

TORCH, SAFETENSORS = "torch", "safetensors"
# module -> attribute bound at import to safetensors.torch.save_file (the frameworks call it by that name)
CAPTURED_ALIASES = (("accelerate.utils.other", "safe_save_file"), ("transformers.modeling_utils", "safe_save_file"))

_writers = ThreadPoolExecutor(8, thread_name_prefix="spotguard-framework-file")
_patching = threading.Lock()  # one capture at a time in a process: the patched names are process-wide


class Captured:
    """What one `captured_saves` block recorded (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.objects: dict[str, Any] = {}
        self.formats: dict[str, list[Any]] = {}

    def relpath(self, target: Any) -> str | None:
        """`target`'s path relative to the root, or None when it is not a path under it."""
        if not isinstance(target, (str, os.PathLike)):
            return None
        path = Path(os.path.abspath(target))
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else None

    def record(self, relpath: str, fmt: str, obj: Any, metadata: dict[str, str] | None = None) -> None:
        self.objects[relpath] = obj
        self.formats[relpath] = [fmt, dict(metadata) if metadata else None]

    def state(self) -> dict[str, Any]:
        return {"objects": self.objects, "formats": self.formats}


@contextlib.contextmanager
def captured_saves(root: str | os.PathLike) -> Iterator[Captured]:
    """Records the framework's saves aimed under `root` instead of writing them (module docstring)."""
    import safetensors.torch

    captured = Captured(Path(os.path.abspath(root)))
    real_torch_save = torch.save
    real_save_file = safetensors.torch.save_file

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        relpath = captured.relpath(f)
        if relpath is None:
            return real_torch_save(obj, f, *args, **kwargs)
        captured.record(relpath, TORCH, obj)
        return None

    def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None) -> None:
        relpath = captured.relpath(filename)
        if relpath is None:
            return real_save_file(tensors, filename, metadata=metadata)
        captured.record(relpath, SAFETENSORS, tensors, metadata)
        return None

    patches: list[tuple[Any, str, Any, Any]] = [(torch, "save", real_torch_save, torch_save),
                                                (safetensors.torch, "save_file", real_save_file, save_file)]
    for module_name, name in CAPTURED_ALIASES:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is real_save_file:
            patches.append((module, name, real_save_file, save_file))
    with _patching:
        for module, name, _real, replacement in patches:
            setattr(module, name, replacement)
        try:
            yield captured
        finally:
            for module, name, real, _replacement in patches:
                setattr(module, name, real)


def _moved_file(pending: PendingCheckpoint, source: Path, relpath: str) -> int:
    os.replace(source, pending.path(relpath))
    return pending.adopt(relpath)


def _safetensors_file(pending: PendingCheckpoint, relpath: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None) -> int:
    import safetensors.torch

    safetensors.torch.save_file(tensors, pending.path(relpath), metadata=metadata)
    return pending.adopt(relpath)


def write_captured(pending: PendingCheckpoint, state: dict[str, Any], root: str | os.PathLike) -> int:
    """This rank's files of the checkpoint, from the copied `state` and the files under `root`;
    returns the bytes written (module docstring)."""
    root = Path(root)
    jobs: list[Callable[[], int]] = []
    if root.is_dir():
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relpath = path.relative_to(root).as_posix()
            jobs.append(lambda path=path, relpath=relpath: _moved_file(pending, path, relpath))
    for relpath, obj in state["objects"].items():
        fmt, metadata = state["formats"][relpath]
        if fmt == SAFETENSORS:
            jobs.append(lambda relpath=relpath, obj=obj, metadata=metadata:
                        _safetensors_file(pending, relpath, obj, metadata))
        else:
            jobs.append(lambda relpath=relpath, obj=obj: save_torch_file_spread(pending, relpath, obj))
    futures = [_writers.submit(job) for job in jobs]
    wait(futures)
    return sum(future.result() for future in futures)


def loose_bytes(scratch: str | os.PathLike) -> int:
    """Bytes of the files under `scratch` (0 when it does not exist)."""
    scratch = Path(scratch)
    return sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()) if scratch.is_dir() else 0


def clear(scratch: str | os.PathLike) -> None:
    """Removes `scratch` and everything in it (nothing there is part of a checkpoint yet)."""
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)

