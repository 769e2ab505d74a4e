"""When the dry-run stops retrying a job whose containers crash, and what it tells the user.

A crash is a training container that ended by itself with a failure code (1-127, not the drain
code 83; 128 + N is a kill by signal N from outside), on a node that was not lost, before its
trainer ever started training (no `start` event: a pod that trained and then crashed, e.g. a peer
of a rank the user killed, is the job's recovery path, which the run goes on to judge by the steps
lost). The Job retries crashed indexes (its backoffLimitPerIndex is generous: a real job rides out
a flaky node), but a dry-run whose trainer cannot start (a bad argument after `--`: argparse exits
2) would relaunch it for minutes. So the dry-run gives up at the first crash that is the user's
own error (exit 2: a usage error, the same on every retry), or after CRASH_LIMIT crashes before
any trainer of the job trained (once one did, crashes are part of a recovery, and relaunched pods
race their peers); `Crash` names the pod, its exit code, its log file and the log's last lines
(the cause, e.g. "unrecognized arguments").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from spotguard.trainer.cluster_log import PodLife
from spotguard.wire.names import EXIT_PREEMPTED

CRASH_LIMIT = 3
KILLED = 128  # 128 + N: ended by signal N (a kill from outside, not the trainer's own failure)
USAGE_ERROR = 2  # argparse's exit code: the command line is wrong, a retry fails the same way
TAIL_LINES = 6


@dataclass
class Crash:
    """Why the dry-run gave up: the crash that decided it and how many there were."""

    pod: str
    exit_code: int
    crashes: int
    log: str
    tail: list[str]

    @property
    def status(self) -> str:
        why = "a usage error" if self.exit_code == USAGE_ERROR else f"{self.crashes} crashes"
        return f"gave up after repeated crashes ({why}): pod {self.pod} exited {self.exit_code}"

    def as_dict(self) -> dict:
        return asdict(self)


def crashed(pods: list[PodLife], trained: Callable[[str], bool]) -> list[PodLife]:
    """The pods that crashed (module docstring), oldest end first; `trained(name)`: whether that
    pod's trainer started training (asked only of pods that ended with a crash code)."""
    out = [p for p in pods if p.finished is not None and p.exit_code is not None and 0 < p.exit_code < KILLED
           and p.exit_code != EXIT_PREEMPTED and not p.node_lost and not trained(p.name)]
    return sorted(out, key=lambda p: p.finished or 0.0)


def give_up(pods: list[PodLife], trained: Callable[[str], bool], logs: Path, job_trained: bool) -> Crash | None:
    """The crash to stop at, or None while the job may still recover (module docstring);
    `job_trained`: some trainer of the job started training (a job that did is recovering
    from what its crashes are part of: the limit applies only before it)."""
    failed = crashed(pods, trained)
    decisive = next((p for p in failed if p.exit_code == USAGE_ERROR), None)
    if decisive is None and not job_trained and len(failed) >= CRASH_LIMIT:
        decisive = failed[-1]
    if decisive is None:
        return None
    path = logs / f"{decisive.name}.log"
    return Crash(decisive.name, int(decisive.exit_code or 0), len(failed), str(path), log_tail(path))


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` non-empty lines of a log ([] when there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]
