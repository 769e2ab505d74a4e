"""What the framework integrations share: an adapter on the one snapshot engine whose checkpoint is
the framework's own format, and the Guard they drive.

`FrameworkAdapter` is a `StoreAdapter` (hooks/adapters/base.py) on the snapshot engine
(hooks/checkpoint/engine.py), as the DDP/FSDP2, DeepSpeed and plain-torch adapters are:
- at the step boundary (the stall) `_state(step)` runs the framework's own save call
  (`_framework_save`) aimed at this rank's scratch directory `<checkpoint_dir>/.spotguard-boundary-<rank>`
  with its heavy writes captured (capture.py: `torch.save` and safetensors' `save_file` record the
  object instead of writing it), and the engine copies the captured objects' tensors into its
  buffers (allocated once: `prepare()`, which the Guard calls at the first step boundary of a
  run, before any notice);
- in the background the engine persists that copy through the store's complete-or-invisible
  commit (begin, this rank's files written in the framework's format by `write_captured`,
  finish_rank, every rank agrees, rank 0 commits), named `_tag(step, reason)`; `_after_commit`
  (rank 0) may then make it visible under the name the framework resumes from. Any failure
  raises `CheckpointFailed` on every rank, so the Guard drains with exit 84 and the previous
  checkpoint stays the newest.
- The engine measures each part (`save_parts()`: snapshot, persist), and the deadline logic
  prices a save from them (`estimate_save_seconds`).
The framework's format is kept byte for byte where it matters (the same objects through the same
serializers), so the framework's own resume call reads the checkpoint, as do its tools.

`find_in_loader(loader, kind)` finds a sampler inside the wrappers a framework puts around a
loader (the integrations check that the loader draws from the `ElasticSampler` they were given).

`warn_stateless_stream(loader, integration)`: a warning at start when a loader (or a dataset) streams an
`IterableDataset` that neither it nor the dataset can save a position of (no `state_dict`): a
resume then starts the stream again or skips batches of it, never exact at another world size.

`guard_for(adapter, ...)` makes the Guard every integration uses: configured from SPOTGUARD_*
(sidecar, grace, agree_every), the restart path (`in_place_guard_for`: the same Guard changing
membership in place, for an integration whose adapter is resizable: Accelerate's, opted in).
SIGTERM is a notice, as with the plain Guard. In-memory snapshots are opt-in (`snapshot_every=N`,
the same on every rank, among the integration's guard options; default 0: none, a notice saves
fresh, snapshot then persist): the Guard then captures the framework's own save into the engine's
buffers (`_state`) every N steps at the step boundary, every rank at the same steps, and the
adapter's `takes_snapshots` is True, so that
- a notice whose deadline falls inside an evaluation pass or a long step is answered by the deadline
  watchdog, which persists that held snapshot (the framework's own files, committed under the
  framework's name: its resume reads it) and leaves with 83 before the deadline, instead of 84;
- at an agreed step the save decision may persist the held snapshot when a fresh save does not fit
  before the deadline (`hooks/machine/checkpoint.py`; without snapshots it always saves fresh).
Each snapshot is a full framework save into memory on the main thread (its cost: docs/integrations.md);
the collectives that save makes (the Trainer's flos all_gather, Lightning's barrier, DeepSpeed's and
FSDP's own) run on every rank at the same boundary, as the notice's save does.

`FrameworkAdapter.moved_to_new_group()`: after an in-place change (its `rebuild`), the adapter's
commit collectives, scratch directory (named by rank) and buffers follow the new formation.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, TypeVar

from spotguard.config import positive_int
from spotguard.hooks import Guard
from spotguard.hooks.adapters.base import StoreAdapter
from spotguard.hooks.adapters.store import CheckpointInfo
from spotguard.integrations import capture
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.integrations")
T = TypeVar("T")

SCRATCH_PREFIX = ".spotguard-boundary-"  # <checkpoint_dir>/.spotguard-boundary-<rank>: invisible to every framework
LOOSE_WARNING_BYTES = 16 << 20  # a framework that wrote this much past the capture: a save path it does not know


def find_in_loader(loader: Any, kind: type[T], depth: int = 5) -> T | None:
    """The first `kind` object among a loader's samplers: the loader itself, its `batch_sampler`,
    `sampler`, and theirs, as the frameworks wrap them (Accelerate's BatchSamplerShard around a
    BatchSampler around the sampler; Lightning's CombinedLoader's `iterables`), `depth` levels down."""
    if isinstance(loader, kind):
        return loader
    if depth == 0 or loader is None:
        return None
    for name in ("batch_sampler", "sampler", "iterables"):
        found = find_in_loader(getattr(loader, name, None), kind, depth - 1)
        if found is not None:
            return found
    return None


def warn_stateless_stream(loader: Any, integration: str) -> bool:
    """See the module docstring; True when it warned."""
    from torch.utils.data import IterableDataset

    loaders = getattr(loader, "flattened", None) or [loader]  # Lightning's CombinedLoader holds several
    for one in loaders:
        one = getattr(one, "base_dataloader", one)  # Accelerate's prepared loader: a state_dict of its own, always
        dataset = one if isinstance(one, IterableDataset) else getattr(one, "dataset", None)
        if isinstance(dataset, IterableDataset) and not hasattr(one, "state_dict") \
                and not hasattr(dataset, "state_dict"):
            log.warning("%s: the train loader streams an IterableDataset (%s) without a state_dict, so no checkpoint "
                        "holds its position: a resume starts the stream again or skips batches of it, at another "
                        "world size in another order. Give it a state_dict kept in the checkpoint (torchdata's "
                        "StatefulDataLoader), or index it and deal it with spotguard.data.ElasticSampler "
                        "(docs/in-place.md, 'The data')", integration, type(dataset).__name__)
            return True
    return False


def guard_for(adapter: FrameworkAdapter, **guard_options: Any) -> Guard:
    """The Guard of an integration (every rank, same order): see the module docstring."""
    return _guard(adapter, False, guard_options)


def in_place_guard_for(adapter: FrameworkAdapter, **guard_options: Any) -> Guard:
    """`guard_for` for an integration that changes membership in place (its adapter resizable)."""
    return _guard(adapter, True, guard_options)


def _guard(adapter: FrameworkAdapter, in_place: bool, guard_options: dict[str, Any]) -> Guard:
    options = dict(guard_options)  # the caller's own (a callback makes a Guard again for a second fit)
    for fixed in ("adapter", "in_place"):
        if fixed in options:
            raise TypeError(f"{fixed} is set by the integration")
    snapshot_every = positive_int("snapshot_every", options.pop("snapshot_every", 0), allow_zero=True)
    adapter.takes_snapshots = snapshot_every > 0
    return Guard.from_env(adapter=adapter, in_place=in_place, snapshot_every=snapshot_every, **options)


class FrameworkAdapter(StoreAdapter):
    """Base of the integrations' adapters; see the module docstring. Subclasses implement
    `_framework_save(root, step)` and `_load` (or `resume`), and may override `_capture_root`,
    `_tag`, `_after_commit` and `gradient_carrier`."""

    # Whether the Guard snapshots this adapter periodically (`guard_for`'s `snapshot_every`, the same on every
    # rank); False: a notice's agreed step saves fresh without the save decision's vote (hooks/machine/checkpoint.py).
    takes_snapshots = False

    def __init__(self, checkpoint_dir: str | os.PathLike, *, keep_last: int = 3, data: Any = None):
        super().__init__(checkpoint_dir=checkpoint_dir, keep_last=keep_last, data=data)
        self.scratch = self.store.root / f"{SCRATCH_PREFIX}{self.rank}"
        capture.clear(self.scratch)  # a killed save's leftovers: never part of a checkpoint
        self.prepared = False
        self.save_started_at: float | None = None  # time.time() when the last save began (the reaction bench)

    # ---- subclass hooks ---------------------------------------------------------------------
    def _framework_save(self, root: Path, step: int) -> None:
        """The framework's own save of everything its resume needs, aimed at the directory `root`."""
        raise NotImplementedError

    def _capture_root(self, step: int) -> Path:
        """The directory the framework's save writes the checkpoint into (inside `self.scratch`)."""
        return self.scratch

    def moved_to_new_group(self) -> None:
        """See the module docstring: the new formation's checkpoint group, this rank's scratch under
        its new rank, and the engine's buffers allocated again at the next step boundary (the
        framework's save may now write other files: Accelerate's main process writes the model)."""
        self.wait()
        self._snapshot, self.snapshot_step = None, None
        self._setup_group()
        self.scratch = self.store.root / f"{SCRATCH_PREFIX}{self.rank}"
        capture.clear(self.scratch)
        self.prepared = False

    # ---- the engine's two parts -------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        capture.clear(self.scratch)
        root = self._capture_root(step)
        root.mkdir(parents=True, exist_ok=True)
        with capture.captured_saves(root) as captured:
            self._framework_save(root, step)
        loose = capture.loose_bytes(self.scratch)
        if loose > LOOSE_WARNING_BYTES:
            log.warning("%s wrote %.1f MB at the step boundary past the capture (a save path spotguard does "
                        "not know): it is moved into the checkpoint, but its write held the step", type(self).__name__,
                        loose / 1e6)
        return {"root": str(root), **captured.state()}

    def _write_state(self, pending, state: dict[str, Any]) -> None:
        capture.write_captured(pending, state, state["root"])

    # ---- the CheckpointAdapter interface ----------------------------------------------------
    def prepare(self) -> None:
        """Allocates the engine's buffers from a capture of the current state (not a checkpoint):
        collective (the framework's save may be); the Guard calls it at the first step boundary."""
        super().prepare()
        capture.clear(self.scratch)
        self.prepared = True

    def save(self, step: int, *, reason: str = "notice", notice: Notice | None = None) -> CheckpointInfo | None:
        self.save_started_at = time.time()
        return super().save(step, reason=reason, notice=notice)

    def close(self) -> None:
        super().close()
        capture.clear(self.scratch)
