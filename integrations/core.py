"""What the framework integrations share: a Guard whose checkpoint is the framework's own save.

`FrameworkSave` is a `CheckpointAdapter` (hooks/adapters/base.py) for frameworks that write
their own checkpoint format. Its `save(step)` runs on every rank at the agreed step:
1. `_write(step, notice)`: the framework's save call, into a staging place the framework's
   resume code never looks at;
2. every rank agrees that its part succeeded (one all_reduce on the adapter's own gloo group);
3. rank 0 `_publish(step, notice)`es: fsyncs what was written and renames it to the name the
   framework resumes from (`publish_dir` / `publish_file`: complete or invisible);
4. every rank learns the outcome. Any failure raises `CheckpointFailed` on every rank, so the
   Guard drains with exit 84 and the previous checkpoint stays the newest (the staging copy is
   removed, never renamed).
A failing rank still joins the collectives the framework's save makes after its write
(`_rejoin_after_failure`), so the other ranks are never left waiting in them.

`guard_for(adapter, ...)` makes the Guard every integration uses: configured from SPOTGUARD_*
(sidecar, grace, agree_every), restart path only (`in_place=False`: in-place membership
changes through these frameworks are for later), no in-memory snapshots (the framework owns
the state layout). SIGTERM is a notice, as with the plain Guard.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

from spotguard.hooks import Guard
from spotguard.hooks.adapters.base import CheckpointFailed, reraise_interrupts
from spotguard.hooks.agreement.collectives import join_collectives
from spotguard.hooks.checkpoint import fsutil
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.integrations")

MARKER = "spotguard.json"  # inside a published checkpoint directory: the step and notice it answers


def guard_for(adapter: FrameworkSave, **guard_options: Any) -> Guard:
    """The Guard of an integration (every rank, same order): see the module docstring."""
    for fixed in ("adapter", "in_place", "snapshot_every"):
        if fixed in guard_options:
            raise TypeError(f"{fixed} is set by the integration")
    return Guard.from_env(adapter=adapter, in_place=False, snapshot_every=0, **guard_options)


class FrameworkSave:
    """Base of the integrations' adapters; see the module docstring. Subclasses implement
    `_write`, `_publish` and `_discard`, and may override `gradient_carrier` and `_rejoin_after_failure`."""

    snapshot_step: int | None = None
    takes_snapshots = False  # the drain saves fresh without the save decision's vote (hooks/drain.py)

    def __init__(self) -> None:
        self.collectives = join_collectives(None)  # its own gloo group, made in the same order on every rank
        self.rank = self.collectives.rank
        self.save_seconds: deque[float] = deque(maxlen=5)
        self.last_saved_step: int | None = None
        self.save_started_at: float | None = None  # time.time() when the last save began (the reaction bench)

    # ---- subclass hooks ---------------------------------------------------------------------
    def _write(self, step: int, notice: Notice | None) -> None:
        raise NotImplementedError

    def _publish(self, step: int, notice: Notice | None) -> None:
        raise NotImplementedError

    def _discard(self, step: int) -> None:
        """Rank 0, after a failed save: removes the staging copy."""

    def _rejoin_after_failure(self) -> None:
        """A rank whose `_write` raised joins the collectives the framework's save makes after it."""

    # ---- the CheckpointAdapter interface ----------------------------------------------------
    def save(self, step: int, *, reason: str = "notice", notice: Notice | None = None) -> None:
        self.save_started_at = time.time()
        t0 = time.monotonic()
        ok = self._attempt(f"rank {self.rank}: the framework's save of step {step}", self._write, step, notice,
                           on_failure=self._rejoin_after_failure)
        if not self.collectives.all_ok(ok):
            if self.rank == 0:
                self._discard(step)
            raise CheckpointFailed(f"step {step}: a rank's save failed; the previous checkpoint stays the newest")
        ok = self.rank != 0 or self._attempt(f"publishing the checkpoint of step {step}", self._publish, step, notice,
                                             on_failure=lambda: self._discard(step))
        if not self.collectives.all_ok(ok):
            raise CheckpointFailed(f"step {step}: publishing failed; the previous checkpoint stays the newest")
        self.save_seconds.append(time.monotonic() - t0)
        self.last_saved_step = step

    @staticmethod
    def _attempt(what: str, call, step: int, notice: Notice | None, on_failure) -> bool:
        try:
            call(step, notice)
            return True
        except BaseException as exc:  # every rank must learn about the failure
            reraise_interrupts(exc)
            log.exception("%s failed", what)
            with contextlib.suppress(Exception):
                on_failure()
            return False

    def snapshot(self, step: int) -> None:
        raise NotImplementedError("the framework integrations take no in-memory snapshots")

    def persist_snapshot(self, *, reason: str = "notice", notice: Notice | None = None) -> int:
        raise CheckpointFailed("the framework integrations take no in-memory snapshots")

    def estimate_save_seconds(self) -> float | None:
        return 1.25 * max(self.save_seconds) if self.save_seconds else None

    def resume(self) -> int | None:
        """The framework resumes itself (its own resume call); nothing to load here."""
        return None

    def answered_notice_id(self) -> str | None:
        return None

    def gradient_carrier(self) -> Any:
        return None

    def close(self) -> None:
        pass


def marker(step: int, notice: Notice | None) -> bytes:
    return json.dumps({"step": step, "notice_id": notice.id if notice else None,
                       "saved_at": time.time()}).encode()


def read_marker(directory: str | os.PathLike | None) -> dict[str, Any]:
    """The marker of a published checkpoint directory ({} when absent or unreadable)."""
    if directory is None:
        return {}
    try:
        return json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def publish_dir(staged: Path, final: Path, step: int, notice: Notice | None) -> None:
    """Makes the directory `staged` (complete, written by the framework) appear as `final`:
    fsyncs every file, writes the marker, renames (an existing `final` is set aside first and
    deleted only after the rename), fsyncs the parent."""
    fsutil.write_file_synced(staged / MARKER, marker(step, notice))
    fsutil.fsync_tree(staged)
    aside = None
    if os.path.lexists(final):
        aside = final.with_name(f".spotguard-replaced-{final.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    try:
        os.rename(staged, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)
        raise
    fsutil.fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def publish_file(staged: Path, final: Path) -> None:
    """Makes the file `staged` appear as `final` in one atomic rename, fsynced before and after."""
    fsutil.fsync_path(staged)
    os.replace(staged, final)
    fsutil.fsync_dir(final.parent)


def remove_quietly(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
