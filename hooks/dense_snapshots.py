"""Denser snapshots while a notice is armed (`snapshot_grid`: the rule), run between the deadline
watchdog's thread and the training loop, on the same steps on every rank.

Contract (`DenseSnapshots`, one per deadline watchdog):
- `grid`: the grid the training loop follows now, None without one. It is the only thing
  `Guard.step` reads while no notice is armed (no store call, no lock on the way).
- `follow(notice_id, adapter, completed, step_seconds, every)` (the watchdog's thread, each poll
  while a notice is armed): with no grid yet, or after the current one failed, proposes one
  (`snapshot_grid.propose` from this rank's measured copy and step time) through the claims; the
  first proposal of the job for that notice and attempt is every rank's, so every rank follows
  the same start and interval. A "no denser snapshots" answer (nothing measured, or the
  periodic interval is dense enough) and a grid that failed `MAX_ATTEMPTS` times leave `grid`
  None until `stop()`.
- `due(step, every)` (the training loop, at the boundary of `step`, only while `grid` is set):
  whether to snapshot `step`, periodic steps included. The first boundary that sees a grid
  tells the store whether it saw it in time (`snapshot_grid.in_time`: one call); the grid's
  first step asks the store once whether every rank did. Yes: at each step of the grid, and at
  each periodic step from then on, the ranks meet through the store (`Claims.meet`: three
  calls) and snapshot it only when every rank came. No (or a void meeting): from there on only
  the periodic steps are snapshotted, without meeting, on every rank alike (they read the same
  answers), and the watchdog proposes the next attempt, starting later. A rank's held snapshot
  is therefore a step every rank snapshotted, which `held_by_all` needs; a snapshot waits for a
  persist in flight (a `save_async`), as every snapshot does.
- `stop()` (the watchdog's thread: the notice was withdrawn, or answered with this rank
  staying): the grid ends at the next periodic step (met, as the grid's last), so ranks that
  stop a few steps apart hold the same step there; a rank still on the grid after it meets no
  one at its next grid step (`MEET_SECONDS` once) and goes back to the periodic steps too.
- `end()` (the training loop: the group re-formed in place, every rank of the old group at the
  same agreed step; joiners know no grid): no grid from now on; a notice still armed gets a new
  one on the new formation's store.
- Memory: none beyond the one set of snapshot buffers (a snapshot overwrites the previous one).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from spotguard.hooks.deadline_claims import Claims
from spotguard.hooks.snapshot_grid import MAX_ATTEMPTS, MEET_SECONDS, Grid, in_time, propose

log = logging.getLogger("spotguard.hooks.deadline")


class DenseSnapshots:
    """See the module docstring."""

    def __init__(self, claims: Callable[[], Claims]):
        self._claims = claims
        self.grid: Grid | None = None
        self.failed: Grid | None = None  # set by the training loop: not every rank saw it in time
        self._decided = False  # the armed notice's grid is settled: none, or given up
        self._ending: Grid | None = None
        self._lock = threading.Lock()
        self._seen: Grid | None = None  # the training loop's: the grid it acknowledged
        self._agreed: bool | None = None

    # ---- the watchdog's thread ----------------------------------------------------------------------
    def follow(self, notice_id: str, adapter: Any, completed: int | None, step_seconds: float, every: int) -> None:
        with self._lock:
            self._ending = None  # a notice is armed (again): the grid goes on
            grid = self.grid
            if self._decided or (grid is not None and grid != self.failed):
                return
            attempt = 0 if grid is None else grid.attempt + 1
            if attempt >= MAX_ATTEMPTS:
                log.warning("denser snapshots: no grid every rank saw in time after %d attempts: the periodic "
                            "snapshots only", attempt)
                self.grid, self._decided = None, True
                return
        copy = measured_copy_seconds(adapter)
        proposal = propose(notice_id, completed=completed, copy_seconds=copy, step_seconds=step_seconds,
                           every=every, attempt=attempt)
        try:
            chosen = self._claims().propose_grid(proposal)
        except Exception as exc:  # no store to share it through: the periodic snapshots only
            log.warning("denser snapshots: the grid could not be shared (%s): the periodic snapshots only", exc)
            chosen = Grid(notice_id, 0, 0, attempt)
        with self._lock:
            self.grid, self._decided = (chosen, False) if chosen.dense else (None, True)
        if chosen.dense:
            log.warning("notice %s: snapshots every %d step(s) from step %d (attempt %d; here: copy %s, step %.3fs)",
                        notice_id, chosen.interval, chosen.start, attempt,
                        "unmeasured" if copy is None else f"{copy:.4f}s", step_seconds)

    def stop(self) -> None:
        with self._lock:
            self._decided, self._ending = False, self.grid

    # ---- the training loop ------------------------------------------------------------------------
    def end(self) -> None:
        with self._lock:
            self.grid = self._ending = self.failed = None
            self._decided = False

    def due(self, step: int, every: int) -> bool:
        """Whether the boundary of `step` snapshots it, periodic steps included (module docstring)."""
        grid = self.grid
        periodic = step % every == 0
        if grid is None:  # ended meanwhile
            return periodic
        if grid != self._seen:
            self._seen, self._agreed = grid, None
            self._acknowledge(grid, step)
        if self._agreed is None and grid.takes(step):
            self._agreed = self._seen_by_all(grid)
        take = periodic
        if self._agreed and (periodic or grid.takes(step)):
            take = self._met(grid, step)
            self._agreed = take
        if periodic and self._ending is not None:
            self._end(grid)
        return take

    def _acknowledge(self, grid: Grid, step: int) -> None:
        try:
            self._claims().ack_grid(grid, in_time(step, grid))
        except Exception as exc:  # every rank then reads a count short of the world: none takes the grid
            log.warning("denser snapshots: could not acknowledge the grid (%s)", exc)

    def _seen_by_all(self, grid: Grid) -> bool:
        try:
            agreed = self._claims().grid_agreed(grid)
        except Exception as exc:
            log.warning("denser snapshots: could not read the grid's acknowledgements (%s)", exc)
            agreed = False
        if not agreed:
            log.warning("denser snapshots: not every rank saw the grid from step %d in time: not used", grid.start)
            self.failed = grid
        return agreed

    def _met(self, grid: Grid, step: int) -> bool:
        try:
            met = self._claims().meet(grid, step, MEET_SECONDS)
        except Exception as exc:
            log.warning("denser snapshots: the ranks could not meet at step %d (%s)", step, exc)
            met = False
        if not met:
            log.warning("denser snapshots: not every rank reached step %d in time: the grid ends here", step)
            self.failed = grid
        return met

    def _end(self, grid: Grid) -> None:
        with self._lock:
            if self.grid == grid and self._ending == grid:
                self.grid = self._ending = self.failed = None


def measured_copy_seconds(adapter: Any) -> float | None:
    """The slowest recent snapshot copy of `adapter` (the host's part, or the device's when the
    state is on a GPU and its copy ran longer there); None when none was measured."""
    parts = adapter.save_parts() if hasattr(adapter, "save_parts") else None
    buffers = getattr(getattr(adapter, "snapshot_engine", None), "buffers", None)
    device = buffers.gpu_copy_seconds() if buffers is not None else None
    values = [v for v in (parts.snapshot if parts is not None else None, device) if v is not None]
    return max(values) if values else None
