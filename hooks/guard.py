"""The Guard: one per training rank; turns a notice into the same checkpoint step on every rank.

Usage (every rank, after `init_process_group`, in the same order on every rank):

    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir="/ckpt")  # or DeepSpeedAdapter / PlainTorchAdapter
    guard = Guard.from_env(adapter=adapter)                # or guard.attach(adapter) later
    start = guard.resume()
    for step in range(start, total):
        train_one_step()
        guard.step(step)                                   # after step `step` is complete

The Guard keeps the configuration, takes notices in and registers hooks; at a boundary its
`agreement.Agreement` says whether the ranks act, and the agreed-step machine
(`hooks/machine`: `executor.AgreedStepMachine`) does the rest, a drain and an in-place change
alike, with the departure its one exit. The Guard hands the machine a narrow `Effects`, never
itself. The process's groups are its `group_session.GroupSession`; an agreement is bound to one
process group: a new formation gets new collectives and a new agreement (`rejoin`).

Contract:
- Notices arrive on a background thread (the sidecar's stream, `SPOTGUARD_SIDECAR_URL`) and from
  SIGTERM / extra signals (a `drain` notice, deadline = received + grace). Until one arrives the
  loop pays one `all_reduce(MAX)` of a preallocated 4-element CPU tensor every `agree_every`
  steps, on the formation's gloo control group (nothing at all in a single-process job;
  `agreement.control_group`: spotguard makes it with the adapters' checkpoint group once per
  formation, so no user code makes a group for spotguard, in whatever order). With
  `pipeline=True` that all_reduce runs in the background during the next step and is read at
  the next agreement (cost ~0; a notice is then acted on one agreement later).
- `piggyback_on(ddp_model)` (done by `attach` when the adapter's `gradient_carrier()` is a DDP
  model, as TorchDCPAdapter's is) carries the "notice pending here" flag as one extra element of
  the model's own last gradient bucket (a DDP communication hook): every rank reads the same count,
  and only when it is non-zero does the blocking agreement run. A step without a notice then costs
  no collective of the Guard's own, and a notice is still acted on at the boundary of the step it
  arrived in (or the next, if it came after that step's last bucket was sent).
- Kinds in `act_on` (default: everything but `rebalance`) are acted on; a notice whose id the
  resumed checkpoint already answered is ignored; a withdrawal clears a notice not yet agreed.
- A notice whose deadline is more than `horizon_seconds` away (default 120: AWS's lead time, so
  reclaims are acted on at once) is held and acted on only once its deadline comes that close:
  a maintenance announced an hour ahead does not stop training now, and one the cloud cancels
  meanwhile never does.
- Hold before leave (`replacement_hold`): when the newest pushed membership says `standby`
  (the supervisor asks for a noticed member's replacement at once), a reclaim or maintenance
  notice naming this rank's own host is held instead of agreed: the rank trains on until the
  membership that swaps it for its replacement is agreed (one in-place change), or until the
  latest safe moment (deadline - save estimate - one step - `save_margin_seconds` - 1 s), when
  it is acted on as any notice. Without the flag, without a deadline, without a measured save
  (no estimate), or with a deadline too short to hold, nothing changes.
- The agreement carries [any notice, earliest deadline, lowest rank holding one, newest pushed
  membership]; that rank broadcasts its notice (or, without one, the membership's holder its
  membership), so at the agreed step every rank acts on the same notice and deadline.
- At that step every rank: decides fresh save vs. persisting the last in-memory snapshot (a
  collective vote: the snapshot is used when any rank's estimate of a fresh save, from measured
  save times plus `save_margin_seconds`, does not fit before the deadline and every rank holds a
  snapshot of the same step); runs the adapter's save, then the `@on_reclaim` hooks
  (`hook(step, notice)`); agrees that every rank succeeded; reports `checkpoint-durable` (or
  `failed`) with the seconds taken to the sidecar; runs `@on_drain` hooks and reports `drained`;
  then writes its termination message and exits with `EXIT_PREEMPTED` (83), or
  `EXIT_CHECKPOINT_FAILED` (84) when any rank failed (`hooks/machine/departure.py`, for every
  rank that leaves: a drain, a leaving rank, a fallback).
  With `exit_on_drain=False`, `step()` returns a drained result instead of exiting (`last_drain`
  tells what happened).
- `step(step)` returns a `StepResult` (`hooks/step_result.py`): continued, resized (`.resize` is
  the change's record) or drained; its truth value is "drained", as the boolean it replaced.
  After a drain the process ends with that code even if torch's C++ teardown would abort:
  an atexit hook flushes logging/stdio and calls `os._exit(code)` (`hard_exit=False` disables it).
- Host memory: at its first step boundary, and at the first after an in-place change gave this
  rank another shard, the Guard allocates the adapter's snapshot buffers (`adapter.prepare()`
  through `adapters.base.prepare_at_boundary`, every rank at the same step): periodic snapshots,
  a notice's save and a change's checkpoint reuse them, and training code need not call it.
- `offer(notice)` hands the Guard a notice from elsewhere (the listener and signals use it too).
- `resume()` loads through the attached adapter and the `@on_resume` hooks and returns the step
  to start from (0 without a checkpoint).
- In place (`in_place=True`, default from `SPOTGUARD_IN_PLACE=1` as `spotguard launch` sets, and
  an adapter made with `build=`; `hooks/elastic`): a notice naming one host of the group, or a
  membership the supervisor pushes, changes the group instead of ending it. At the agreed step
  every change first writes the durable checkpoint of that step (a shrink as the notice's, a
  grow with the survivors' own save), then the leaving ranks hand over and exit 83 and the
  survivors re-form the group and continue from the next step in the same processes; a grow
  re-forms with the joiners, who receive the state from a live peer (`hooks/machine/table.py`
  is the change as one table). `step()` then returns a resized result (its `.resize` says what
  happened, with the pause; `last_resize` is deprecated), `rank`/`world_size` are the new
  group's, the `@on_resize` hooks run (`hook(record)`), and training code reads `adapter.model` /
  `adapter.optimizer` again. Any failure falls back to the drain (exit 83 with a durable
  checkpoint); a peer that stops answering costs the others at most one re-form timeout.
  In-place jobs make the model, then the adapter, then the Guard (the order a joiner repeats),
  and call `hooks.elastic.init_process_group()` instead of torch's. The collectives of a change
  are the Guard's alone, in one order on both sides (the table's `transferred` and `committed`
  rows end the survivors' change and a joiner's `resume()`); training code makes none of its own
  between `init_process_group` and a joiner's first step (the survivors are already training).
- The deadline watchdog (`hooks/deadline_watchdog.py`; a Guard that ends its process on a drain
  (`exit_on_drain`, `hard_exit`) and traps signals, unless `SPOTGUARD_DEADLINE_WATCHDOG=0`; a Guard
  embedded with `hard_exit=False` leaves its process's exit to its caller and has none): a notice
  whose deadline comes before the ranks agree at a boundary (a long step, an evaluation pass) is
  answered by persisting the held snapshot on every rank, which then leaves with 83 before the
  deadline (84 when nothing could be made durable); a notice with nothing new to save leaves
  within a second (at once before the Guard exists: `early_exit`). The boundary's agreed save
  and the watchdog never both run. While a notice is armed, a Guard that snapshots
  (`snapshot_every`) snapshots more often, on a grid every rank shares, as often as the measured
  copy allows (`snapshot_grid`, `dense_snapshots`): the watchdog's snapshot is that recent.
- Under `spotguard launch` (`SPOTGUARD_LAUNCHER_PID`), a rank whose launcher died leaves within
  `grace_seconds` even when blocked in a collective (`orphan_watch`).
- Bad configuration raises `spotguard.config.ConfigError` naming the field.
"""
from __future__ import annotations

import logging
import os
import signal as signal_module
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from spotguard.config import ConfigError, http_url, positive_float, positive_int
from spotguard.hooks.adapters.base import prepare_at_boundary, resizable_adapter
from spotguard.hooks.agreement import Agreement, make_agreement
from spotguard.hooks.agreement.collectives import Collectives, GroupCollectives
from spotguard.hooks import early_exit
from spotguard.hooks.deadline_watchdog import DeadlineWatchdog, watchdog_enabled
from spotguard.hooks.elastic.join import in_place_enabled
from spotguard.hooks.elastic.membership_view import MembershipView
from spotguard.hooks.group_session import process_session
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.machine.departure import ExitProcess, ReturnToLoop
from spotguard.hooks.machine.effects import Effects, Hooks
from spotguard.hooks.machine.executor import AgreedStepMachine
from spotguard.hooks.machine.model import DrainRecord, StepRecord
from spotguard.hooks.notice_gate import ACT_ON, Action, NoticeGate
from spotguard.hooks.notice_listener import NoticeListener
from spotguard.hooks.orphan_watch import OrphanWatch
from spotguard.hooks.replacement_hold import HOLD_MARGIN_SECONDS, release_at
from spotguard.hooks.signals import SignalTrap
from spotguard.hooks.step_result import CONTINUED, StepResult
from spotguard.wire import names, notice_policy
from spotguard.wire.notice import Kind, Notice, now_utc

if TYPE_CHECKING:
    from spotguard.hooks.adapters.base import CheckpointAdapter

__all__ = ["ACT_ON", "DrainRecord", "Guard", "StepResult"]

log = logging.getLogger("spotguard.hooks.guard")

early_exit.install_at_import()  # a notice while the model is built: exit 83 at once, nothing lost


class Guard:
    """One per rank. See the module docstring for the contract."""

    def __init__(self, *, adapter: CheckpointAdapter | None = None, sidecar_url: str | None = None,
                 token_file: str | None = None, grace_seconds: float = 30.0, agree_every: int = 1,
                 extra_signals: Iterable[int] = (), snapshot_every: int = 0, save_margin_seconds: float = 1.0,
                 act_on: Iterable[Kind | str] = ACT_ON, exit_on_drain: bool = True, process_group: Any = None,
                 install_signals: bool = True, hard_exit: bool = True, pipeline: bool = False,
                 horizon_seconds: float = notice_policy.HORIZON_SECONDS, in_place: bool | None = None):
        self.grace_seconds = positive_float("grace_seconds", grace_seconds)
        self.agree_every = positive_int("agree_every", agree_every)
        self.snapshot_every = positive_int("snapshot_every", snapshot_every, allow_zero=True)
        self.save_margin_seconds = positive_float("save_margin_seconds", save_margin_seconds, allow_zero=True)
        try:
            kinds = frozenset(Kind(k) for k in act_on)
        except ValueError as exc:
            raise ConfigError("act_on", str(exc)) from None
        self.gate = NoticeGate(kinds, positive_float("horizon_seconds", horizon_seconds),
                               hold=self._hold_for_replacement)
        self._step_seconds = 0.0  # a decaying maximum of the time between step boundaries
        self._last_boundary: float | None = None
        self.exit_on_drain = exit_on_drain
        self.pipeline = pipeline
        self.sidecar_url = None if sidecar_url is None else http_url(names.ENV_SIDECAR_URL, sidecar_url)
        self.hooks = Hooks()
        self.adapter: CheckpointAdapter | None = None

        self.session = process_session()
        self._process_group = process_group
        self.collectives: Collectives = self.session.collectives(process_group)
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.agreement: Agreement = make_agreement(self.collectives, agree_every=self.agree_every, pipeline=pipeline)
        self.reporter = (HookReporter(self.sidecar_url, token_file, self.rank, self.world_size)
                         if self.sidecar_url else None)
        departure = (ExitProcess(self.close, self.session.leave, hard_exit) if exit_on_drain else ReturnToLoop())
        effects = Effects(lambda: self.adapter, lambda: self.collectives, self.rejoin, self.gate.answered, self.close,
                          self.hooks, self.reporter, self.save_margin_seconds,
                          lambda: self.deadline.departing() if self.deadline is not None else None)
        in_place = in_place_enabled() if in_place is None else in_place
        self.machine = AgreedStepMachine(self.session, effects, MembershipView.from_env() if in_place else None,
                                         departure)
        self.machine.learn()

        self._trap: SignalTrap | None = None
        if install_signals:
            self._trap = SignalTrap(self.grace_seconds, (signal_module.SIGTERM, *extra_signals))
        self.deadline = (DeadlineWatchdog(lambda: self.adapter, self.save_margin_seconds, self._trap, self.reporter,
                                          step_seconds=lambda: self._step_seconds, concerns=self._makes_this_rank_leave,
                                          snapshot_every=self.snapshot_every, answered=self.gate.is_answered).start()
                         if exit_on_drain and hard_exit and install_signals and watchdog_enabled() else None)
        if self._trap is not None:  # after the watchdog took the wakeup fd: both see every delivery
            self._trap.install()
        self._dense = self.deadline.dense if self.deadline is not None else None  # denser snapshots on a notice
        self._orphan_watch = OrphanWatch.from_env(self.grace_seconds)
        if self._orphan_watch is not None:
            self._orphan_watch.start()
        self.listener: NoticeListener | None = None
        if self.sidecar_url:
            self.listener = NoticeListener(self.sidecar_url, self.offer, self.withdraw,
                                           on_membership=self.view.offer if self.view is not None else None)
            self.listener.start()
        if adapter is not None:
            self.attach(adapter)

    @classmethod
    def from_env(cls, grace_seconds: float | None = None, agree_every: int | None = None, **kwargs) -> Guard:
        """A Guard configured from SPOTGUARD_* variables (docs/protocols.md); arguments win over them."""
        env = os.environ
        url = env.get(names.ENV_SIDECAR_URL) or None
        if grace_seconds is None:
            grace_seconds = positive_float(names.ENV_GRACE_SECONDS, env.get(names.ENV_GRACE_SECONDS) or 30)
        if agree_every is None:
            agree_every = positive_int(names.ENV_AGREE_EVERY, env.get(names.ENV_AGREE_EVERY) or 1)
        if "horizon_seconds" not in kwargs and env.get(names.ENV_HORIZON_SECONDS):
            kwargs["horizon_seconds"] = positive_float(names.ENV_HORIZON_SECONDS, env[names.ENV_HORIZON_SECONDS])
        kwargs.setdefault("sidecar_url", url)
        kwargs.setdefault("token_file", env.get(names.ENV_TOKEN_FILE) or None)
        return cls(grace_seconds=grace_seconds, agree_every=agree_every, **kwargs)

    @property
    def view(self) -> MembershipView | None:
        """The membership view of an in-place Guard (None otherwise)."""
        return self.machine.view

    @property
    def last_drain(self) -> StepRecord | None:
        """The newest agreed step that wrote a notice's checkpoint or left (a drain, a shrink, a fallback)."""
        return self.machine.last_drain

    @property
    def resizes(self) -> list[StepRecord]:
        """Every in-place change of this process, in order (`outcome` says how it ended)."""
        return self.machine.resizes

    @property
    def last_resize(self) -> StepRecord | None:
        """Deprecated: `step()` returns the change (`result.resized`, `result.resize`)."""
        warnings.warn("guard.last_resize is deprecated: use the result of guard.step(step) "
                      "(`if result.resized: record = result.resize`)", DeprecationWarning, stacklevel=2)
        return self.resizes[-1] if self.resizes else None

    def piggyback_on(self, ddp_model: Any) -> bool:
        """Carries the agreement flag inside `ddp_model`'s gradient all_reduce (see the module
        docstring). Every rank calls it once, before the first backward. Returns False (and the
        Guard keeps its own agreement) when not distributed, pipelined, or the model takes no hook."""
        if not isinstance(self.collectives, GroupCollectives) or self.pipeline:
            return False
        from spotguard.hooks.agreement.piggyback import PiggybackAgreement

        agreement = PiggybackAgreement.attach(self.collectives, ddp_model, self._notice_here)
        if agreement is None:
            return False
        self.agreement.close()
        self.agreement = agreement
        return True

    def _notice_here(self) -> bool:
        """A pending notice or membership, or a caught signal (step() turns it into the notice
        before agreeing)."""
        return (self.gate.pending is not None or (self._trap is not None and self._trap.received is not None)
                or (self.view is not None and self.view.pending_notice() is not None))

    # ---- registration ---------------------------------------------------------------------
    def on_reclaim(self, fn: Callable) -> Callable:
        """Decorator: `fn(step, notice)` on every rank at the agreed step, on its group: after the write
        is durable, or while it commits in an in-place shrink ahead (machine/table.py)."""
        self.hooks.reclaim.append(fn)
        return fn

    def on_drain(self, fn: Callable) -> Callable:
        """Decorator: `fn(step, notice)` runs on every rank that leaves, after the checkpoint is durable."""
        self.hooks.drain.append(fn)
        return fn

    def on_resume(self, fn: Callable) -> Callable:
        """Decorator: `fn()` runs in `resume()`; a non-None return is the step to start from."""
        self.hooks.resume.append(fn)
        return fn

    def on_resize(self, fn: Callable) -> Callable:
        """Decorator: `fn(record)` runs on every rank of the new group after an in-place change."""
        self.hooks.resize.append(fn)
        return fn

    def on_resize_phase(self, fn: Callable) -> Callable:
        """Decorator: `fn(phase, record)` runs as each phase of an in-place change ends (timelines, tests)."""
        self.hooks.phase.append(fn)
        return fn

    def attach(self, adapter: CheckpointAdapter) -> None:
        """Makes `adapter` the checkpoint of this job (every rank, before the first backward); the
        agreement rides on the adapter's `gradient_carrier()` when it offers one."""
        if self.adapter is not None:
            if self.adapter is adapter:
                return
            raise ValueError("the Guard already has an adapter")
        self.adapter = adapter
        carrier = adapter.gradient_carrier()
        if carrier is not None:
            self.piggyback_on(carrier)

    def resume(self) -> int:
        """Loads the newest checkpoint (adapter, then @on_resume hooks); the step to start from.
        A joiner receives the state of a live peer instead (no storage read, no @on_resume hooks)."""
        if self.view is not None and self.session.owes_state():
            if resizable_adapter(self.adapter) is None:
                raise RuntimeError("a joiner needs a resizable adapter before resume(): "
                                   "TorchDCPAdapter(..., build=...) or DeepSpeedAdapter(..., in_place=True)")
            return self.machine.join()
        start = 0
        if self.adapter is not None:
            loaded = self.adapter.resume()
            if loaded is not None:
                start = loaded
            answered = self.adapter.answered_notice_id()
            if answered:
                self.gate.answered(answered)
        for hook in self.hooks.resume:
            value = hook()
            if value is not None:
                start = int(value)
        if self.deadline is not None:
            picked = getattr(self.adapter, "resumed_step", None)  # a framework that resumes itself (the Trainer)
            self.deadline.resumed(start if start or picked is None else picked + 1)
        return start

    # ---- notices in -----------------------------------------------------------------------
    def offer(self, notice: Notice) -> None:
        """Hands the Guard a notice (thread-safe; the listener and the signal trap use it)."""
        decision = self.gate.offer(notice, now_utc())
        if decision.action is Action.IGNORE:
            if decision.why == "kind":
                log.info("notice %s (%s) noted, not acted on (act_on: %s)", notice.id, notice.kind,
                         ", ".join(sorted(k.value for k in self.gate.act_on)))
            else:
                log.info("notice %s was already answered by the checkpoint this job resumed from", notice.id)
        elif decision.action is Action.HOLD:
            if decision.why == "replacement" and decision.release_ts is not None:
                log.warning("notice %s (%s): its replacement is on its way; training on until it joins, at the "
                            "latest for %.1fs (then the checkpoint still fits before the deadline)", notice.id,
                            notice.kind, decision.release_ts - time.time())
            elif decision.why == "new":
                log.warning("notice %s (%s) is due in %.0fs: held until %.0fs before its deadline",
                            notice.id, notice.kind, decision.seconds_left, self.gate.horizon_seconds)
        else:
            self._log_acting(notice)
        if decision.action is not Action.IGNORE and self.deadline is not None:
            self.deadline.arm(notice)

    def _makes_this_rank_leave(self, notice: Notice) -> bool:
        """In place, a notice naming another host changes the group and this rank stays."""
        return self.view is None or not notice.node or notice.node == self.view.node

    def _hold_for_replacement(self, notice: Notice, now: datetime) -> float | None:
        """When a notice on this rank's own host is released while its warm-standby replacement
        is on its way (`replacement_hold.release_at`); None: act on it now, as without a hold."""
        view = self.view
        if view is None or not notice_policy.answered_by_standby(notice) or notice.node != view.node:
            return None
        estimate = self.adapter.estimate_save_seconds() if self.adapter is not None else None
        return release_at(now=now.timestamp(), deadline=notice.deadline.timestamp() if notice.deadline else None,
                          replacement_coming=view.standby, save_estimate=estimate, step_seconds=self._step_seconds,
                          margin_seconds=self.save_margin_seconds + HOLD_MARGIN_SECONDS)

    @staticmethod
    def _log_acting(notice: Notice) -> None:
        log.warning("notice %s (%s, deadline %s): checkpoint at the next agreed step", notice.id, notice.kind,
                    notice.deadline.isoformat() if notice.deadline else "none")

    def withdraw(self, notice_id: str) -> None:
        """Drops a notice the ranks have not agreed on yet (thread-safe)."""
        if self.deadline is not None:
            self.deadline.disarm(notice_id)
        for where in self.gate.withdraw(notice_id):
            log.warning("notice %s withdrawn %s: training continues", notice_id,
                        "while held" if where == "held" else "before the ranks agreed on it")
        if self.deadline is not None and self.gate.pending is not None:
            self.deadline.arm(self.gate.pending)  # the notice that waited behind it

    # ---- the step boundary ----------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        """Call after step `step` on every rank; what happened at this boundary (module docstring)."""
        boundary = time.monotonic()
        if self._last_boundary is not None:
            self._step_seconds = max(boundary - self._last_boundary, 0.9 * self._step_seconds)
        self._last_boundary = boundary
        if self.deadline is not None:
            self.deadline.completed(step)
        prepare_at_boundary(self.adapter)  # the snapshot buffers: at the first boundary, and the first after a change
        trap = self._trap
        if trap is not None and trap.received is not None:
            notice = trap.take()
            if notice is not None:
                self.offer(notice)
        if self.gate.holding:
            for notice in self.gate.release_due(now_utc()):
                self._log_acting(notice)
        membership = self.view.pending_notice() if self.view is not None else None
        verdict = self.agreement.at_boundary(step, self.gate.pending, membership)
        if verdict is not None:
            if verdict.on_notice and self.deadline is not None:
                self.deadline.claim_boundary()  # blocks for good when the deadline watchdog answers it
            result = self.machine.run(step, verdict)  # a rank that leaves does not return
            if verdict.on_notice and self.deadline is not None:
                self.deadline.answered(getattr(result.resize or result.drain, "notice", None))  # this rank stays
            return result
        dense, every = self._dense, self.snapshot_every  # dense.grid is set only while a notice is armed
        if every and self.adapter is not None and (
                dense.due(step, every) if dense is not None and dense.grid is not None else step % every == 0):
            self.adapter.snapshot(step)
        return CONTINUED

    def rejoin(self) -> None:
        """The Guard's collectives, agreement and reporter on the session's new formation (collective)."""
        self.agreement.close()
        if self._dense is not None:
            self._dense.end()  # the joiners know no grid
        self.collectives = self.session.collectives(self._process_group)
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.agreement = make_agreement(self.collectives, agree_every=self.agree_every, pipeline=self.pipeline)
        if self.reporter is not None:
            self.reporter.rank, self.reporter.world_size = self.rank, self.world_size
        carrier = self.adapter.gradient_carrier() if self.adapter is not None else None
        if carrier is not None:
            self.piggyback_on(carrier)

    def close(self) -> None:
        """Stops the listener, restores signal handlers, closes the agreement and the adapter."""
        self.agreement.close()
        if self.listener is not None:
            self.listener.stop()
        if self._trap is not None:
            self._trap.uninstall()
        if self._orphan_watch is not None:
            self._orphan_watch.stop()
        if self.deadline is not None:
            self.deadline.close(self.last_drain.exit_code if self.last_drain is not None else None)
        if self.adapter is not None:
            self.adapter.close()
        self.machine.departure.release()
