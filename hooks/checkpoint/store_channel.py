"""The ranks of one save talking through a c10d store instead of a process group, so the save
outlives the group it was started on: an in-place change's survivors leave the old group and form
the new one while the write of the agreed step commits behind them (machine/table.py).

Contract: `StoreChannel(store, prefix, rank, world_size, timeout)`; every rank of the save makes
one with the same `prefix` (unique to the save: the agreed notice and step) and calls the same
operations in the same order, as with collectives. Each operation is a round of keys
`<prefix><n>/<name>/<rank>` on `store` (the old formation's store, which its leader serves for its
process's lifetime); a wait on a peer lasts at most `timeout` seconds and raises
`ChannelError` (so does a store that stopped answering: its host left).
- `all_ok(ok)` and `max(values)`: the `Vote` the commit protocol (commit.py) takes;
  `rank0_says(ok)`: rank 0's word on every rank (the commit's outcome).
- `gather(payload)`: rank 0 gets every rank's bytes (in rank order), the others None;
  `broadcast(payload)`: every rank gets rank 0's bytes; `scatter(payloads)`: each rank its own of
  rank 0's. `ERROR` payloads (`error_payload`) carry a rank's failure, so a failure on one rank
  raises on all of them instead of a timeout.
- `close()`: this rank read its last round (its write thread calls it once the commit protocol
  ended); the last rank to close deletes the rounds' keys (two small keys stay);
  `wait_closed(linger)`: the old formation's rank 0, which serves the store and may be
  about to exit, waits until every rank closed, so the store answers until its peers read.
- A failed operation breaks the channel: every later one raises at once (the ranks are out of
  step). `abort(why)` breaks it from any thread (a wait in progress ends within `ABORT_SLICE`)
  and tells the peers: their waits end with `PeerFailed`, not after the timeout.
Payloads are pickled by the callers that need objects (DCP plans, as DCP's own collectives do):
the peers are the job's own ranks.
"""
from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

ERROR = b"\x00spotguard-error\x00"
ABORT_SLICE = 0.25  # seconds: how soon a wait notices `abort`


class ChannelError(RuntimeError):
    """A peer did not answer within the channel's timeout, or the store is gone."""


class PeerFailed(RuntimeError):
    """A peer reported its failure through the channel."""


def error_payload(exc: BaseException) -> bytes:
    return ERROR + f"{type(exc).__name__}: {exc}".encode(errors="replace")


def raise_if_error(payload: bytes, rank: int) -> bytes:
    if payload.startswith(ERROR):
        raise PeerFailed(f"rank {rank}: {payload[len(ERROR):].decode(errors='replace')}")
    return payload


class StoreChannel:
    """See the module docstring."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout: float):
        self.store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=max(timeout, 0.001))
        self._round = 0
        self._keys: list[str] = []  # every round's keys: the last rank to close deletes them
        self._broken = ""  # why the channel failed: every later operation fails at once (peers are out of step)

    # ---- the Vote of the commit protocol ----------------------------------------------------
    def all_ok(self, ok: bool) -> bool:
        return all(value == b"1" for value in self._exchange("ok", b"1" if ok else b"0"))

    def max(self, values: Sequence[float]) -> list[float]:
        count = len(values)
        rows = [struct.unpack(f"<{count}d", raw) for raw in self._exchange("max", struct.pack(f"<{count}d", *values))]
        return [max(column) for column in zip(*rows, strict=True)] if rows else list(values)

    def rank0_says(self, ok: bool) -> bool:
        """Rank 0's `ok` on every rank (the commit's outcome: commit.py, step 5)."""
        return self.broadcast("rank0", b"1" if ok else b"0") == b"1"

    # ---- DCP's coordination ------------------------------------------------------------------
    def gather(self, name: str, payload: bytes) -> list[bytes] | None:
        keys = self._next(name)
        self._call(self.store.set, keys[self.rank], payload)
        if self.rank != 0:
            return None
        return self._read(keys)

    def broadcast(self, name: str, payload: bytes = b"") -> bytes:
        keys = self._next(name)
        if self.rank == 0:
            self._call(self.store.set, keys[0], payload)
            return payload
        return self._read(keys[:1])[0]

    def scatter(self, name: str, payloads: list[bytes] | None) -> bytes:
        """Rank 0's `payloads[r]` to each rank r (the others pass None)."""
        keys = self._next(name)
        if self.rank == 0:
            assert payloads is not None and len(payloads) == self.world_size
            for key, payload in zip(keys, payloads, strict=True):
                self._call(self.store.set, key, payload)
            return payloads[0]
        return self._read(keys[self.rank:self.rank + 1])[0]

    def close(self) -> None:
        """This rank is done with the channel (its last round read). Never raises."""
        try:
            if self._call(self.store.add, f"{self.prefix}closed", 1) >= self.world_size:
                self._call(self.store.set, f"{self.prefix}all-closed", b"1")
                for key in self._keys:  # the last to close: every rank read its rounds
                    self.store.delete_key(key)
        except Exception:  # a store that is gone has nothing left to read or delete
            pass

    def wait_closed(self, linger: float) -> bool:
        """Waits at most `linger` seconds until every rank closed; whether they did. Never raises."""
        try:
            self.store.wait([f"{self.prefix}all-closed"], timedelta(seconds=max(linger, 0.001)))
            return True
        except Exception:  # the time passed, or the store is gone: nobody is left to read
            return False

    def abort(self, why: str) -> None:
        """This rank gives up on the save: every wait of this channel, in any thread, ends with
        `ChannelError` (at once, or within `ABORT_SLICE`), so does every later operation, and the
        peers' waits end with `PeerFailed` (the reason is left in the store for them)."""
        if self._broken:
            return
        self._broken = why
        with contextlib.suppress(Exception):  # best effort: a store that is gone fails their waits anyway
            self.store.set(f"{self.prefix}failed", f"rank {self.rank}: {why}")

    # ---- the rounds --------------------------------------------------------------------------
    def _next(self, name: str) -> list[str]:
        self._round += 1
        keys = [f"{self.prefix}{self._round}/{name}/{rank}" for rank in range(self.world_size)]
        self._keys += keys
        return keys

    def _exchange(self, name: str, payload: bytes) -> list[bytes]:
        keys = self._next(name)
        self._call(self.store.set, keys[self.rank], payload)
        return self._read(keys)

    def _read(self, keys: list[str]) -> list[bytes]:
        until = time.monotonic() + self.timeout.total_seconds()
        while not self._call(self.store.check, keys):
            if self._call(self.store.check, [f"{self.prefix}failed"]):
                failed = bytes(self._call(self.store.get, f"{self.prefix}failed")).decode(errors="replace")
                self._broken = f"a peer gave up: {failed}"
                raise PeerFailed(self._broken)
            left = until - time.monotonic()
            if left <= 0:
                self._broken = f"no answer within {self.timeout.total_seconds():.1f}s for {keys}"
                raise ChannelError(f"save channel {self.prefix!r} (rank {self.rank} of {self.world_size}): "
                                   f"{self._broken}")
            try:  # in slices, so `abort` from another thread ends the wait
                self.store.wait(keys, timedelta(seconds=min(left, ABORT_SLICE)))
            except Exception:  # a slice's timeout; the loop's check tells the rest
                pass
        return [bytes(self._call(self.store.get, key)) for key in keys]

    def _call(self, operation: Any, *args: Any) -> Any:
        if self._broken:
            raise ChannelError(f"save channel {self.prefix!r} (rank {self.rank} of {self.world_size}): {self._broken}")
        try:
            return operation(*args)
        except Exception as exc:  # c10d raises DistStoreError / RuntimeError for a timeout or a lost store
            self._broken = f"{exc}"
            raise ChannelError(f"save channel {self.prefix!r} (rank {self.rank} of {self.world_size}): {exc}") from exc
