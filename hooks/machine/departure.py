"""The one place a rank leaves after an agreed step, whatever ended it: a drain, a leaving rank
(its change done or failed), a fallback.

`depart(record, checkpoint, effects, departure)`, on this rank alone (no collective):
1. a checkpoint durable only on local disk (a store with an object tier, `durable_tier` "local"):
   the upload, and the job's commit of it in the object store, are waited for until the notice's
   deadline less the save margin (`TieredStore.wait_durable`: a rank's own uploaded part is not
   the job's checkpoint); then the job's tier, and the steps lost counting only what reached the
   object store (the newest step known there);
2. when the checkpoint is durable: the `@on_drain` hooks `hook(step, notice)` (a failure is
   logged, the rank leaves anyway) and, for a notice's checkpoint, the `drained` report;
3. the termination message for the supervisor (`termination_message`), for every outcome (the
   deadline watchdog was told first, `Effects.departing`, and writes none after it); it and
   the `drained` report say `saved_by` "boundary" (the deadline watchdog says "watchdog"),
   `snapshot_steps` and `margin_seconds` (to the notice's deadline, when it has one);
4. the `Departure`: `ExitProcess` closes the Guard, leaves the groups (no last agreement: the
   checkpoint's vote was this formation's last collective, and a peer that stopped answering
   must not hold a rank whose checkpoint is durable), raises SystemExit(83, or 84 when not
   durable: `Saved.exit_code`); with `hard_exit` an atexit hook (registered when the ExitProcess
   is made, so exit handlers registered later run first) flushes logging/stdio and calls
   `os._exit(code)`: torch's C++ teardown intermittently aborts in gloo and would turn an 83 into
   a crash. `ReturnToLoop` returns: `step()` returns the drained result and training code decides
   (`exit_on_drain=False`).
"""
from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Protocol

from spotguard.hooks.adapters.base import checkpoint_tag
from spotguard.hooks.checkpoint.types import TieredStore
from spotguard.hooks.machine.checkpoint import Checkpoint
from spotguard.hooks.machine.effects import Effects
from spotguard.hooks.machine.model import Phase, StepRecord
from spotguard.hooks.termination_message import departure_account, write_termination_message
from spotguard.processes import flush_and_exit

log = logging.getLogger("spotguard.hooks.guard")


class Departure(Protocol):
    def after_drain(self, record: StepRecord) -> None: ...

    def release(self) -> None: ...


def depart(record: StepRecord, checkpoint: Checkpoint | None, effects: Effects, departure: Departure) -> None:
    """See the module docstring."""
    notice = record.notice
    assert notice is not None, "a joiner never departs: it raises"
    effects.departing()
    steps_lost, tier, object_step = record.steps_lost, record.saved.tier if record.saved else None, None
    if record.ok and tier == "local" and checkpoint is not None:
        tier, steps_lost, object_step = settle_upload(record, effects)
    if record.ok:
        t0 = time.monotonic()
        for hook in effects.hooks.drain:
            try:
                hook(record.step, notice)
            except Exception:  # the checkpoint is durable; leave anyway
                log.exception("@on_drain hook %s failed", getattr(hook, "__name__", hook))
        record.drain_seconds = time.monotonic() - t0
    account = departure_account("boundary", record.step, record.saved_step, notice.seconds_left())
    if record.ok and checkpoint is not None:
        extra: dict = {"steps_lost": steps_lost, "saved_step": record.saved_step, **account}
        extra.update({k: v for k, v in (("durable_tier", tier), ("object_step", object_step)) if v is not None})
        checkpoint.report("drained", record.drain_seconds, **extra)
    write_termination_message(notice.id, record.step, record.saved_step, record.ok, steps_lost=steps_lost,
                              durable_tier=tier, object_step=object_step, extra=account, exit_code=record.exit_code)
    record.phases[Phase.DEPARTED.value] = time.time() - record.started_at
    log.warning("rank %d leaves (%s) for notice %s at step %d (checkpoint of step %d %s in %.3fs): exit %d",
                record.old_rank, record.outcome.value, notice.id, record.step, record.saved_step,
                "durable" if record.ok else "FAILED", record.checkpoint_seconds, record.exit_code)
    departure.after_drain(record)


def settle_upload(record: StepRecord, effects: Effects) -> tuple[str | None, int, int | None]:
    """Waits for the upload until the notice's deadline (less the margin): (the tier then, the
    steps lost counting only what reached the object store, the newest step known there when
    the tier is still local)."""
    adapter = effects.adapter()
    store = getattr(adapter, "store", None)
    if not isinstance(store, TieredStore) or record.notice is None:
        return "local", record.steps_lost, None
    left = record.notice.seconds_left()
    tier = store.wait_durable(checkpoint_tag(adapter, record.saved_step, "notice"),
                              None if left is None else max(left - effects.save_margin_seconds, 0.0))
    if tier == "object":
        return tier, record.steps_lost, None
    survived = store.object_step
    log.warning("checkpoint of step %d is on local disk only (not uploaded by the deadline): lost with the node",
                record.saved_step)
    lost = record.step - (survived if survived is not None else 0)
    return tier, lost, record.step - lost


class ReturnToLoop:
    """After a departure `step()` returns the drained result; the training code decides what follows."""

    def after_drain(self, record: StepRecord) -> None:
        pass

    def release(self) -> None:
        pass


class ExitProcess:
    """After a departure the rank exits with the record's code (see the module docstring)."""

    def __init__(self, close: Callable[[], None], leave: Callable[[], None], hard_exit: bool = True):
        self._close, self._leave, self._hard_exit = close, leave, hard_exit
        self._code: int | None = None
        atexit.register(self._exit_after_drain)

    def after_drain(self, record: StepRecord) -> None:
        if self._hard_exit:
            self._code = record.exit_code
        self._close()
        self._leave()
        raise SystemExit(record.exit_code)

    def release(self) -> None:
        """The Guard closes without a departure: the atexit hook goes."""
        if self._code is None:
            atexit.unregister(self._exit_after_drain)

    def _exit_after_drain(self) -> None:
        if self._code is not None:
            flush_and_exit(self._code)
