"""What `Guard.step(step)` returns: what happened at this step boundary.

    result = guard.step(step)
    if result.resized:                       # an in-place change: this rank trains on in a new group
        model, optimizer = adapter.model, adapter.optimizer
        rank, world_size = guard.rank, guard.world_size
    elif result.drained:                     # only with exit_on_drain=False (else the process exited)
        break

Contract: `happened` is CONTINUED (nothing, or a membership that asked nothing), RESIZED (`resize`
is the change's `ResizeRecord`; `drain` the checkpoint the change wrote first, when it wrote one)
or DRAINED (`drain` is the `DrainRecord`). The truth value is `drained`, so code written for the
boolean `step()` returned before (`if guard.step(step): break`) keeps working;
`== True` / `== False` work with a DeprecationWarning (`is True` cannot be intercepted: it is
now always False).
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any


class Happened(enum.Enum):
    CONTINUED = "continued"
    RESIZED = "resized"
    DRAINED = "drained"


@dataclass(frozen=True)
class StepResult:
    happened: Happened
    resize: Any = None  # hooks.elastic.reformer.ResizeRecord when RESIZED
    drain: Any = None  # hooks.drain.DrainRecord when DRAINED (or the change's own checkpoint)

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
