"""The names the drain had before the agreed-step machine (`hooks/machine`), kept so that code
importing them keeps working: `DrainRecord` is the machine's `StepRecord` (it answers every field
the drain's record had), the departures are `hooks/machine/departure.py`'s."""
from __future__ import annotations

from spotguard.hooks.machine.departure import ExitProcess, ReturnToLoop
from spotguard.hooks.machine.model import DrainRecord

__all__ = ["DrainRecord", "ExitProcess", "ReturnToLoop"]
