"""What `Guard.step(step)` returns: what happened at this step boundary.

    result = guard.step(step)
    if result.resized:                       # an in-place change: this rank trains on in a new group
        model, optimizer = adapter.model, adapter.optimizer
        rank, world_size = guard.rank, guard.world_size
    elif result.drained:                     # only with exit_on_drain=False (else the process exited)
        break

Contract: `happened` is CONTINUED (nothing, or a membership that asked nothing), RESIZED (`resize`
is the change's record; `drain` the same record when the change wrote its checkpoint first) or
DRAINED (`drain` is the step's record: a drain, a leaving rank, a fallback). Both are the
agreed-step machine's `StepRecord` (`hooks/machine/model.py`; also named `ResizeRecord` and
`DrainRecord`). The truth value is `drained`, so code written for the
boolean `step()` returned before (`if guard.step(step): break`) keeps working;
`== True` / `== False` work with a DeprecationWarning (`is True` cannot be intercepted: it is
now always False).
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spotguard.hooks.machine.model import StepRecord


class Happened(enum.Enum):
    CONTINUED = "continued"
    RESIZED = "resized"
    DRAINED = "drained"


@dataclass(frozen=True)
class StepResult:
    happened: Happened
    resize: StepRecord | None = None  # the change's record when RESIZED
    drain: StepRecord | None = None  # the step's record when DRAINED (or the change's, when it saved)

    @property
    def continued(self) -> bool:
        return self.happened is Happened.CONTINUED

    @property
    def resized(self) -> bool:
        return self.happened is Happened.RESIZED

    @property
    def drained(self) -> bool:
        return self.happened is Happened.DRAINED

    def __bool__(self) -> bool:
        return self.drained

    def __eq__(self, other: object) -> bool:
        if isinstance(other, bool):  # `guard.step(s) == True`: the boolean step() of before
            warnings.warn("Guard.step() returns a StepResult: compare `result.drained` (or use its truth value), "
                          "not `== True`/`== False`", DeprecationWarning, stacklevel=2)
            return self.drained is other
        if not isinstance(other, StepResult):
            return NotImplemented
        return (self.happened, self.resize, self.drain) == (other.happened, other.resize, other.drain)

    __hash__ = None  # type: ignore[assignment]  # records are compared, never keys


CONTINUED = StepResult(Happened.CONTINUED)  # the idle path allocates nothing
