"""Denser snapshots while a notice is armed: the grid of steps every rank snapshots at. Pure
policy: numbers in, no I/O, no clock.

Between a notice and its answer the ranks may train many steps (a notice held until its
deadline comes within the horizon, a replacement hold, `agree_every`), and a step may then
become long (an evaluation pass): the deadline watchdog persists the newest snapshot every rank
holds. With `snapshot_every=25` that is up to 24 steps old; the grid makes it as recent as the
measured copy cost allows (`hooks/dense_snapshots.py` runs it across threads and ranks).

- `dense_interval(copy_seconds, step_seconds, every)`: the smallest k >= 1 whose copies cost at
  most `COPY_BUDGET` of the training time they come with (copy_seconds <= COPY_BUDGET * k *
  step_seconds): the steps the notice has left train at least 1 / (1 + COPY_BUDGET) as fast.
  None (no denser grid: the periodic snapshots stay as they are) when either figure was never
  measured, or when k would not be denser than `every`.
- `lead_steps(step_seconds, attempt)`: how far ahead of the proposer's completed step a grid
  starts: `LEAD_SECONDS` (doubled on each later attempt) of steps, at least `MIN_LEAD_STEPS`,
  so that every rank learns the grid (the store, one watchdog poll) before it reaches the start.
- `propose(notice_id, completed, copy_seconds, step_seconds, every, attempt)`: the `Grid` a rank
  publishes; the first one published for a notice is every rank's (the store's compare-and-set).
  A grid with interval 0 says "no denser snapshots" (and is shared like any other, so every rank
  follows the same decision).
- `Grid.takes(step)`: `step` is on the grid (at or after `start`, every `interval` steps).
- `in_time(boundary, grid)`: a rank that first sees `grid` at its step boundary `boundary`
  will take every step of it (`boundary < start`). The grid is used only when every rank saw it
  in time (`dense_snapshots`): with a collective in every step (DDP, FSDP), a rank's
  acknowledgement at a boundary before `start` is written before any rank completes step
  `start`, so every rank reads the same count at the grid's first step and all take it or none.
- At each step of an agreed grid (and each periodic step while it lasts) the ranks meet before
  they snapshot (`MEET_SECONDS`): the step is taken only when every rank reached that boundary,
  and the first answer written (taken, or void once the wait ran out) is every rank's. A rank
  held between its step's collective and its boundary (a rank-0 evaluation before `guard.step`)
  while its peers pass a grid step would otherwise leave them holding a step it does not hold;
  a void step fails the grid like a late one, so the ranks keep the step they all hold.
- `MAX_ATTEMPTS`: a grid some rank saw too late (or that met a void step) is proposed again (a
  later start) this often.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

COPY_BUDGET = 0.1  # the share of a step's time the snapshot copies may take while a notice is armed
LEAD_SECONDS = 1.0  # a grid starts this long (in steps) after the proposer's completed step: 4 watchdog polls
MIN_LEAD_STEPS = 3
MAX_ATTEMPTS = 3
MEET_SECONDS = 5.0  # the longest a rank waits at a grid step for the others; a rank held there waits anyway


@dataclass(frozen=True)
class Grid:
    """Snapshot at `start` and every `interval` steps after it (interval 0: no denser snapshots);
    proposed for notice `notice_id`, the `attempt`-th time."""

    notice_id: str
    start: int
    interval: int
    attempt: int = 0

    @property
    def dense(self) -> bool:
        return self.interval > 0

    def takes(self, step: int) -> bool:
        return self.interval > 0 and step >= self.start and (step - self.start) % self.interval == 0

    def to_wire(self) -> str:
        return f"{self.start}:{self.interval}"

    @classmethod
    def from_wire(cls, notice_id: str, attempt: int, text: str) -> Grid:
        start, interval = (int(part) for part in text.split(":"))
        return cls(notice_id, start, interval, attempt)


def dense_interval(copy_seconds: float | None, step_seconds: float, every: int) -> int | None:
    """See the module docstring."""
    if copy_seconds is None or step_seconds <= 0 or every <= 1:
        return None
    k = max(1, math.ceil(copy_seconds / (COPY_BUDGET * step_seconds)))
    return k if k < every else None


def lead_steps(step_seconds: float, attempt: int = 0) -> int:
    """See the module docstring (`step_seconds` > 0)."""
    return max(MIN_LEAD_STEPS, math.ceil(LEAD_SECONDS * 2 ** attempt / step_seconds))


def propose(notice_id: str, *, completed: int | None, copy_seconds: float | None, step_seconds: float, every: int,
            attempt: int = 0) -> Grid:
    """The grid this rank proposes for `notice_id` (module docstring); `completed`: its newest
    completed step (None: none yet)."""
    interval = dense_interval(copy_seconds, step_seconds, every)
    if interval is None:
        return Grid(notice_id, 0, 0, attempt)
    done = completed if completed is not None else -1
    return Grid(notice_id, done + lead_steps(step_seconds, attempt), interval, attempt)


def in_time(boundary: int, grid: Grid) -> bool:
    """Whether a rank that first sees `grid` at its boundary `boundary` takes all of it."""
    return boundary < grid.start
