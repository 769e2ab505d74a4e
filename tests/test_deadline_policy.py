"""The deadline watchdog's pure policy (hooks/deadline_policy.py) as tables, and its last-resort
exit timer (hooks/exit_timer.py) in a real process whose main thread holds the GIL in a C call."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from datetime import timedelta

import pytest
import torch.distributed as dist

from spotguard.hooks.deadline_claims import LocalClaims, StoreClaims, claimed_step, persist_claim
from spotguard.hooks.deadline_exit import Progress
from spotguard.wire.notice import Notice, now_utc
from spotguard.hooks.deadline_policy import (BOUNDARY_SECONDS, DEFAULT_PERSIST, EXIT_RESERVE, FINISH_SECONDS, MIN_LEAD,
                                             Plan, act_at, leave_by, new_work, not_before, plan)

D = 1000.0  # a deadline


@pytest.mark.parametrize("estimate, margin, before_the_reserves", [
    (None, 1.0, D - DEFAULT_PERSIST - 1.0),  # never measured: the default
    (2.0, 1.0, D - 2.5 - 1.0),                # 1.25 x the measured persist
    (0.0, 0.0, D),
    (4.0, -3.0, D - 5.0),                     # a negative margin counts as none
])
def test_act_at(estimate, margin, before_the_reserves):
    assert act_at(D, estimate, margin) == pytest.approx(before_the_reserves - FINISH_SECONDS - EXIT_RESERVE)


@pytest.mark.parametrize("armed_at, expected", [
    (D - 30, D - EXIT_RESERVE),    # the deadline's own
    (D - 2, D - 2 + MIN_LEAD),     # a notice that came too late still gets MIN_LEAD
    (D + 1, D + 1 + MIN_LEAD),
])
def test_leave_by(armed_at, expected):
    assert leave_by(D, armed_at) == expected


@pytest.mark.parametrize("step_seconds, expected", [(0.05, BOUNDARY_SECONDS), (0.0, BOUNDARY_SECONDS), (2.0, 6.0)])
def test_not_before_leaves_the_boundary_a_few_steps(step_seconds, expected):
    assert not_before(100.0, step_seconds) == 100.0 + expected


@pytest.mark.parametrize("completed, durable, expected", [
    (None, None, False),  # nothing trained in this process
    (None, 41, False),    # resumed, first step not done
    (41, 41, False),      # the newest step is durable (a save_async of it committed)
    (42, 41, True),
    (0, None, True),      # a first run's first step
])
def test_new_work(completed, durable, expected):
    assert new_work(completed, durable) is expected


LATE = act_at(D, 1.0, 1.0)


@pytest.mark.parametrize("now, completed, durable, snapshot, expected, earliest", [
    (0.0, None, 10, None, Plan.LEAVE_NOW, 0.0),             # nothing new: at once, however early
    (0.0, 10, 10, 10, Plan.LEAVE_NOW, 0.0),
    (LATE - 0.1, 12, 10, 12, Plan.WAIT, 0.0),               # new work, the boundary may still come
    (LATE, 12, 10, 12, Plan.PERSIST, 0.0),                  # the latest safe moment
    (D, 12, 10, 12, Plan.PERSIST, 0.0),                     # past it: still the best there is
    (LATE, 12, 10, None, Plan.NOTHING_TO_PERSIST, 0.0),     # no snapshot taken
    (LATE, 12, 10, 10, Plan.NOTHING_TO_PERSIST, 0.0),       # the snapshot is the durable step already
    (LATE, 12, None, 8, Plan.PERSIST, 0.0),                 # nothing durable yet: any snapshot helps
    (LATE, 12, 10, 12, Plan.WAIT, LATE + 1),           # past the latest moment, the boundary may still come
    (0.0, 10, 10, 10, Plan.WAIT, 5.0),                 # nothing new here: a peer's boundary may answer it
    (5.0, None, None, None, Plan.LEAVE_NOW, 5.0),      # still nothing new here by `earliest`: leave
])
def test_plan(now, completed, durable, snapshot, expected, earliest):
    assert plan(now, D, completed_step=completed, durable_step=durable, snapshot_step=snapshot,
                persist_estimate=1.0, margin=1.0, earliest=earliest) is expected


def test_the_first_claim_wins_for_every_later_one():
    claims = LocalClaims()
    assert claims.winner() is None
    assert claims.claim(persist_claim(6)) == "persist:6"
    assert claims.claim("boundary") == "persist:6"
    assert claimed_step(claims.winner()) == 6 and claimed_step("boundary") is None


def exit_status(body: str) -> int:
    script = "import ctypes, time\nfrom spotguard.hooks.exit_timer import ExitTimer\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], timeout=60).returncode


def test_the_exit_timer_ends_a_process_whose_main_thread_holds_the_gil_in_a_c_call():
    # PyDLL keeps the GIL across the call: no Python thread or signal handler runs until it returns
    assert exit_status("""
        timer = ExitTimer()
        assert timer.native
        timer.arm(time.monotonic() + 60, 83)
        timer.arm(time.monotonic() + 0.2, 84)   # re-armed: the new time and code
        ctypes.PyDLL(None).sleep(30)
    """) == 84


def test_a_cancelled_exit_timer_never_fires():
    assert exit_status("""
        timer = ExitTimer()
        timer.arm(time.monotonic() + 0.2, 84)
        timer.cancel()
        time.sleep(0.5)
    """) == 0


def test_a_withdrawn_notice_disarms_the_last_resort_and_empties_the_message(tmp_path):
    """Armed (the message written in advance, the timer set for 5 s on), then withdrawn: the
    process outlives the timer's time with its own exit status and an empty message (a copy
    offered again after the withdrawal is armed again, as the Guard's gate acts on it again:
    the test below). The withdrawal comes while the watchdog
    is between writing the message and arming the timer (held there for a second): the timer it
    then arms is cancelled too (it fired at 5 s, exit 84, before arming was made atomic)."""
    message = tmp_path / "termination-log"
    script = textwrap.dedent(f"""
        import os, time
        from datetime import timedelta
        os.environ["SPOTGUARD_TERMINATION_LOG"] = {str(message)!r}
        import spotguard.hooks.deadline_watchdog as deadline_watchdog
        from spotguard.hooks.deadline_watchdog import DeadlineWatchdog
        write = deadline_watchdog.write_termination_message
        def write_then_pause(*args, **kwargs):
            write(*args, **kwargs)
            time.sleep(1.0)
        deadline_watchdog.write_termination_message = write_then_pause
        from spotguard.wire.notice import Notice, now_utc
        watchdog = DeadlineWatchdog(lambda: None, 1.0).start()
        watchdog.completed(5)  # new work, no snapshot: only the timer could end it
        now = now_utc()
        notice = Notice(id="aws.spot:w", kind="reclaim", source="aws.spot", node="n", detected_at=now,
                        deadline=now + timedelta(seconds=1))
        watchdog.arm(notice)
        end = time.monotonic() + 30
        while not os.path.getsize({str(message)!r}) if os.path.exists({str(message)!r}) else True:
            assert time.monotonic() < end
            time.sleep(0.02)
        watchdog.disarm("aws.spot:w")
        time.sleep(6.5)
        raise SystemExit(7)
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 7
    assert message.read_text() == ""


def test_a_watchdog_that_arms_after_the_boundary_departed_keeps_the_boundarys_account(tmp_path):
    """The boundary answered the notice and wrote its termination message ("boundary", exit 83)
    before the watchdog's thread, starved on a loaded machine, first looked at the notice: the
    watchdog still arms its last resort but its advance "failed" message does not replace the
    account (ci: a Lightning drain reported as "saved by ['boundary', 'none']"). A message of
    another notice is replaced."""
    message = tmp_path / "termination-log"
    script = textwrap.dedent(f"""
        import json, logging, os, time
        from datetime import timedelta
        os.environ["SPOTGUARD_TERMINATION_LOG"] = {str(message)!r}
        from spotguard.hooks.deadline_watchdog import DeadlineWatchdog
        from spotguard.hooks.termination_message import departure_account, write_termination_message
        from spotguard.wire.notice import Notice, now_utc
        now = now_utc()
        def notice(nid):
            return Notice(id=nid, kind="reclaim", source="aws.spot", node="n", detected_at=now,
                          deadline=now + timedelta(seconds=30))
        armed_for = []  # the watchdog logs "armed" once its message is written and its timer set
        class Armed(logging.Handler):
            def emit(self, record):
                armed_for.append(record.args[0] if "armed for notice" in record.msg else None)
        logging.getLogger("spotguard.hooks.deadline").addHandler(Armed())
        def armed(watchdog, nid):
            end = time.monotonic() + 30
            while nid not in armed_for:
                assert time.monotonic() < end
                time.sleep(0.01)
            return json.loads(open({str(message)!r}).read())
        write_termination_message("aws.spot:b", 9, 9, True, exit_code=83,
                                  extra=departure_account("boundary", 9, 9, 20.0))
        watchdog = DeadlineWatchdog(lambda: None, 1.0).start()
        watchdog.completed(9)
        watchdog.arm(notice("aws.spot:b"))
        kept = armed(watchdog, "aws.spot:b")
        assert (kept["saved_by"], kept["exit_code"], kept["checkpoint"]) == ("boundary", 83, "durable"), kept
        watchdog.close(None)
        other = DeadlineWatchdog(lambda: None, 1.0).start()
        other.completed(9)
        other.arm(notice("aws.spot:c"))
        replaced = armed(other, "aws.spot:c")
        assert (replaced["notice_id"], replaced["saved_by"], replaced["checkpoint"]) == ("aws.spot:c", "none", "failed")
        other.close(None)
        raise SystemExit(7)
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert result.returncode == 7, result.stderr[-3000:]


@pytest.mark.parametrize("stalls, why", [("in-flight", "async-abandoned"), ("persist", "persist-late")])
def test_a_watchdog_starved_past_its_latest_exit_leaves_the_true_account(tmp_path, stalls, why):
    """The watchdog waits for an async save in flight, or for its persist, until its latest exit;
    its thread then does not run again before the last-resort timer fires (a loaded machine: ci7
    found the message still the advance "deadline" one). The process ends with 84 and the
    message says why: written before the wait, since nothing can be written at the timer's exit."""
    message = tmp_path / "termination-log"
    script = textwrap.dedent(f"""
        import os, time
        from concurrent.futures import Future
        from datetime import timedelta
        os.environ["SPOTGUARD_TERMINATION_LOG"] = {str(message)!r}
        from spotguard.hooks.deadline_claims import LocalClaims
        from spotguard.hooks.deadline_exit import DeadlineExit, Progress
        from spotguard.hooks.exit_timer import ExitTimer
        from spotguard.wire.notice import Notice, now_utc

        class Stalled(Future):  # a wait whose thread is not scheduled again in time
            def result(self, timeout=None):
                time.sleep(60)

        class Engine:
            def in_flight(self):
                return Stalled() if {stalls!r} == "in-flight" else None

        class Adapter:
            snapshot_step, snapshot_engine = 6, Engine()
            def snapshot_durable(self):
                return False
            def persist_snapshot_behind(self, **kwargs):
                return None, Stalled()

        timer = ExitTimer()
        leave_at = time.time() + 2.0
        timer.arm(time.monotonic() + 2.0, 84)
        progress = Progress(completed=7, durable=0, trained=7)
        now = now_utc()
        notice = Notice(id="aws.spot:s", kind="reclaim", source="aws.spot", node="n", detected_at=now,
                        deadline=now + timedelta(seconds=4))
        claims = LocalClaims()
        DeadlineExit(Adapter, lambda: claims, timer).persist(6, notice, leave_at + 2.0, leave_at, progress)
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 84
    account = json.loads(message.read_text())
    assert (account["checkpoint"], account["why"], account["steps_lost"], account["exit_code"]) == \
        ("failed", why, 7, 84), account
    assert account.get("async_save") == ("abandoned" if stalls == "in-flight" else None), account
    assert account["margin_seconds"] == pytest.approx(2.0, abs=0.01)


def test_steps_lost_with_no_checkpoint_known_are_the_steps_this_process_trained():
    progress = Progress()
    assert progress.lost_since(None) == 0
    for step in (1, 2, 3):  # the Trainer's global steps count from 1
        progress.complete(step)
    assert progress.lost_since(None) == 3 and progress.lost_since(2) == 1 and progress.lost_since(3) == 0


def test_a_notice_learned_from_the_store_is_disarmed_when_its_rank_withdraws_it(tmp_path):
    """Rank 0 arms rank 1's notice from the shared store (a real TCPStore); rank 1 withdraws it
    there: rank 0's watchdog disarms within a poll (message emptied, timer cancelled) and the
    process outlives the timer's time with its own exit status."""
    message = tmp_path / "termination-log"
    script = textwrap.dedent(f"""
        import os, time
        from datetime import timedelta
        os.environ["SPOTGUARD_TERMINATION_LOG"] = {str(message)!r}
        import torch.distributed as dist
        from spotguard.hooks.deadline_claims import StoreClaims
        from spotguard.hooks.deadline_watchdog import DeadlineWatchdog
        from spotguard.wire.notice import Notice, now_utc
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        mine, theirs = StoreClaims(store, 0, 2), StoreClaims(store, 1, 2)
        watchdog = DeadlineWatchdog(lambda: None, 1.0, claims=lambda: mine).start()
        watchdog.completed(5)  # new work, no snapshot: only the timer could end it
        now = now_utc()
        theirs.publish(Notice(id="aws.spot:r1", kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                              deadline=now + timedelta(seconds=1)))
        end = time.monotonic() + 30
        while not (os.path.exists({str(message)!r}) and os.path.getsize({str(message)!r})):
            assert time.monotonic() < end, "never armed from the store"
            time.sleep(0.02)
        armed = time.monotonic()
        theirs.withdraw("aws.spot:r1")
        while os.path.getsize({str(message)!r}):
            assert time.monotonic() < end, "never disarmed"
            time.sleep(0.02)
        time.sleep(max(armed + 6.5 - time.monotonic(), 0))  # past the last-resort timer's time
        # os._exit: the TCPStore server's C++ thread can abort an ordinary interpreter exit
        # ("terminate called without an active exception", -6 in ci on 923d249)
        os._exit(7)
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 7
    assert message.read_text() == ""


def test_a_notice_after_a_withdrawn_one_reaches_the_other_ranks():
    """A rank's notice is withdrawn (a canceled maintenance), then a reclaim comes to the same
    rank in the same formation: the reclaim is published too (a real TCPStore), so the other
    ranks' watchdogs learn its deadline while their main threads are busy. It was not: a rank
    published once per formation, and the others never learned of the second notice."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    mine, theirs = StoreClaims(store, 0, 2), StoreClaims(store, 1, 2)
    now = now_utc()

    def notice(nid: str, seconds: float) -> Notice:
        return Notice(id=nid, kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                      deadline=now + timedelta(seconds=seconds))

    theirs.publish(notice("aws.spot:maintenance", 3600))
    mine.publish(notice("aws.spot:mine", 60))  # the first notice stays the shared one
    assert mine.shared_notice().id == "aws.spot:maintenance"
    theirs.withdraw("aws.spot:maintenance")
    assert mine.shared_notice() is None
    theirs.publish(notice("aws.spot:reclaim", 120))
    assert mine.shared_notice().id == "aws.spot:reclaim"


def store_script(message: Path, body: str) -> str:
    """A script for a subprocess (arming sets a real exit timer): the termination message at
    `message`, a real TCPStore, this rank's claims `mine` and a peer's `theirs` on it, `now`;
    then `body`."""
    return textwrap.dedent(f"""
        import json, os, time
        from datetime import timedelta
        os.environ["SPOTGUARD_TERMINATION_LOG"] = {str(message)!r}
        import torch.distributed as dist
        from spotguard.hooks.deadline_claims import LEAVE, StoreClaims
        from spotguard.hooks.deadline_watchdog import DeadlineWatchdog
        from spotguard.hooks.termination_message import write_termination_message
        from spotguard.wire.notice import Notice, now_utc
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        mine, theirs = StoreClaims(store, 0, 2), StoreClaims(store, 1, 2)
        now = now_utc()
    """) + textwrap.dedent(body)


def test_a_withdrawn_notice_that_comes_back_is_armed_again_and_a_stale_copy_is_not(tmp_path):
    """A GPU fault read from a counter clears (withdrawn) and comes back with the same id. The
    Guard's gate acts on it again, so the watchdog arms it again: when the store publishes it
    again after this rank saw it gone there (a peer's Guard acts on it), and when this rank's
    Guard offers it again. It was never armed again, so a long step in the second fault had no
    last resort and the other ranks could not persist with its rank. A real TCPStore; the
    watchdog's thread is not started, so the test decides when it looks."""
    message = tmp_path / "termination-log"
    script = store_script(message, f"""
        from spotguard.hooks.notice_gate import NoticeGate
        gate = NoticeGate()  # the Guard's: its answered ids are never armed
        watchdog = DeadlineWatchdog(lambda: None, 1.0, claims=lambda: mine, answered=gate.is_answered)
        watchdog.completed(5)  # new work, no snapshot: it waits for the latest safe moment, minutes away
        fault = Notice(id="gpu:xid-79", kind="gpu-fault", source="gpu", node="n1", detected_at=now,
                       deadline=now + timedelta(seconds=600))
        def armed():
            return watchdog.notice is not None and watchdog.notice.id == fault.id
        theirs.publish(fault)
        watchdog._look()
        assert armed() and "gpu:xid-79" in open({str(message)!r}).read(), "not armed from the store"
        theirs.withdraw(fault.id)
        watchdog._look()
        assert not armed() and open({str(message)!r}).read() == "", "not disarmed"
        theirs.publish(fault)  # the fault came back on the peer
        watchdog._look()
        assert armed(), "a notice published again was not armed again"
        watchdog.disarm(fault.id, share=False)  # withdrawn here first: the store's copy is stale
        watchdog._look()
        assert not armed(), "armed from a copy the store held from before the withdrawal"
        watchdog.arm(fault)  # this rank's Guard offers it again, the store's copy still the stale one
        watchdog._look()
        assert armed() and "gpu:xid-79" in open({str(message)!r}).read(), "offered again, not armed again"
        watchdog.disarm(fault.id)  # this rank's Guard: withdrawn (and from the store)
        watchdog._look()
        assert not armed() and mine.shared_notice() is None
        watchdog.arm(fault)
        assert armed(), "a notice offered again was not armed again"
        gate.answered(fault.id)  # an in-place change answered it here (the checkpoint marks the gate)
        watchdog.answered(fault)  # and this rank stays: never again, as the gate ignores it
        theirs.publish(fault)
        watchdog._look()
        watchdog.arm(fault)
        assert not armed(), "an answered notice was armed again"
        watchdog.close()
        os._exit(7)  # the TCPStore server's C++ thread can abort an ordinary interpreter exit
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert result.returncode == 7, result.stderr[-3000:]


def test_the_store_holds_the_notices_this_rank_acts_on_and_none_it_withdrew(tmp_path):
    """Three orders of notices and withdrawals through a real TCPStore (the watchdogs' threads
    are not started: the test decides when each looks; a subprocess, as arming sets a real
    exit timer):
    1. a notice learned from the store is never published back: its rank withdrew it between
       this rank's read and its arming (the read withdraws it here), and the store stays empty;
    2. a rank arms its own notice B with an earlier deadline than its A, which holds the store;
       A is withdrawn (and from the store, though not armed any more), so B goes in its place;
    3. a departing rank with an armed notice claims the answer (the watchdog stands down), and
       a withdrawal after its account neither erases it nor disarms its last resort."""
    message = tmp_path / "termination-log"
    script = store_script(message, f"""
        def notice(nid, seconds):
            return Notice(id=nid, kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                          deadline=now + timedelta(seconds=seconds))
        def text():
            return open({str(message)!r}).read() if os.path.exists({str(message)!r}) else ""
        class WithdrawnAfterRead(StoreClaims):
            def shared_notice(self):
                shared = super().shared_notice()
                if shared is not None:
                    theirs.withdraw(shared.id)
                return shared

        # 1.
        mine = WithdrawnAfterRead(store, 0, 2)
        late = DeadlineWatchdog(lambda: None, 1.0, claims=lambda: mine)
        late.completed(5)
        theirs.publish(notice("aws.spot:theirs", 600))
        late._look()
        assert StoreClaims(store, 0, 2).shared_notice() is None, "a store-learned notice was published back"
        late._look()
        assert late.notice is None
        late.close()

        # 2.
        claims = StoreClaims(store, 0, 2)
        watchdog = DeadlineWatchdog(lambda: None, 1.0, claims=lambda: claims)
        watchdog.completed(5)
        watchdog.arm(notice("aws.spot:a", 600))
        watchdog._look()
        watchdog.arm(notice("aws.spot:b", 300))
        watchdog._look()
        assert watchdog.notice.id == "aws.spot:b" and theirs.shared_notice().id == "aws.spot:a"
        watchdog.disarm("aws.spot:a")
        watchdog._look()
        assert theirs.shared_notice().id == "aws.spot:b", "the notice acted on never reached the store"

        # 3.
        watchdog.departing()
        assert claims.winner() == "boundary"
        write_termination_message("aws.spot:b", 9, 9, True, steps_lost=0, durable_tier="object", exit_code=83)
        account = text()
        theirs.withdraw("aws.spot:b")
        watchdog._look()
        watchdog.disarm("aws.spot:b")
        assert text() == account and watchdog._armed_for == "aws.spot:b", "the departure's account was erased"
        watchdog.close()
        os._exit(7)  # the TCPStore server's C++ thread can abort an ordinary interpreter exit
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert result.returncode == 7, result.stderr[-3000:]


def test_a_departure_that_loses_the_claim_to_a_peers_watchdog_leaves_by_that_claim(tmp_path):
    """A rank departs without a boundary claim (a membership change) while its watchdog holds a
    notice, and a peer's watchdog has already claimed LEAVE: the departure waits, and this rank's
    watchdog follows the peer's claim and ends the process with 83 and its account at once. It
    used to stop the watchdog first: nothing acted, and the last-resort timer ended the process
    with 84 at the notice's latest exit. A real TCPStore; the watchdog's thread runs."""
    message = tmp_path / "termination-log"
    script = store_script(message, """
        watchdog = DeadlineWatchdog(lambda: None, 1.0, claims=lambda: mine)
        watchdog.completed(5)
        watchdog.resumed(6)  # step 5 is durable: nothing new to save
        watchdog.arm(Notice(id="aws.spot:held", kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                            deadline=now + timedelta(seconds=20)))
        watchdog._look()  # armed: its timer would end the process with 84 about 19 s from now
        assert theirs.claim(LEAVE) == LEAVE  # a peer's watchdog claimed first
        watchdog._sleep(0)  # the arm's wake-up read: the thread's first look comes a poll after the departure
        watchdog.start()
        watchdog.departing()  # waits for good; the watchdog's thread ends the process
        os._exit(9)
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    took = time.monotonic() - started
    assert result.returncode == 83, result.stderr[-3000:]
    account = json.loads(message.read_text())
    assert (account["notice_id"], account["saved_by"], account["checkpoint"]) == (
        "aws.spot:held", "nothing-new", "durable"), account
    assert took < 15, took  # not the timer's 84 at about 19 s


@pytest.mark.parametrize("steps, expected", [(0, 83), (1, -signal.SIGTERM)])
def test_sigterm_before_the_guard_is_83_only_when_nothing_was_trained(tmp_path, steps, expected):
    """A worker that imported the Guard's module: SIGTERM before any optimizer step leaves with 83
    ("nothing-new"); after a step trained without a Guard it is SIGTERM's own death, never a false 83."""
    message = tmp_path / "termination-log"
    script = textwrap.dedent(f"""
        import os, signal, time
        import torch
        import spotguard.hooks.guard  # noqa: F401 - installs the early exit
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        for _ in range({steps}):
            weight.sum().backward()
            optimizer.step()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    env = {**os.environ, "RANK": "0", "SPOTGUARD_TERMINATION_LOG": str(message)}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=60).returncode == expected
    assert message.exists() is (expected == 83)
