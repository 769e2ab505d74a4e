"""A worker for tests/test_launch.py: records what `spotguard launch` gave it, then acts as told.

`launch_probe.py OUTDIR [--exit RANK=CODE|kill ...] [--ignore-term] [--child]`. Every rank writes to
OUTDIR: `rank{R}.env` (its environment, JSON), `rank{R}.session` (JSON: pid, sid, pgid), a line
with its PID in `rank{R}.pids` (appended, so a restart would show), each signal it receives as a
line in `rank{R}.signals`, and `rank{R}.ready` once its handlers are installed. A rank named by
--exit waits until every local worker is ready, then exits with CODE (`kill`: SIGKILLs itself);
the others wait for OUTDIR/release (60 s at most, then exit 3) and exit 0. SIGTERM and SIGINT make
a rank exit 83, as a drained rank does, unless --ignore-term. --child: first starts a child that
ignores SIGTERM and sleeps 120 s (its PID in `rank{R}.child`), left behind when the rank exits.
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--exit", action="append", default=[])
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    out = args.outdir
    (out / f"rank{rank}.env").write_text(json.dumps(dict(os.environ)))
    (out / f"rank{rank}.session").write_text(json.dumps({"pid": os.getpid(), "sid": os.getsid(0),
                                                         "pgid": os.getpgid(0)}))
    with open(out / f"rank{rank}.pids", "a") as f:
        f.write(f"{os.getpid()}\n")

    def on_signal(signum, _frame):
        with open(out / f"rank{rank}.signals", "a") as f:
            f.write(signal.Signals(signum).name + "\n")
        if signum in (signal.SIGTERM, signal.SIGINT) and not args.ignore_term:
            os._exit(83)

    if args.child:
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        (out / f"rank{rank}.child").write_text(str(child.pid))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    (out / f"rank{rank}.ready").touch()
    exits = dict(item.split("=") for item in args.exit)
    deadline = time.monotonic() + 60
    if str(rank) in exits:
        first = rank - local_rank
        siblings = [out / f"rank{r}.ready" for r in range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))]
        while not all(p.exists() for p in siblings) and time.monotonic() < deadline:
            time.sleep(0.02)
        if exits[str(rank)] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return int(exits[str(rank)])
    while not (out / "release").exists():
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
