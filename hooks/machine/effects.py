"""What the agreed-step machine may ask of the Guard, and nothing else (the Guard hands it this,
never itself).

- `Hooks`: the callables training code registered (`@guard.on_reclaim`, `on_drain`, `on_resume`,
  `on_resize`, `on_resize_phase`), in registration order.
- `Effects`: the attached adapter and the Guard's collectives as they are now (both change:
  `attach`, a re-form), `rejoin()` (after a re-form, collective over the new group: the Guard's
  collectives, agreement and reporter on it), `answered(notice_id)` (the notice gate: a re-sent
  copy of a notice this step's checkpoint answers never drains again), `close()` (listener,
  signals, adapter, before the process leaves), the hook reporter, the save margin and
  `departing()` (a rank's departure is about to write its termination message: the deadline
  watchdog stops writing it).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, SupportsInt

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.machine.model import StepRecord
from spotguard.wire.notice import Notice

if TYPE_CHECKING:
    from spotguard.hooks.adapters.base import CheckpointAdapter

NoticeHook = Callable[[int, Notice], object]


@dataclass
class Hooks:
    """See the module docstring."""

    reclaim: list[NoticeHook] = field(default_factory=list)
    drain: list[NoticeHook] = field(default_factory=list)
    resume: list[Callable[[], SupportsInt | None]] = field(default_factory=list)
    resize: list[Callable[[StepRecord], object]] = field(default_factory=list)
    phase: list[Callable[[str, StepRecord], object]] = field(default_factory=list)


@dataclass(frozen=True)
class Effects:
    """See the module docstring."""

    adapter: Callable[[], CheckpointAdapter | None]
    collectives: Callable[[], Collectives]
    rejoin: Callable[[], None]
    answered: Callable[[str], None]
    close: Callable[[], None]
    hooks: Hooks
    reporter: HookReporter | None = None
    save_margin_seconds: float = 1.0
    departing: Callable[[], None] = lambda: None
