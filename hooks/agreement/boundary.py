"""The Guard's own agreements: alone, blocking, pipelined (see `base` for the contract).

- `LocalAgreement` (one process): a pending notice is acted on at once, every step.
- `BlockingAgreement`: every `agree_every` steps one all_reduce(MAX) of a preallocated
  4-element tensor on the Guard's group; a notice is acted on at that boundary.
- `PipelinedAgreement`: that all_reduce runs in the background during the next step and is read
  at the next agreement (cost ~0; a notice is acted on one agreement later).
"""
from __future__ import annotations

import math
from typing import Any

from spotguard.hooks.agreement.base import FLAGS, Agreement, Verdict, contribution, generation_of, verdict_of
from spotguard.hooks.agreement.collectives import GroupCollectives
from spotguard.hooks.notice_gate import deadline_ts
from spotguard.wire.notice import Notice


class LocalAgreement(Agreement):
    def at_boundary(self, step: int, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        if pending is not None:
            return Verdict(pending, deadline_ts(pending), 0)
        if membership is not None:
            return Verdict(None, math.inf, -1, membership, 0)
        return None


class BlockingAgreement(Agreement):
    def __init__(self, collectives: GroupCollectives, agree_every: int = 1):
        torch = collectives.torch
        self.collectives = collectives
        self.agree_every = agree_every
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self._torch = torch
        self._flag = torch.zeros(FLAGS, dtype=torch.float64)
        self._idle = torch.tensor(contribution(None, collectives.rank, collectives.world_size), dtype=torch.float64)

    def at_boundary(self, step: int, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        if step % self.agree_every != 0:
            return None
        return self.agree_now(pending, membership)

    def agree_now(self, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        """One blocking all_reduce(MAX) of this boundary's flags."""
        self._contribute(pending, membership)
        self.collectives.all_reduce_max_(self._flag)
        return self._verdict(pending, membership)

    def _contribute(self, pending: Notice | None, membership: Notice | None) -> None:
        if pending is None and membership is None:
            self._flag.copy_(self._idle)  # preallocated: no allocation while idle
        else:
            flags = contribution(pending, self.rank, self.world_size, generation_of(membership))
            self._flag.copy_(self._torch.tensor(flags, dtype=self._torch.float64))

    def _verdict(self, pending: Notice | None, membership: Notice | None) -> Verdict | None:
        return verdict_of(self._flag.tolist(), self.world_size, pending, membership)


class PipelinedAgreement(BlockingAgreement):
    def __init__(self, collectives: GroupCollectives, agree_every: int = 1):
        super().__init__(collectives, agree_every)
        self._work: Any = None
        self._contributed: tuple[Notice | None, Notice | None] = (None, None)

    def at_boundary(self, step: int, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        """Waits for the all_reduce started at the previous agreement (done by now: a step ran
        meanwhile) and acts on it, else starts this boundary's one in the background."""
        if step % self.agree_every != 0:
            return None
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            verdict = self._verdict(*self._contributed)
            if verdict is not None:
                return verdict
        self._contributed = (pending, membership)
        self._contribute(pending, membership)
        self._work = self.collectives.all_reduce_max_(self._flag, async_op=True)
        return None

    def settle(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
