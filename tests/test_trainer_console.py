"""What the reference trainer prints (trainer/console.py): rank 0's start, progress, changes and
end, one line each, from the events it writes anyway.

- A table of events -> lines (a clock passed in: progress at most every `every_seconds`), and
  nothing from another rank.
- The real trainer under `spotguard launch` on 2 ranks: a fresh start says so and shows
  progress; SIGTERM to the launcher drains (exit 83) and says at which step; the next launch (one
  rank: the lines do not depend on the world) says it resumed at that step, and finishes.
"""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard.trainer.console import ConsoleEcho
from spotguard.trainer.events import EventLog, read_events

TIMEOUT = 180.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_for_each_event_with_progress_at_most_every_interval(tmp_path):
    out, clock = io.StringIO(), Clock()
    echo = ConsoleEcho(EventLog(tmp_path / "rank0.jsonl", rank=0, world_size=2), 360, "/ckpt", every_seconds=10.0,
                       out=out, clock=clock)
    echo.write("start", step=0, resumed=False, joined=False, digest="d")
    for step, t in ((5, 1.0), (10, 9.0), (15, 11.5), (20, 20.0), (25, 21.5)):
        clock.now = t
        echo.write("step", step=step, loss=0.123456, samples_per_s=512.5)
    echo.write("resized", step=88, path="in-place", from_world=2, to_world=1, pause=0.0312, reason="notice",
               new_rank=0, phases={}, pid=1)
    echo.common.update(world_size=1)
    echo.write("agreed", step=88, notice_id="n")  # no line: the report's, not a person's
    echo.write("drained", step=120, exit_code=83)
    echo.write("finished", step=360, max_step_gap=0.1, pid=1)
    echo.close()
    assert out.getvalue().splitlines() == [
        "trainer: starting at step 0 of 360, world size 2 (no checkpoint in /ckpt)",
        "trainer: step 5/360  loss 0.1235  512.5 samples/s  world size 2",
        "trainer: step 15/360  loss 0.1235  512.5 samples/s  world size 2",
        "trainer: step 25/360  loss 0.1235  512.5 samples/s  world size 2",
        "trainer: world size 2 -> 1 after step 87 (in-place, paused 0.031 s)",
        "trainer: drained after step 119 (exit 83)",
        "trainer: finished: 360 of 360 steps",
    ]
    assert [e["event"] for e in read_events(tmp_path)] == [
        "start", "step", "step", "step", "step", "step", "resized", "agreed", "drained", "finished"]


@pytest.mark.parametrize("fields, line", [
    ({"step": 88, "resumed": True, "joined": False},
     "resumed from step 87's checkpoint in /ckpt: steps 88-359 to go, world size 2"),
    ({"step": 140, "resumed": True, "joined": True}, "joined the running job at step 140 of 360, world size 2"),
])
def test_a_resume_and_a_join_say_where_they_start(tmp_path, fields, line):
    out = io.StringIO()
    ConsoleEcho(EventLog(None, rank=0, world_size=2), 360, "/ckpt", out=out).write("start", **fields)
    assert out.getvalue() == f"trainer: {line}\n"


def test_other_ranks_print_nothing_until_renumbered_rank_0(tmp_path):
    out = io.StringIO()
    echo = ConsoleEcho(EventLog(None, rank=1, world_size=2), 360, "/ckpt", out=out)
    echo.write("start", step=0, resumed=False, joined=False)
    echo.write("finished", step=10)
    assert out.getvalue() == ""
    echo.common.update(rank=0)  # the old rank 0 left in place
    echo.write("finished", step=20)
    assert out.getvalue() == "trainer: finished: 20 of 360 steps\n"


def launch_trainer(checkpoint_dir: Path, steps: int, out: Path, ranks: int = 2) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTGUARD_", "MASTER_", "RANK", "WORLD_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "spotguard", "launch", "--standalone", "--nproc-per-node", str(ranks), "-m",
         "spotguard.trainer.train", "--steps", str(steps), "--checkpoint-dir", str(checkpoint_dir),
         "--step-seconds", "0.05"],
        stdout=out.open("w"), stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def wait_for_line(path: Path, pattern: str, process: subprocess.Popen) -> re.Match:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(), re.M)
        if found:
            return found
        assert process.poll() is None, f"launcher exited {process.returncode}: {path.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {TIMEOUT} s: {path.read_text()}")


@pytest.mark.slow
def test_the_reference_trainer_under_launch_says_where_it_starts_and_resumes(tmp_path):
    ckpt, first_out, second_out = tmp_path / "ckpt", tmp_path / "first.out", tmp_path / "second.out"
    first = launch_trainer(ckpt, 100_000, first_out)
    try:
        wait_for_line(first_out, r"^trainer: step \d+/100000  loss \S+  \S+ samples/s  world size 2$", first)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=TIMEOUT) == 83
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    lines = first_out.read_text().splitlines()
    assert lines[0] == f"trainer: starting at step 0 of 100000, world size 2 (no checkpoint in {ckpt})"
    drained = re.fullmatch(r"trainer: drained after step (\d+) \(exit 83\)", lines[-1])
    assert drained, lines
    step = int(drained.group(1))  # the Guard's number: the checkpoint folder's
    assert (ckpt / f"step-{step:09d}-notice").is_dir(), sorted(p.name for p in ckpt.iterdir())

    second = launch_trainer(ckpt, step + 10, second_out, ranks=1)  # what it says does not depend on the world
    assert second.wait(timeout=TIMEOUT) == 0
    lines = second_out.read_text().splitlines()
    assert lines[0] == (f"trainer: resumed from step {step}'s checkpoint in {ckpt}: "
                        f"steps {step + 1}-{step + 9} to go, world size 1")
    assert lines[-1] == f"trainer: finished: {step + 10} of {step + 10} steps"
