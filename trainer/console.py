"""What the reference trainer prints for a person watching it (under `spotguard launch`, torchrun
or a pod's log): rank 0's lines, read from the events it writes anyway.

    trainer: starting at step 0 of 360, world size 2 (no checkpoint in /ckpt)
    trainer: resumed from step 87's checkpoint in /ckpt: steps 88-359 to go, world size 2
    trainer: joined the running job at step 140 of 360, world size 2
    trainer: step 120/360  loss 0.0421  5120.0 samples/s  world size 2
    trainer: world size 2 -> 1 after step 87 (in-place, paused 0.031 s)
    trainer: drained after step 87 (exit 83)
    trainer: finished: 360 of 360 steps

Steps are numbered as the loop passes them to the Guard (0 .. total-1), as the checkpoint folders
and the dry-run's report name them: `step-000000087-notice` holds the state after step 87, and a
job resumed from it runs step 88 next. The trainer's events count completed steps (one more);
the progress line `step 120/360` is such a count.

Progress comes at most every `every_seconds` (the first logged step always), so a long run
prints a line every few seconds, not one per step. The other ranks print nothing: their
events go to their own logs only.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class ConsoleEcho:
    """An event log that also prints rank 0's start, progress, changes and end.

    Wraps the trainer's `EventLog` (same `write`, `close` and `common`); `rank` is read from
    `common` at each event, so a rank renumbered by an in-place change prints from then on.
    """

    def __init__(self, log: Any, total_steps: int, checkpoint_dir: str, every_seconds: float = 10.0,
                 out: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self._log = log
        self._total = total_steps
        self._checkpoint_dir = checkpoint_dir
        self._every = every_seconds
        self._out = out
        self._clock = clock
        self._last_progress: float | None = None

    @property
    def common(self) -> dict[str, Any]:
        return self._log.common

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        self._log.write(event, t=t, **fields)
        if self.common.get("rank") == 0:
            line = self._line(event, fields)
            if line is not None:
                print(f"trainer: {line}", file=self._out or sys.stdout, flush=True)

    def close(self) -> None:
        self._log.close()

    def _line(self, event: str, fields: dict[str, Any]) -> str | None:
        world, step = self.common.get("world_size"), fields.get("step")
        if event == "start":
            if fields.get("joined"):
                return f"joined the running job at step {step} of {self._total}, world size {world}"
            if fields.get("resumed"):
                return f"resumed from step {step - 1}'s checkpoint in {self._checkpoint_dir}: " \
                       f"steps {step}-{self._total - 1} to go, world size {world}"
            return f"starting at step {step} of {self._total}, world size {world} " \
                   f"(no checkpoint in {self._checkpoint_dir})"
        if event == "step":
            now = self._clock()
            if self._last_progress is not None and now - self._last_progress < self._every:
                return None
            self._last_progress = now
            return f"step {fields['step']}/{self._total}  loss {fields['loss']:.4g}  " \
                   f"{fields['samples_per_s']} samples/s  world size {world}"
        if event == "resized":
            return f"world size {fields['from_world']} -> {fields['to_world']} after step {fields['step'] - 1} " \
                   f"({fields['path']}, paused {fields['pause']:.3f} s)"
        if event == "drained":
            return f"drained after step {fields['step'] - 1} (exit {fields['exit_code']})"
        if event == "finished":
            return f"finished: {fields['step']} of {self._total} steps"
        return None
