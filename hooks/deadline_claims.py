"""What the ranks' deadline watchdogs share without any collective: the notice, who answers it,
and the snapshot step each rank holds.

A watchdog must work while the main thread is blocked in a collective, so it never enters one on
a group training uses. It talks through the key-value store of the default group (torch's
`TCPStore`: each call is a request to the store's server, made with the GIL released):
- `publish(notice)` / `shared_notice()` / `withdraw(notice_id)`: the first rank that learns of a
  notice publishes it (a withdrawal empties it, and the next notice, this rank's or another's,
  is published in its place); every other rank's watchdog picks it up on its next poll (a
  notice reaches one pod's ranks only: the other pods' ranks learn the deadline here, before
  any agreement).
- `claim(value)`: one atomic `compare_set` on one key: the first claim of the job wins and every
  later one returns the winner, so a boundary's agreed save (`BOUNDARY`) and a watchdog's persist
  (`persist_claim(step)`) or departure (`LEAVE`) never both run, whatever the order in which the
  ranks get there.
- `report_held(step)` / `held_by_all(step, timeout)`: each rank's held snapshot step, and whether
  every rank holds `step` (the watchdog persists a step only then: its write is collective on the
  checkpoint group, which no rank may enter alone).
- `leaving(timeout)`: this rank is about to leave; waits (at most `timeout`) until every rank is,
  so no rank ends while a peer's main thread could still fail on its absence before that peer's
  watchdog took over; rank 0, whose process serves the store, also waits until every other rank
  is past its last question to it. True when all arrived.
- `propose_grid(grid)` / `ack_grid(grid, in_time)` / `grid_agreed(grid)`: the grid of denser
  snapshots while a notice is armed (`snapshot_grid`, `dense_snapshots`): the first grid proposed
  for a notice and attempt is every rank's (one `compare_set`), each rank that saw it in time
  counts itself (one `add`), and `grid_agreed` is whether every rank did. `meet(grid, step,
  timeout)`: every rank at that grid step (True: snapshot it), or void after `timeout` (False),
  the first answer written being every rank's.
`LocalClaims` is the same for a process alone (no store). Keys live under `spotguard/deadline/`
of the formation's store, so a re-formed group starts with none.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

from spotguard.hooks.snapshot_grid import Grid
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.deadline")

PREFIX = "spotguard/deadline/"
BOUNDARY = "boundary"
LEAVE = "leave"
PERSIST = "persist:"


def persist_claim(step: int) -> str:
    return f"{PERSIST}{step}"


def claimed_step(value: str | None) -> int | None:
    """The step of a persist claim (None for any other value)."""
    if value and value.startswith(PERSIST):
        return int(value[len(PERSIST):])
    return None


class Claims(Protocol):
    def publish(self, notice: Notice) -> None: ...

    def shared_notice(self) -> Notice | None: ...

    def withdraw(self, notice_id: str) -> None: ...

    def claim(self, value: str) -> str: ...

    def winner(self) -> str | None: ...

    def report_held(self, step: int | None) -> None: ...

    def held_by_all(self, step: int, timeout: float) -> bool: ...

    def leaving(self, timeout: float) -> bool: ...

    def propose_grid(self, grid: Grid) -> Grid: ...

    def ack_grid(self, grid: Grid, in_time: bool) -> None: ...

    def grid_agreed(self, grid: Grid) -> bool: ...

    def meet(self, grid: Grid, step: int, timeout: float) -> bool: ...


class LocalClaims:
    """Claims of a process alone: the same answers, kept in memory."""

    def __init__(self) -> None:
        self._winner: str | None = None
        self._lock = threading.Lock()

    def publish(self, notice: Notice) -> None:
        pass

    def shared_notice(self) -> Notice | None:
        return None

    def withdraw(self, notice_id: str) -> None:
        pass

    def claim(self, value: str) -> str:
        with self._lock:
            if self._winner is None:
                self._winner = value
            return self._winner

    def winner(self) -> str | None:
        return self._winner

    def report_held(self, step: int | None) -> None:
        pass

    def held_by_all(self, step: int, timeout: float) -> bool:
        return True

    def leaving(self, timeout: float) -> bool:
        return True

    def propose_grid(self, grid: Grid) -> Grid:
        return grid

    def ack_grid(self, grid: Grid, in_time: bool) -> None:
        pass

    def grid_agreed(self, grid: Grid) -> bool:
        return True  # alone, a grid seen late simply starts at its next step

    def meet(self, grid: Grid, step: int, timeout: float) -> bool:
        return True


class StoreClaims:
    """Claims through the default group's store (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def for_default_group(cls) -> Claims:
        """StoreClaims on the default group's store; LocalClaims alone or without one."""
        try:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_default_store

            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
                return LocalClaims()
            return cls(_get_default_store(), dist.get_rank(), dist.get_world_size())
        except Exception as exc:  # no store: each rank decides alone
            log.warning("deadline watchdog: no shared store (%s): this rank decides alone", exc)
            return LocalClaims()

    def _get(self, key: str) -> str | None:
        if not self.store.check([PREFIX + key]):
            return None
        return self.store.get(PREFIX + key).decode()

    def publish(self, notice: Notice) -> None:
        self.store.compare_set(PREFIX + "notice", "", json.dumps(notice.to_wire()))

    def shared_notice(self) -> Notice | None:
        text = self._get("notice")
        return Notice.from_wire(json.loads(text)) if text else None

    def withdraw(self, notice_id: str) -> None:
        text = self._get("notice")
        if text and json.loads(text).get("id") == notice_id:
            self.store.compare_set(PREFIX + "notice", text, "")

    def claim(self, value: str) -> str:
        return self.store.compare_set(PREFIX + "claim", "", value).decode()

    def winner(self) -> str | None:
        return self._get("claim")

    def report_held(self, step: int | None) -> None:
        self.store.set(f"{PREFIX}held/{self.rank}", str(-1 if step is None else step))

    def held_by_all(self, step: int, timeout: float) -> bool:
        keys = [f"{PREFIX}held/{r}" for r in range(self.world_size)]
        return self._all_there(keys, timeout) and all(int(self.store.get(k).decode()) == step for k in keys)

    def leaving(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        self.store.set(f"{PREFIX}leaving/{self.rank}", "1")
        if not self._all_there([f"{PREFIX}leaving/{r}" for r in range(self.world_size)], timeout):
            return False
        if self.rank != 0:
            self.store.set(f"{PREFIX}gone/{self.rank}", "1")
            return True
        # rank 0 hosts the store: the last to go, so no peer loses it while it still asks
        return self._all_there([f"{PREFIX}gone/{r}" for r in range(1, self.world_size)], end - time.monotonic())

    def propose_grid(self, grid: Grid) -> Grid:
        key = f"{PREFIX}grid/{grid.attempt}/{grid.notice_id}"
        won = self.store.compare_set(key, "", grid.to_wire()).decode()
        return Grid.from_wire(grid.notice_id, grid.attempt, won)

    def ack_grid(self, grid: Grid, in_time: bool) -> None:
        if in_time:
            self.store.add(f"{PREFIX}grid-in-time/{grid.attempt}/{grid.notice_id}", 1)

    def grid_agreed(self, grid: Grid) -> bool:
        return self.store.add(f"{PREFIX}grid-in-time/{grid.attempt}/{grid.notice_id}", 0) == self.world_size

    def meet(self, grid: Grid, step: int, timeout: float) -> bool:
        answer = f"{PREFIX}grid-step/{grid.attempt}/{grid.notice_id}/{step}"
        if self.store.add(answer + "/arrived", 1) == self.world_size:
            self.store.compare_set(answer, "", "take")
        with contextlib.suppress(Exception):  # the wait ran out: void, unless the last rank answered meanwhile
            self.store.wait([answer], timedelta(seconds=timeout))
        return self.store.compare_set(answer, "", "void").decode() == "take"

    def _all_there(self, keys: list[str], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.store.check(keys):
            if time.monotonic() >= end:
                return False
            time.sleep(0.02)
        return True
