"""The agreement interface and its arithmetic.

Every rank contributes [notice here, -deadline, -rank, membership] (idle: [0, -inf, -2*world, -1]);
the element-wise maximum over the ranks says whether any rank holds a notice, the earliest
deadline, the lowest rank holding one (that rank later broadcasts its notice, so every rank
acts on the same notice and deadline), and, in its own field, the newest membership the
supervisor pushed (the in-place Guard's): `generation * world + (world - 1 - rank)` for a rank
holding one, so the maximum names the newest generation and the lowest rank holding it (which
broadcasts it). A real notice held by any rank at the same boundary is acted on first; the
membership stays pending for a later boundary. `contribution`, `outcome` and
`agreed_membership` are that arithmetic, pure.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from collections.abc import Sequence

from spotguard.hooks.notice_gate import deadline_ts
from spotguard.wire.notice import Notice

FLAGS = 4  # the agreement vector's length
NO_MEMBERSHIP = -1.0


@dataclass(frozen=True)
class Verdict:
    """The ranks agreed to act now: on `source_rank`'s notice, with the earliest `deadline_ts`,
    or (`source_rank` -1, no rank held a notice) on `membership_source`'s pushed membership.
    `pending` / `membership` are what this rank contributed (None on ranks without one)."""

    pending: Notice | None
    deadline_ts: float
    source_rank: int
    membership: Notice | None = None
    membership_source: int = -1

    @property
    def on_notice(self) -> bool:
        return self.source_rank >= 0


def contribution(pending: Notice | None, rank: int, world_size: int,
                 membership_generation: int | None = None) -> list[float]:
    """This rank's flags for the agreement."""
    if membership_generation is None:
        member = NO_MEMBERSHIP
    else:
        member = float(membership_generation * world_size + (world_size - 1 - rank))
    if pending is None:
        return [0.0, -math.inf, -2.0 * world_size, member]
    return [1.0, -deadline_ts(pending), -float(rank), member]


def outcome(combined: Sequence[float], world_size: int) -> tuple[float, int] | None:
    """(earliest deadline, lowest rank holding a notice) from the element-wise maximum of every
    rank's contribution; None when no rank holds a notice."""
    if combined[0] > 0:
        return -combined[1], int(-combined[2]) % world_size
    return None


def agreed_membership(combined: Sequence[float], world_size: int) -> tuple[int, int] | None:
    """(newest pending generation, lowest rank holding it), or None when no rank holds one."""
    if len(combined) < FLAGS or combined[3] < 0:
        return None
    key = int(combined[3])
    return key // world_size, world_size - 1 - key % world_size


def verdict_of(combined: Sequence[float], world_size: int, pending: Notice | None,
               membership: Notice | None) -> Verdict | None:
    """The Verdict the combined flags ask for (a notice first), or None."""
    agreed = outcome(combined, world_size)
    if agreed is not None:
        return Verdict(pending, *agreed)
    pushed = agreed_membership(combined, world_size)
    if pushed is not None:
        return Verdict(None, math.inf, -1, membership, pushed[1])
    return None


def generation_of(membership: Notice | None) -> int | None:
    """The generation a pending membership (the view's record of it) contributes."""
    return None if membership is None else int(membership.detail["generation"])


class Agreement(abc.ABC):
    """Decides at each step boundary whether every rank acts on a notice now.

    Contract: every rank calls `at_boundary(step, pending, membership)` after every step, in the
    same order, with its own most urgent pending notice (or None) and its pending membership (or
    None); the call returns a `Verdict` on every rank at the same step, or None on every rank.
    An agreement is bound to one process group: for a new group, `close()` this one and make
    another. `settle()` waits for an agreement in flight and drops its result (nothing is in
    flight afterwards); `close()` settles.
    """

    @abc.abstractmethod
    def at_boundary(self, step: int, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        """See the class docstring."""

    def settle(self) -> None:
        """Waits for an agreement still in flight; its result is dropped."""

    def close(self) -> None:
        self.settle()
