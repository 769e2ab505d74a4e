"""The names the in-place change had before the agreed-step machine (`hooks/machine`), kept so
that code importing them keeps working: `ResizeRecord` is the machine's `StepRecord` (it answers
every field the change's record had), `Outcome` and `PHASES` are `hooks/machine/model.py`'s."""
from __future__ import annotations

from spotguard.hooks.machine.model import PHASES, Outcome, ResizeRecord

__all__ = ["PHASES", "Outcome", "ResizeRecord"]
