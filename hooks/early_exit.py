"""A notice before the Guard exists (the model being built, data being loaded): nothing was trained
since the newest checkpoint, so the rank leaves at once with 83, nothing lost.

Without this, SIGTERM's default action kills a rank that has no Guard yet (exit -15: a crash by
the exit codes), and torchrun forwards SIGTERM to every rank it runs.

Contract: `install_at_import()` (run when `spotguard.hooks.guard` is imported, which training
scripts do before building anything) installs a SIGTERM handler only in a training worker (one
of `RANK`, `LOCAL_RANK`, `SPOTGUARD_LAUNCHER_PID` set), on the main thread, where SIGTERM still
has its default action and the deadline watchdog is not turned off (`SPOTGUARD_DEADLINE_WATCHDOG`
"0"). The handler writes the termination message (`saved_by` "nothing-new", no step lost) and
ends the process with 83. `supersede()` (the Guard's deadline watchdog, once made) turns it off:
from then on the Guard answers signals, and this handler, should it run again (a trap restored
it), does what SIGTERM's default does. So does a process that trained before any Guard was made
(a torch optimizer stepped: a global post-step hook, removed at `supersede()`, sees it): "nothing
trained" would be false there, and steps were lost.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from spotguard.hooks.termination_message import departure_account, write_termination_message
from spotguard.processes import flush_and_exit
from spotguard.wire import names
from spotguard.wire.notice import notice_id

log = logging.getLogger("spotguard.hooks.deadline")

WORKER_VARIABLES = ("RANK", "LOCAL_RANK", names.ENV_LAUNCHER_PID)
_state = {"installed": False, "superseded": False, "trained": False}


def install_at_import() -> bool:
    """See the module docstring; True when installed."""
    env = os.environ
    if (_state["installed"] or not any(env.get(v) for v in WORKER_VARIABLES)
            or env.get(names.ENV_DEADLINE_WATCHDOG, "1").strip() == "0"
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return False
    signal.signal(signal.SIGTERM, _leave_now)
    _state["installed"] = True
    _watch_training()
    return True


def supersede() -> None:
    """The Guard answers signals from now on."""
    _state["superseded"] = True
    handle = _hook.pop("handle", None)
    if handle is not None:
        handle.remove()


_hook: dict = {}


def _watch_training() -> None:
    """Marks the process as having trained at the first optimizer step (any torch optimizer)."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return

    def trained(optimizer: object, args: object, kwargs: object) -> None:
        _state["trained"] = True  # (never removed from inside: torch iterates its hooks while calling them)

    _hook["handle"] = register_optimizer_step_post_hook(trained)


def _leave_now(signum: int, frame: object) -> None:
    if _state["superseded"] or _state["trained"]:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    node = os.environ.get("SPOTGUARD_NODE") or os.environ.get("NODE_NAME") or os.uname().nodename
    nid = notice_id(names.SIGNAL_SOURCE, node, signal.Signals(signum).name, f"{time.time():.6f}")
    write_termination_message(nid, -1, -1, True, steps_lost=0, extra=departure_account("nothing-new", None, None, None),
                              exit_code=names.EXIT_PREEMPTED)
    log.warning("%s before the Guard exists: nothing trained yet, leaving with %d", signal.Signals(signum).name,
                names.EXIT_PREEMPTED)
    flush_and_exit(names.EXIT_PREEMPTED)
