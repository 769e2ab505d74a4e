"""The last-resort exit: ends this process with a chosen exit status at a chosen time, even when no
Python code can run then (the main thread stuck in a C call that holds the GIL).

A Python thread cannot help a process whose main thread holds the GIL in a C call: it never runs
again. So the timer lives outside Python: a POSIX timer (`timer_create`, `SIGEV_THREAD`) whose
expiry makes the C library start a thread that calls `_exit(code)` directly (the notify
function is libc's `_exit`, its argument the timer's `sigval`, the exit status). No signal is
delivered to the process, no handler runs, nothing of Python is touched: the process ends with
exactly `code`. Where that is unavailable (not Linux/glibc), `faulthandler.dump_traceback_later`
ends it with status 1 instead (logged once at arm time).

Contract: `ExitTimer.arm(at_monotonic, code)` (re)arms the one timer of this object for
`at_monotonic` (time.monotonic clock) with `code`; `cancel()` disarms it; both are idempotent
and cheap (one system call), callable from any thread. What the process writes before leaving
(its termination message) must be written before: nothing runs at expiry.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import logging
import threading
import time

log = logging.getLogger("spotguard.hooks.deadline")

CLOCK_MONOTONIC = 1
SIGEV_THREAD = 2


class _SigEvent(ctypes.Structure):
    """`struct sigevent` (Linux, 64 bytes): sigval, signo, notify, then the thread function."""

    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("sigev_notify_function", ctypes.c_void_p), ("sigev_notify_attributes", ctypes.c_void_p),
                ("_pad", ctypes.c_int * 8)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _libc() -> ctypes.CDLL | None:
    for name in (None, ctypes.util.find_library("rt")):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.timer_create  # noqa: B018 - probes the symbol
            return lib
        except (OSError, AttributeError):
            continue
    return None


class ExitTimer:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lib = _libc()
        self._timer: ctypes.c_void_p | None = None
        self._code: int | None = None
        self._lock = threading.Lock()

    @property
    def native(self) -> bool:
        """True when the timer ends the process with the chosen code (else with status 1)."""
        return self._lib is not None

    def arm(self, at_monotonic: float, code: int) -> None:
        """Ends the process with `code` at `at_monotonic` unless cancelled or re-armed first."""
        delay = max(at_monotonic - time.monotonic(), 0.001)
        with self._lock:
            if self._lib is None:
                log.warning("no POSIX timer here: the last-resort exit ends the process with status 1")
                faulthandler.dump_traceback_later(delay, exit=True)
                return
            if self._timer is not None and self._code != code:
                self._delete()
            if self._timer is None:
                self._create(code)
            spec = _ITimerSpec(_TimeSpec(0, 0), _TimeSpec(int(delay), int((delay % 1) * 1e9) or 1))
            if self._lib.timer_settime(self._timer, 0, ctypes.byref(spec), None) != 0:
                raise OSError(ctypes.get_errno(), "timer_settime failed")

    def cancel(self) -> None:
        """Disarms the timer (the process leaves, or stays, by its own means)."""
        with self._lock:
            if self._lib is None:
                faulthandler.cancel_dump_traceback_later()
            elif self._timer is not None:
                self._delete()

    def _create(self, code: int) -> None:
        assert self._lib is not None
        event = _SigEvent()
        event.sigev_value = code
        event.sigev_notify = SIGEV_THREAD
        event.sigev_notify_function = ctypes.cast(self._lib._exit, ctypes.c_void_p).value
        timer = ctypes.c_void_p()
        if self._lib.timer_create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")
        self._timer, self._code = timer, code

    def _delete(self) -> None:
        assert self._lib is not None and self._timer is not None
        self._lib.timer_delete(self._timer)
        self._timer, self._code = None, None
