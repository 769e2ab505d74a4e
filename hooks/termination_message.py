"""The last word to the supervisor of a rank that leaves after an agreed step (a drain, a leaving
rank, a failed change's fallback): the container's termination message.

Every such rank writes (`hooks/machine/departure.py`, whatever ended its walk) `{"v": 1,
"notice_id": ..., "step": n, "saved_step": n, "steps_lost": n, "checkpoint": "durable"|"failed"}`
(with an object store also `"durable_tier"`, and with tier "local" `"object_step"`: the newest
step known in the object store; `"exit_code"`, the code the rank leaves with, which a launcher
between the rank and the kubelet (torchrun) does not pass on) to the file named by `SPOTGUARD_TERMINATION_LOG`, or to
`/dev/termination-log` when the kubelet mounted one (it copies the file into
`containerStatuses[].state.terminated.message`, where the supervisor reads the steps lost:
supervisor/progress.py). Ranks agree on the step, so ranks sharing a container write the same
content. Writing never raises: a rank that cannot write still exits with its code.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from typing import BinaryIO

from spotguard.wire import names
from spotguard.wire.notice import WIRE_VERSION

log = logging.getLogger(__name__)

KUBELET_TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE_BYTES = 4096  # the kubelet keeps at most 4096 bytes of a termination message


def termination_log_path(environ: dict | None = None) -> str | None:
    """Where to write: the variable when set (empty: nowhere), else the kubelet's file if it exists."""
    env = os.environ if environ is None else environ
    if names.ENV_TERMINATION_LOG in env:
        return env[names.ENV_TERMINATION_LOG] or None
    return KUBELET_TERMINATION_LOG if os.path.exists(KUBELET_TERMINATION_LOG) else None


def departure_account(saved_by: str, step: int | None, saved_step: int | None,
                      seconds_left: float | None) -> dict:
    """How a departing rank's checkpoint was made, as its message and its hook report say it:
    `saved_by` ("boundary", "watchdog", "nothing-new", "none"), `snapshot_steps` (steps trained
    after the saved one, when both are known) and `margin_seconds` (to the deadline, when it has one)."""
    account: dict = {"saved_by": saved_by}
    if step is not None and saved_step is not None:
        account["snapshot_steps"] = step - saved_step
    if seconds_left is not None:
        account["margin_seconds"] = round(seconds_left, 3)
    return account


def clear_termination_message() -> None:
    """Empties the message written in advance (the deadline watchdog's, for a notice withdrawn since)."""
    path = termination_log_path()
    if path is not None:
        try:
            with _locked(path) as f:
                f.truncate(0)
        except OSError:
            pass


def write_termination_message(notice_id: str, step: int, saved_step: int, durable: bool,
                              path: str | None = None, *, steps_lost: int | None = None,
                              durable_tier: str | None = None, object_step: int | None = None,
                              extra: dict | None = None, exit_code: int | None = None,
                              in_advance: bool = False) -> bool:
    """Writes the message (see the module docstring); True when written. `steps_lost` defaults to
    `step - saved_step`; `durable_tier` ("object", "local", "disk") and `object_step`, when known,
    are added, then `exit_code` when given, then `extra` (`saved_by`, `margin_seconds`, ...).

    `in_advance`: the deadline watchdog's "failed" message, written before anything is known: it
    never replaces a message the file already holds for the same notice (a boundary that answered
    first, in this process or another rank's in the same container, keeps its account). Writers
    hold an exclusive lock on the file, so the check and the write are one step."""
    target = path if path is not None else termination_log_path()
    if target is None:
        return False
    message = {"v": WIRE_VERSION, "notice_id": notice_id, "step": step, "saved_step": saved_step,
               "steps_lost": step - saved_step if steps_lost is None else steps_lost,
               "checkpoint": "durable" if durable else "failed"}
    if durable_tier is not None:
        message["durable_tier"] = durable_tier
    if object_step is not None:
        message["object_step"] = object_step
    if exit_code is not None:
        message["exit_code"] = exit_code
    message.update(extra or {})
    body = json.dumps(message, separators=(",", ":"))
    data = body.encode()[:MAX_MESSAGE_BYTES]
    try:
        with _locked(target) as f:
            if in_advance and _notice_of(f.read()) == notice_id:
                return False
            f.seek(0)
            f.truncate(0)
            f.write(data)
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", target, exc)
        return False
    return True


@contextlib.contextmanager
def _locked(path: str) -> Iterator[BinaryIO]:
    """The file opened for reading and writing (created when missing), positioned at its start,
    under an exclusive `flock` (the watchdog's thread and the main thread of every rank in the
    container write the same file)."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            yield f
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _notice_of(data: bytes) -> str | None:
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message.get("notice_id") if isinstance(message, dict) else None
