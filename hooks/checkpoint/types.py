"""The checkpoint layer's vocabulary: a committed checkpoint, a checkpoint being written, what every
store offers, and the errors.

A leaf: it imports nothing else of `spotguard.hooks.checkpoint`, so the stores, the format writers
(dcp.py, torchfile.py, torchshards.py), the commit protocol (commit.py) and the adapters all name
these types without an import cycle (an import-linter contract in pyproject.toml keeps it so).

- `CheckpointInfo`: a committed checkpoint as its manifest describes it.
- `PendingCheckpoint`: what one rank's writer may do with a checkpoint between `Store.begin` and
  the commit (write files into `dir` and record them, then `finish_rank`: its part manifest).
- `Store`: what both stores implement, `CheckpointStore` (a directory, store.py) and
  `ObjectCheckpointStore` (`s3://`, objectstore/store.py); `TieredStore` adds what the object
  store tells about its two tiers. `factory.open_store(location)` picks one.
- `CheckpointCorrupt` (a committed checkpoint failed verification), `CommitError` (a commit was
  refused, nothing became visible), `CheckpointFailed` (a checkpoint could not be made durable:
  raised on every rank by the commit protocol).
"""
from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class CheckpointCorrupt(Exception):
    """A committed checkpoint failed verification (missing file, wrong size or checksum)."""

    def __init__(self, tag: str, problems: list[str]):
        super().__init__(f"checkpoint {tag!r} is damaged: " + "; ".join(problems[:5])
                         + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
        self.tag = tag
        self.problems = problems


class CommitError(Exception):
    """A commit was refused (a rank's part is missing or inconsistent); nothing became visible."""


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be made durable (some rank failed to write, or the commit failed)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    tag: str
    dir: Path
    sequence: int
    world_size: int
    metadata: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(repr=False)
    committed_at: float = 0.0
    fingerprint: str = field(default="", repr=False)  # SHA-256 of the manifest: this very commit

    @property
    def step(self) -> int | None:
        step = self.metadata.get("step")
        return int(step) if isinstance(step, (int, float)) else None

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


class PendingCheckpoint(Protocol):
    """One rank's part of checkpoint `tag` while it is written (`Store.begin` -> the commit).

    A file reaches the rank's part by being written through `write_bytes`, or by `record` (written
    into `path(relpath)` and fsynced by the caller, size and CRC-32 known) or `adopt` (written
    there by something else: read back, checksummed, fsynced). `finish_rank(rank)`, after the last
    file, fsyncs the directories and writes the part manifest atomically: from then on the part is
    durable, and the commit may take it. `close()` gives the checkpoint up (a failed save).
    """

    tag: str
    dir: Path  # where this rank's files go
    attempt: str | None  # the id every rank of this save agreed on (`Store.begin`), if any

    def path(self, relpath: str | os.PathLike) -> Path:
        """Absolute path for `relpath` inside `dir` (parents created)."""
        ...

    def record(self, relpath: str | os.PathLike, size: int, crc32: int) -> None:
        """Registers a file already written and fsynced by the caller."""
        ...

    def write_bytes(self, relpath: str | os.PathLike, data: Any) -> int:
        """Writes `data` (bytes or any buffer) to `relpath`, fsyncs and records it; returns its size."""
        ...

    def adopt(self, relpath: str | os.PathLike) -> int:
        """Records a file something else wrote into `dir`: checksums and fsyncs it; returns its size."""
        ...

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """The files recorded so far: relpath -> {"size", "crc32"}."""
        ...

    def forget(self, relpath: str | os.PathLike) -> None:
        """Drops a recorded file (its writer renamed or removed it)."""
        ...

    def finish_rank(self, rank: int) -> Path:
        """fsyncs this rank's directories and writes its part manifest atomically; returns its path."""
        ...

    def close(self) -> None:
        """Releases what this writer holds (a pending checkpoint nobody holds may be cleaned up)."""
        ...


class DerivedKind(Protocol):
    """The copies of one kind derived from a store's checkpoints (derived.py `DerivedCopies`)."""

    def path(self, tag: str) -> Path:
        """Where the copy of `tag` lives once built."""
        ...

    def lookup(self, info: CheckpointInfo) -> Path | None:
        """The copy made from exactly the commit `info`, or None."""
        ...

    def build(self, info: CheckpointInfo, make: Callable[[Path], None]) -> Path:
        """Runs `make(dir)` on a hidden dir and publishes it as the copy of `info`; returns its path."""
        ...


@runtime_checkable
class Store(Protocol):
    """What every checkpoint store offers: a checkpoint is complete and verifiable, or invisible.

    Writing (every rank): `begin(tag, attempt)` -> this rank's files -> `pending.finish_rank(rank)`;
    then one rank, once every rank finished, `commit(tag, world_size, metadata)`, which checks every
    rank's part manifest and raises CommitError (nothing visible) when one is missing or wrong.
    commit.py is the protocol across ranks. Reading: `list` (complete checkpoints, oldest first),
    `latest`, `read(tag)`, `resolve(verify)` (the newest that verifies, falling back to older
    ones with a warning), `verify(info)` (CheckpointCorrupt naming the damage). `keep_last`:
    retention keeps the newest N and every checkpoint a notice produced.
    """

    keep_last: int
    # True: `begin` must get an `attempt` id every rank of the save agreed on, which keeps the parts
    # of different attempts at one tag apart (the object store); False: the id is not needed.
    agrees_attempts: bool

    @property
    def root(self) -> Path:
        """The local directory ranks write their files under."""
        ...

    def begin(self, tag: str, attempt: str | None = None) -> PendingCheckpoint:
        """Opens this rank's part of checkpoint `tag` (see the class docstring)."""
        ...

    def commit(self, tag: str, world_size: int, metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Makes the parts of ranks 0..world_size-1 the complete checkpoint `tag`; CommitError when refused."""
        ...

    def read(self, tag: str) -> CheckpointInfo | None:
        """The complete checkpoint `tag`, or None."""
        ...

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every complete checkpoint, oldest first."""
        ...

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint (no checksum pass), or None."""
        ...

    def verify(self, info: CheckpointInfo) -> None:
        """Recomputes every file's size and CRC-32; CheckpointCorrupt listing the damage."""
        ...

    def resolve(self, verify: bool = True) -> CheckpointInfo | None:
        """The newest complete checkpoint whose files are here and verify, falling back to older ones."""
        ...

    def derived(self, kind: str) -> DerivedKind:
        """The copies of kind `kind` made from this store's checkpoints (removed with them)."""
        ...

    def apply_retention(self, protect: AbstractSet[str] = frozenset()) -> builtins.list[str]:
        """Deletes complete checkpoints beyond the newest `keep_last`, except notice ones; returns tags."""
        ...

    def cleanup(self) -> builtins.list[str]:
        """Finishes or removes what crashed writers left; returns the names removed."""
        ...


@runtime_checkable
class TieredStore(Store, Protocol):
    """A store whose checkpoints are durable on local disk first and survive the node only once
    uploaded (the object store): what the drain reports as `durable_tier`
    (`isinstance(store, TieredStore)` tells the two kinds apart)."""

    @property
    def object_step(self) -> int | None:
        """The newest step this process knows committed in the tier that survives the node."""
        ...

    def durable_tier(self, tag: str) -> str | None:
        """The job's tier of checkpoint `tag` as this process knows it: "object" (the job's commit of
        it is in the object store, never on this rank's part alone), "local", or None."""
        ...

    def wait_durable(self, tag: str, timeout: float | None = None) -> str | None:
        """Waits up to `timeout` for this process's uploads and the job's commit of `tag`; its tier then."""
        ...

    def is_durable(self, step: int) -> bool:
        """Whether a checkpoint of `step` is committed in the tier that survives the node (asks it)."""
        ...

    def wait_uploaded(self, timeout: float | None = None) -> bool:
        """Waits for the uploads queued so far; True when they all ended within `timeout`."""
        ...
