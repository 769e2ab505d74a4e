"""The deadline watchdog: one thread per rank, beside the notice listener, that makes sure a rank
leaves before its notice's deadline with the newest snapshot durable, whatever the main thread
is doing (a 40 s evaluation pass, a first compile, a collective waiting on a peer).

Contract (`DeadlineWatchdog`, made and driven by the Guard):
- `arm(notice)` (any thread): a notice with a deadline the Guard acts on or holds and that makes
  this rank leave (`concerns`: in place, a notice naming another host changes the group
  instead); the earliest deadline wins. `disarm(notice_id)`: withdrawn (the timer cancelled and
  the termination message written in advance emptied, unless the watchdog is acting already;
  armed again only when offered again or published again: `Rearming`). A
  SIGTERM is seen the moment it arrives (the signal's wakeup fd, read by this thread: the main
  thread need not run Python for it), and a notice another rank published through the store
  (`deadline_claims`) within one poll; withdrawn there (by the rank whose notice it was), it is
  disarmed here within one poll too.
- Once armed: the notice is published for the other ranks, a "failed" termination message is
  written in advance (never over the account of a boundary that answered first: a thread
  starved until after the departure arms late) and the last-resort timer (`exit_timer`,
  outside Python) is set to end the process with 84 at `deadline_policy.leave_by`.
- `completed(step)` / `resumed(start)`: the Guard's boundary and resume (an int stored: no cost).
- `dense` (`dense_snapshots.DenseSnapshots`): while a notice is armed and the Guard snapshots
  (`snapshot_every` > 0), each poll lets it settle the grid of denser snapshots every rank takes
  (the Guard's boundary asks it whether a step is due); a withdrawn or answered notice stops it.
- Each poll (`POLL` seconds, or sooner when the latest safe moment comes) follows
  `deadline_policy.plan` and the job-wide claim: nothing new to save (still, once a peer's
  boundary could have answered: `not_before`) -> claim LEAVE and leave with 83; the latest safe
  moment -> claim a persist of the held snapshot and, once every rank holds that step, persist
  it and leave (`deadline_exit`); a peer's claim is followed the same way; a BOUNDARY claim (the
  ranks agreed at a step boundary first) makes it stand down, its timer left armed in case that
  path never ends.
- `claim_boundary()` (main thread, at an agreed step on a notice): True when the agreed save may
  run; when a watchdog claimed first, the main thread waits here while the watchdog leaves.
  `answered(agreed)`: that agreed step answered the notice and this rank stays (an in-place
  change's survivor): the notice is disarmed for good.
- `departing()`: this rank's departure (`hooks/machine/departure.py`) is about to write its own
  account: from then on the watchdog arms nothing, acts on nothing and neither writes nor
  empties the termination message (a notice learned from the store after the departure wrote
  would replace the true account with a "failed" one, and its withdrawal would erase it); the
  timer stays. A departure no boundary claim answered, with a notice armed, claims the answer
  first (a watchdog's claim won: this rank's watchdog follows it and ends the process).
- The store holds the notices the ranks act on: a rank publishes only a notice its own Guard or
  signal armed (one learned there may have been withdrawn since its rank read it); a rank that
  published a notice withdraws it there when its Guard withdraws it, armed or not (replaced by
  one with an earlier deadline), and then publishes its armed notice in its place, all under
  one lock with its arming (a withdrawal never lands between a read and a publish).
- `close(exit_code)`: the Guard closes; the timer is re-armed with the rank's own exit code, so
  a process that hangs on its way out still leaves with it, or cancelled (None); the thread is
  joined (`CLOSE_JOIN` at most) and its descriptors closed. Only a Guard that ends its process
  (`hard_exit`) makes a watchdog: its timer ends the process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from spotguard.hooks import deadline_claims as claims_mod
from spotguard.hooks.deadline_claims import Claims, StoreClaims
from spotguard.hooks.deadline_exit import DeadlineExit, Progress
from spotguard.hooks.deadline_policy import Plan, leave_by, not_before, plan
from spotguard.hooks.dense_snapshots import DenseSnapshots
from spotguard.hooks.exit_timer import ExitTimer
from spotguard.hooks.group_session import default_group
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.signals import SignalTrap
from spotguard.hooks.termination_message import clear_termination_message, write_termination_message
from spotguard.wire.names import ENV_DEADLINE_WATCHDOG, EXIT_CHECKPOINT_FAILED
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.deadline")

POLL = 0.25  # seconds between looks at the store and the signal trap
CLOSE_JOIN = 1.0  # the longest `close()` waits for the thread to end


class DeadlineWatchdog:
    """See the module docstring."""

    def __init__(self, adapter: Callable[[], Any], margin: float, trap: SignalTrap | None = None,
                 reporter: HookReporter | None = None, claims: Callable[[], Claims] | None = None,
                 step_seconds: Callable[[], float] = lambda: 0.0, concerns: Callable[[Notice], bool] = lambda n: True,
                 snapshot_every: int = 0, answered: Callable[[str], bool] = lambda notice_id: False):
        self.adapter, self.margin, self.trap, self.step_seconds = adapter, margin, trap, step_seconds
        self.concerns, self.snapshot_every, self.is_answered = concerns, snapshot_every, answered
        self.progress = Progress()
        self.timer = ExitTimer()
        self._claims_for = claims or StoreClaims.for_default_group
        self._claims: Claims | None = None
        self._formation: Any = None
        self.exit = DeadlineExit(adapter, self.claims, self.timer, reporter)
        self.dense = DenseSnapshots(self.claims)
        self.notice: Notice | None = None
        self._armed_for: str | None = None
        self._armed_at = self._leave_at = 0.0
        self._acting = self._boundary_owns = self._departed = False
        self._rearming = Rearming()  # under `_arming`
        self._published: set[str] = set()  # ids this rank put in the store (only it withdraws them there)
        self._arming = threading.RLock()  # a disarm never lands between the message and the timer
        self._from_store: str | None = None  # the id of an armed notice this rank learned from the store alone
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._fds = [self._wake_r, self._wake_w]
        self._signal_fd = self._take_wakeup_fd()
        self._thread = threading.Thread(target=self._run, name="spotguard-deadline", daemon=True)

    def start(self) -> DeadlineWatchdog:
        self._thread.start()
        return self

    def claims(self) -> Claims:
        """The claims of the current formation (a re-formed group has a store of its own)."""
        formation = default_group()
        if self._claims is None or self._formation is not formation:
            self._claims, self._formation = self._claims_for(), formation
        return self._claims

    # ---- what the Guard tells it ------------------------------------------------------------------
    def arm(self, notice: Notice, *, from_store: bool = False) -> None:
        current = self.notice
        if notice.deadline is None or not self.concerns(notice) or self.is_answered(notice.id):
            return
        with self._arming:
            if not self._rearming.may_arm(notice.id, from_store):
                return
            if not from_store and self._from_store == notice.id:
                self._from_store = None  # this rank's Guard acts on it too: its own withdrawal decides
        if current is not None and current.deadline is not None and current.deadline <= notice.deadline:
            return
        self.notice = notice
        os.write(self._wake_w, b"a")

    def answered(self, agreed: Notice | None = None) -> None:
        """The agreed step answered notice `agreed` (None: the one armed now) and this rank stays
        (an in-place change): as `disarm`; never armed again, as the Guard's gate, which `answered`
        (the constructor's) asks, marked it answered."""
        self._boundary_owns = False
        notice = agreed if agreed is not None else self.notice
        if notice is not None:
            self.disarm(notice.id, share=False)

    def disarm(self, notice_id: str, share: bool = True) -> None:
        """A withdrawn notice: no last-resort exit, no termination message (unless the watchdog
        acts on it already: the rank is leaving then); `share`: withdrawn from the store too."""
        with self._arming:
            self._rearming.withdraw(notice_id)
            if self._acting or self._departed:
                return
            if self.notice is not None and self.notice.id == notice_id:
                self.notice = None
                self.dense.stop()
            if self._armed_for == notice_id:
                self._armed_for = None
                self.timer.cancel()
                clear_termination_message()
            if share and notice_id in self._published:  # armed or not (replaced by an earlier one)
                self._published.discard(notice_id)
                with contextlib.suppress(Exception):
                    self.claims().withdraw(notice_id)
                    self._publish_own()  # the notice it kept out of the store goes in its place

    def _publish_own(self) -> None:
        """Under `_arming`: publishes the armed notice when this rank's Guard or signal armed it
        (one learned from the store may have been withdrawn there since its rank read it)."""
        notice = self.notice
        if notice is not None and self._armed_for == notice.id and self._from_store != notice.id:
            self.claims().publish(notice)
            self._published.add(notice.id)

    def departing(self) -> None:
        """See the module docstring. A departure that no boundary claim answered (a membership
        change, a failed change's end) while a notice is armed claims the answer first: the
        watchdog then stands down; when a watchdog's claim won (this rank's or a peer's), this
        call waits for good (`claim_boundary`) while this rank's watchdog, not departed, follows
        that claim and ends the process."""
        with self._arming:
            if self._armed_for is None or self._boundary_owns:
                self._departed = True
                return
        self.claim_boundary()
        with self._arming:
            self._departed = True

    def completed(self, step: int) -> None:
        self.progress.complete(step)

    def resumed(self, start: int) -> None:
        self.progress.durable = start - 1 if start > 0 else None

    def claim_boundary(self) -> bool:
        """See the module docstring (blocks for good when a watchdog owns the answer)."""
        try:
            if self.claims().claim(claims_mod.BOUNDARY) == claims_mod.BOUNDARY:
                self._boundary_owns = True  # until `answered()`, even in a re-formed group
                return True
        except Exception as exc:  # no store to ask: the boundary goes ahead, as without a watchdog
            log.warning("deadline watchdog: the claim could not be made (%s): the agreed step saves", exc)
            return True
        log.warning("deadline watchdog answers the notice: the agreed step does not save again")
        while True:  # the watchdog's thread ends the process; its timer if it cannot
            time.sleep(1.0)

    def close(self, exit_code: int | None = None) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"c")
        if exit_code is not None and self._armed_for is not None:
            self.timer.arm(time.monotonic() + 5.0, exit_code)
        else:
            self.timer.cancel()
        self._give_back_wakeup_fd()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_JOIN)
        if not self._thread.is_alive():  # a thread still acting keeps its descriptors
            self._close_descriptors()

    def _close_descriptors(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._sleep(self._next_wake())
            if self._stop.is_set():
                return
            try:
                self._look()
            except Exception:  # a broken store must not end training; the timer still stands
                log.exception("deadline watchdog: poll failed")

    def _look(self) -> None:
        if self._departed:
            return
        self._pick_up_signal()
        if self.notice is None:
            shared = self.claims().shared_notice()
            self._saw_in_store(shared)
            if shared is not None:
                self.arm(shared, from_store=True)
                self._from_store = shared.id if self.notice is shared else None
        elif self._from_store == self.notice.id and not self._acting:
            armed = self.notice
            shared = self.claims().shared_notice()
            if shared is None or shared.id != armed.id:  # withdrawn by the rank that published it
                self.disarm(armed.id, share=False)
                self._saw_in_store(shared)
                return
        notice = self.notice
        if notice is None or notice.deadline is None:
            return
        deadline = notice.deadline.timestamp()
        self.progress.saw_persisted(self.adapter())
        if self._armed_for != notice.id and not self._arm_last_resort(notice, deadline):
            return
        if self.snapshot_every and not self._acting:
            self.dense.follow(notice.id, self.adapter(), self.progress.completed, self.step_seconds(),
                              self.snapshot_every)
        if self._boundary_owns:
            return
        claims = self.claims()
        winner = claims.winner()
        if winner == claims_mod.BOUNDARY:
            return
        if winner is None:
            adapter = self.adapter()
            decided = plan(time.time(), deadline, completed_step=self.progress.completed,
                           durable_step=self.progress.durable,
                           snapshot_step=getattr(adapter, "snapshot_step", None),
                           persist_estimate=self._persist_estimate(adapter), margin=self.margin,
                           earliest=not_before(self._armed_at, self.step_seconds()))
            if decided is Plan.LEAVE_NOW:
                winner = claims.claim(claims_mod.LEAVE)
            elif decided is Plan.PERSIST:
                winner = claims.claim(claims_mod.persist_claim(adapter.snapshot_step))
            else:
                return
        self._acting = winner == claims_mod.LEAVE or claims_mod.claimed_step(winner) is not None
        if winner == claims_mod.LEAVE:
            self.exit.hold_process()
            self.exit.leave_nothing_new(notice, deadline, self.progress)
        step = claims_mod.claimed_step(winner)
        if step is not None:
            self.exit.hold_process()
            self.exit.persist(step, notice, deadline, self._leave_at, self.progress)

    def _saw_in_store(self, shared: Notice | None) -> None:
        with self._arming:
            self._rearming.saw_in_store(shared.id if shared is not None else None)

    def _arm_last_resort(self, notice: Notice, deadline: float) -> bool:
        """Publishes `notice`, writes its termination message and arms the timer, all or nothing
        against a concurrent `disarm` (the Guard's thread): a withdrawal between the message and
        the timer left the timer armed and the rank exited 84 at a withdrawn notice. False: the
        notice was withdrawn first."""
        with self._arming:
            if self._departed or self._rearming.is_withdrawn(notice.id) or self.notice is not notice:
                return False
            self._armed_for, self._armed_at = notice.id, time.time()
            self._leave_at = leave_by(deadline, self._armed_at)
            with contextlib.suppress(Exception):
                self._publish_own()
            completed = self.progress.completed if self.progress.completed is not None else -1
            write_termination_message(notice.id, completed, completed, False,
                                      steps_lost=self.progress.lost_since(self.progress.durable),
                                      extra={"saved_by": "none", "why": "deadline"},
                                      exit_code=EXIT_CHECKPOINT_FAILED, in_advance=True)
            self.timer.arm(time.monotonic() + self._leave_at - time.time(), EXIT_CHECKPOINT_FAILED)
        log.warning("deadline watchdog armed for notice %s: the rank leaves by %.1fs from now at the latest",
                    notice.id, self._leave_at - time.time())
        return True

    @staticmethod
    def _persist_estimate(adapter: Any) -> float | None:
        if adapter is None or not hasattr(adapter, "save_parts"):
            return None
        return adapter.save_parts().persist

    def _next_wake(self) -> float:
        notice = self.notice
        if notice is None or notice.deadline is None or self._armed_for != notice.id:
            return POLL
        return max(min(POLL, self._leave_at - time.time()), 0.01)

    # ---- signals, seen while the main thread runs no Python --------------------------------------
    def _take_wakeup_fd(self) -> int | None:
        """This process's signal wakeup fd, when no one else holds it (main thread only)."""
        if self.trap is None or threading.current_thread() is not threading.main_thread():
            return None
        r, w = os.pipe()
        os.set_blocking(w, False)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:
            signal.set_wakeup_fd(-1)  # someone's (an event loop's): theirs, and the trap's own handler
            os.close(r)
            os.close(w)
            return None
        self._fds += [r, w]
        return r

    def _give_back_wakeup_fd(self) -> None:
        if self._signal_fd is not None and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(-1)

    def _sleep(self, seconds: float) -> None:
        fds = [self._wake_r] + ([self._signal_fd] if self._signal_fd is not None else [])
        ready, _, _ = select.select(fds, [], [], seconds)
        for fd in ready:
            data = os.read(fd, 64)
            if fd == self._signal_fd:
                self._signalled(data)

    def _signalled(self, data: bytes) -> None:
        trap = self.trap
        if trap is None:
            return
        for signum in data:
            trap.wakeup(signum)

    def _pick_up_signal(self) -> None:
        trap = self.trap
        if trap is not None and trap.received is not None:
            notice = trap.peek()
            if notice is not None:
                self.arm(notice)


class Rearming:
    """Which notice ids a watchdog may arm again (its caller holds its lock). A withdrawn id
    (`withdrawn`: id -> the store has shown it gone since) is armed again when the Guard offers
    it again (its gate acts on a withdrawn id offered again: a GPU fault read from a counter
    that cleared and came back keeps its id), or when the store publishes it again after this
    rank saw it gone there (a peer's Guard acts on it): never on a copy the store still held
    from before its withdrawal. (An answered id: the Guard's gate says, `answered`.)"""

    def __init__(self) -> None:
        self.withdrawn: dict[str, bool] = {}

    def withdraw(self, notice_id: str) -> None:
        self.withdrawn[notice_id] = False

    def is_withdrawn(self, notice_id: str) -> bool:
        return notice_id in self.withdrawn

    def may_arm(self, notice_id: str, from_store: bool) -> bool:
        seen_gone = self.withdrawn.get(notice_id)
        if seen_gone is None:
            return True
        if from_store and not seen_gone:
            return False
        del self.withdrawn[notice_id]
        return True

    def saw_in_store(self, shared_id: str | None) -> None:
        for nid in self.withdrawn:
            if nid != shared_id:
                self.withdrawn[nid] = True


def watchdog_enabled(env: dict[str, str] | None = None) -> bool:
    """The watchdog runs unless `SPOTGUARD_DEADLINE_WATCHDOG` is "0" (a Guard that ends the process
    on a drain and traps its signals; the Guard checks those)."""
    return (os.environ if env is None else env).get(ENV_DEADLINE_WATCHDOG, "1").strip() != "0"

