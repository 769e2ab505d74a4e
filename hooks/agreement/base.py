"""The agreement interface and its arithmetic.

Every rank contributes [notice here, -deadline, -rank] (idle: [0, -inf, -2*world]); the element-wise
maximum over the ranks says whether any rank holds a notice, the earliest deadline, and the
lowest rank holding one (that rank later broadcasts its notice, so every rank acts on the same
notice and deadline). A pushed membership (the in-place Guard's internal notice, source
`names.MEMBERSHIP_SOURCE`) contributes -(rank + world): any rank holding a real notice at the
same boundary is chosen before it. `contribution` and `outcome` are that arithmetic, pure.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from collections.abc import Sequence

from spotguard.hooks.notice_gate import deadline_ts
from spotguard.wire.names import MEMBERSHIP_SOURCE
from spotguard.wire.notice import Notice


@dataclass(frozen=True)
class Verdict:
    """The ranks agreed to act now: on `source_rank`'s notice, with the earliest `deadline_ts`.
    `pending` is the notice this rank contributed (None on ranks without one)."""

    pending: Notice | None
    deadline_ts: float
    source_rank: int


def contribution(pending: Notice | None, rank: int, world_size: int) -> list[float]:
    """This rank's flag for the agreement."""
    if pending is None:
        return [0.0, -math.inf, -2.0 * world_size]
    order = rank + world_size if pending.source == MEMBERSHIP_SOURCE else rank
    return [1.0, -deadline_ts(pending), -float(order)]


def outcome(combined: Sequence[float], world_size: int) -> tuple[float, int] | None:
    """(earliest deadline, lowest rank holding a notice: a real one before a membership) from the
    element-wise maximum of every rank's contribution; None when no rank holds a notice."""
    if combined[0] > 0:
        return -combined[1], int(-combined[2]) % world_size
    return None


class Agreement(abc.ABC):
    """Decides at each step boundary whether every rank acts on a notice now.

    Contract: every rank calls `at_boundary(step, pending)` after every step, in the same order,
    with its own most urgent pending notice (or None); the call returns a `Verdict` on every rank
    at the same step, or None on every rank. An agreement is bound to one process group: for a
    new group, `close()` this one and make another. `settle()` waits for an agreement in flight
    and drops its result (nothing is in flight afterwards); `close()` settles.
    """

    @abc.abstractmethod
    def at_boundary(self, step: int, pending: Notice | None) -> Verdict | None:
        """See the class docstring."""

    def settle(self) -> None:
        """Waits for an agreement still in flight; its result is dropped."""

    def close(self) -> None:
        self.settle()
