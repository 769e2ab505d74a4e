"""One signal is one notice, whichever of the trap's handler and the deadline watchdog's read of
the signal wakeup fd sees it first; after a departure the watchdog writes no termination
message over the departure's.

Real signals to this process, the real wakeup fd the watchdog takes, the watchdog's own read of
it and its poll (`_sleep`, `_look`: its thread is not started, so the test decides when), a real
TCPStore for the notice a peer publishes, and the real termination-message file.
"""
from __future__ import annotations

import json
import os
import signal
from datetime import timedelta

import pytest

import torch.distributed as dist

from spotguard.hooks.deadline_claims import StoreClaims
from spotguard.hooks.deadline_watchdog import DeadlineWatchdog
from spotguard.hooks.signals import SignalTrap
from spotguard.hooks.termination_message import write_termination_message
from spotguard.wire.names import ENV_TERMINATION_LOG
from spotguard.wire.notice import Kind, Notice, now_utc


@pytest.fixture
def trapped():
    """A trap installed on SIGUSR1 and a watchdog holding the wakeup fd (thread not started)."""
    trap = SignalTrap(30.0, (signal.SIGUSR1,), node="n1")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    claims = StoreClaims(store, 0, 2)  # the store a peer's watchdog publishes its notice in
    watchdog = DeadlineWatchdog(lambda: None, 1.0, trap, claims=lambda: claims)
    trap.install()  # as the Guard does: after the watchdog took the wakeup fd
    assert watchdog._signal_fd is not None, "another wakeup fd holder: the test would prove nothing"
    yield trap, watchdog, claims
    watchdog.close()
    trap.uninstall()


def test_a_signal_the_guard_took_before_the_watchdog_read_its_byte_makes_no_second_notice(trapped):
    trap, watchdog, _ = trapped
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs on return; the byte waits in the fd
    first = trap.take()
    assert first is not None and first.kind is Kind.DRAIN
    watchdog._sleep(0)  # the watchdog's thread reads the byte only now
    assert trap.peek() is None  # it was this delivery: no notice with an id and a deadline of its own

    os.kill(os.getpid(), signal.SIGUSR1)  # a second delivery is a notice of its own
    watchdog._sleep(0)
    second = trap.take()
    assert second is not None and second.id != first.id


def test_a_delivery_the_watchdog_read_first_is_the_one_the_handler_would_have_recorded(trapped):
    trap, _, _ = trapped
    trap.wakeup(signal.SIGUSR1)  # the main thread was in C: the watchdog saw it first
    seen = trap.peek()
    trap._handle(signal.SIGUSR1, None)  # then the handler ran for the same delivery
    assert trap.take() == seen
    assert trap.peek() is None
    trap.wakeup(signal.SIGTERM)  # not a signal of this trap
    assert trap.peek() is None


def test_after_the_departure_a_notice_from_the_store_does_not_replace_the_account(trapped, tmp_path,
                                                                                                 monkeypatch):
    _, watchdog, claims = trapped
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    deadline = now_utc() + timedelta(seconds=60)
    watchdog.departing()
    write_termination_message("aws.spot:a", 9, 9, True, steps_lost=0, durable_tier="object", exit_code=83)
    account = log.read_text()
    other = Notice(id="aws.spot:b", kind=Kind.RECLAIM, source="aws", node="n2", detected_at=now_utc(),
                   deadline=deadline)
    claims.publish(other)  # a peer's notice reaches the store after this rank wrote its account
    watchdog._look()
    assert log.read_text() == account and watchdog.notice is None
    watchdog.arm(other)  # and one handed to it directly
    watchdog._look()
    assert log.read_text() == account and watchdog._armed_for is None
    assert json.loads(account)["durable_tier"] == "object"
    # (an armed notice withdrawn after the departure: test_deadline_policy's store test, part 3)
