"""Survivors' pause on a membership change, 4 -> 3 -> 4 ranks: in place vs. the restart path.

    .venv/bin/python bench/membership_change.py                          # DDP and FSDP2, both paths
    .venv/bin/python bench/membership_change.py --frameworks ddp,fsdp2,deepspeed --json out.json
    .venv/bin/python bench/membership_change.py --frameworks accelerate     # the Accelerate integration

One rank per host, hosts a-d (gloo on 127.0.0.1, `bench/_membership_worker.py`, a synthetic
`--step-sleep` per step), started directly with the environment `spotguard launch` gives a worker
(`hooks.launch.worker_env`; the restart path without the in-place variables, i.e. torchrun's).
Per framework, in one run:
- in place: SIGTERM to host a (a signal-borne drain notice naming a: a leaves; it hosted the
  store) -> the survivors b, c, d re-form at 3 in their processes; then host e starts as a
  joiner and, once ready, a membership [b, c, d, e] with b's store is pushed -> 4 in place;
- restart (today's path): the same notice makes every rank checkpoint the agreed step and exit
  83; then new processes (interpreter, torch import, group init, load from the checkpoint) start
  at 3; a second notice -> every rank exits 83 -> new processes at 4 with e.
DeepSpeed is ZeRO-1 with a client AdamW, `DeepSpeedAdapter(in_place=True)`. `accelerate` is the same
job through the Accelerate integration (`AccelerateGuard(in_place=True)` in place, its restart path
otherwise); the Trainer and Lightning integrations keep the restart path (docs/integrations.md).
At size (`--dim 4096 --layers 6`: FSDP2 only, the model of bench/membership_memory.py, ~1.1 GiB of
parameters + AdamW moments, made on the meta device; `--step-sleep 0 --steps-between 3` suit it)
the same run also prints each change's pause split into the state machine's phases on the
slowest survivor: agreed (its last step complete -> the agreement), checkpointed (the copy of
the agreed step; its durable write starts behind), handover (beside the write), durable (the
rest of the write, committed by every rank), left, formed, rebuilt, transferred, committed, and
the first step after (one ordinary step and the Guard's return).
Survivors' pause = over the survivors b, c, d, the longest time from their last step completed
before the change to their first step completed after it, from the workers' own per-step
timestamps; it contains one ordinary step at the new size (the median of the ordinary steps at
that size, in both jobs, is printed). For the in-place path the Guard's own record is printed
beside it (agreement -> committed; "save" is the change's durable checkpoint, copy to committed,
whose write overlaps the hand-over). The restart figure is a
lower bound of a real restart: no torchrun agent or elastic rendezvous, no CUDA/NCCL start, a
checkpoint on local disk.
Goals: the small model's in-place gap <= 0.5 s and <= 1/5 of the restart path's (issue 11; for an
integration <= 1 s and <= 1/5, issue 38: the restart's start there includes the framework's import); at
size the gap less a step and the Guard's own pause each <= 1/5 of the restart's gap less a step
(issue 19). On 2 cores the ranks, the leaver's exit and the joiner's start share two CPUs; the
README also lists the same commands on a host with a core per rank (16 cores).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from spotguard.hooks.machine.model import PHASES
from spotguard.hooks.launch import LaunchConfig, worker_env
from spotguard.processes import die_with_parent, free_port
from spotguard.wire import names

WORKER = Path(__file__).resolve().with_name("_membership_worker.py")
FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "accelerate")
IN_PLACE_FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "accelerate")
START_HOSTS = ("a", "b", "c", "d")
LEAVER, JOINER = "a", "e"
SURVIVORS = ("b", "c", "d")
PAUSE_GOAL_S = 0.5
INTEGRATION_PAUSE_GOAL_S = 1.0  # a framework integration's goal (issue 38)
INTEGRATIONS = ("accelerate",)
RATIO_GOAL = 5.0
EXIT_PREEMPTED = names.EXIT_PREEMPTED


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="ddp,fsdp2",
                   help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default ddp,fsdp2)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="synthetic compute per step, seconds")
    p.add_argument("--steps-between", type=int, default=15, help="steps every rank trains between two changes")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds any one wait may take")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this file")
    p.add_argument("--dim", type=int, default=0, help="FSDP2 at size: width of each Linear (0: the small model)")
    p.add_argument("--layers", type=int, default=6, help="with --dim: the number of Linear layers")
    p.add_argument("--keep", type=Path, default=None, help="run in this folder and keep it (logs, step files)")
    args = p.parse_args(argv)
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in args.frameworks if f not in FRAMEWORKS]
    if unknown or not args.frameworks:
        p.error(f"--frameworks: {', '.join(unknown) or 'none given'}; choose from {', '.join(FRAMEWORKS)}")
    if args.step_sleep < 0 or args.steps_between < 1 or args.timeout <= 0:
        p.error("--step-sleep must be >= 0, --steps-between >= 1, --timeout > 0")
    if args.dim < 0 or args.layers < 1:
        p.error("--dim must be >= 0, --layers >= 1")
    if args.dim and args.frameworks != ["fsdp2"]:
        p.error("--dim: the model at size is FSDP2's: use --frameworks fsdp2")
    return args


# ---- one job's processes -------------------------------------------------------------------------
class Job:
    """The worker processes of one path of one framework, in their own folder; only processes
    started here are ever signalled or killed, by their process object."""

    def __init__(self, folder: Path, framework: str, args: argparse.Namespace):
        self.out = folder
        self.out.mkdir(parents=True)
        self.framework = framework
        self.args = args
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        self.base_env["PYTHONUNBUFFERED"] = "1"

    def start(self, node: str, env: dict[str, str]) -> None:
        command = [sys.executable, str(WORKER), "--framework", self.framework, "--ckpt", str(self.out / "ckpt"),
                   "--out", str(self.out), "--step-sleep", str(self.args.step_sleep),
                   "--dim", str(self.args.dim), "--layers", str(self.args.layers)]
        with open(self.out / f"log-{node}", "a") as log:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent(signal.SIGKILL))
        self.procs.setdefault(node, []).append(proc)

    def env(self, node: str, rank: int, world: int, master_port: int, rdzv_port: int, *, in_place: bool,
            join: bool = False) -> dict[str, str]:
        config = LaunchConfig(nnodes=world, node_rank=rank, nproc_per_node=1, master_addr="127.0.0.1",
                              master_port=master_port, node_name=node, rdzv_host="127.0.0.1", rdzv_port=rdzv_port,
                              join=join, ready_file=str(self.out / f"ready-{node}") if join else None,
                              reform_timeout=30.0, min_world_size=None, shutdown_timeout=30.0, command=())
        env = worker_env(config, 0, self.base_env)
        if not in_place:
            for name in (names.ENV_IN_PLACE, names.ENV_RDZV_HOST, names.ENV_RDZV_PORT):
                env.pop(name, None)
        return env

    def launch(self, hosts: tuple[str, ...]) -> None:
        """A fresh set of processes, one per host, on a new store: the restart path's relaunch."""
        port = free_port()
        for rank, node in enumerate(hosts):
            self.start(node, self.env(node, rank, len(hosts), port, port, in_place=False))

    def current(self, node: str) -> subprocess.Popen:
        return self.procs[node][-1]

    def steps(self, node: str) -> list[dict]:
        try:
            text = (self.out / f"steps-{node}.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def resizes(self, node: str) -> list[dict]:
        try:
            return [json.loads(line) for line in (self.out / f"resize-{node}.jsonl").read_text().splitlines()]
        except FileNotFoundError:
            return []

    def last_step(self, node: str) -> int:
        lines = self.steps(node)
        return lines[-1]["step"] if lines else -1

    def wait(self, ready, what: str) -> None:
        """Polls `ready()` until true; a worker that exited unexpectedly or the timeout fails it."""
        deadline = time.monotonic() + self.args.timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.out.name}: timed out waiting for {what}\n{self.tails()}")
            time.sleep(0.1)

    def wait_steps(self, hosts, step: int) -> None:
        self.wait(lambda: all(self.last_step(n) >= step for n in hosts), f"step {step} on {', '.join(hosts)}")

    def wait_exits(self, hosts, code: int) -> None:
        deadline = time.monotonic() + self.args.timeout
        for node in hosts:
            proc = self.current(node)
            try:
                got = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{self.out.name}: host {node} did not exit\n{self.tails()}") from None
            if got != code:
                raise RuntimeError(f"{self.out.name}: host {node} exited {got}, expected {code}\n{self.tails()}")

    def finish(self, hosts) -> None:
        """Ends the job cleanly: every rank stops after a step far enough ahead of all of them."""
        stop = max(self.last_step(n) for n in hosts) + 10
        tmp = self.out / "stop-at.tmp"
        tmp.write_text(str(stop))
        tmp.rename(self.out / "stop-at")
        self.wait_exits(hosts, 0)

    def tails(self) -> str:
        parts = []
        for log in sorted(self.out.glob("log-*")):
            lines = log.read_text(errors="replace").splitlines()[-8:]
            parts.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def kill(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


# ---- the two paths ---------------------------------------------------------------------------------
def run_in_place(job: Job) -> tuple[int, int]:
    """4 -> 3 (host a leaves on SIGTERM) -> 4 (joiner e); the two agreed steps."""
    ports = {n: free_port() for n in (*START_HOSTS, JOINER)}
    for rank, node in enumerate(START_HOSTS):
        job.start(node, job.env(node, rank, len(START_HOSTS), ports[START_HOSTS[0]], ports[node], in_place=True))
    between = job.args.steps_between
    job.wait_steps(START_HOSTS, between)
    job.current(LEAVER).send_signal(signal.SIGTERM)
    job.wait_exits((LEAVER,), EXIT_PREEMPTED)
    job.wait(lambda: all(len(job.resizes(n)) >= 1 for n in SURVIVORS), "the shrink on every survivor")
    shrink = job.resizes(SURVIVORS[0])[0]["step"]
    job.wait_steps(SURVIVORS, shrink + between)
    job.start(JOINER, job.env(JOINER, len(SURVIVORS), len(SURVIVORS) + 1, ports[SURVIVORS[0]], ports[JOINER],
                              in_place=True, join=True))
    job.wait(lambda: (job.out / f"ready-{JOINER}").exists(), f"the joiner {JOINER} to be ready")
    membership = {"v": 1, "generation": 1, "hosts": [*SURVIVORS, JOINER], "world_size": len(SURVIVORS) + 1,
                  "store": f"127.0.0.1:{ports[SURVIVORS[0]]}"}
    (job.out / "membership.json.tmp").write_text(json.dumps(membership))
    (job.out / "membership.json.tmp").rename(job.out / "membership.json")
    job.wait(lambda: all(len(job.resizes(n)) >= 2 for n in SURVIVORS), "the grow on every survivor")
    grow = job.resizes(SURVIVORS[0])[1]["step"]
    job.wait_steps((*SURVIVORS, JOINER), grow + between)
    job.finish((*SURVIVORS, JOINER))
    return shrink, grow


def run_restart(job: Job) -> tuple[tuple[int, float], tuple[int, float]]:
    """4 -> 3 -> 4 by checkpoint, exit 83 on every rank and relaunch; per change, the agreed step
    and the moment (time.monotonic()) every rank had exited, when the relaunch starts."""
    between = job.args.steps_between
    job.launch(START_HOSTS)
    job.wait_steps(START_HOSTS, between)
    job.current(LEAVER).send_signal(signal.SIGTERM)
    job.wait_exits(START_HOSTS, EXIT_PREEMPTED)
    shrink = (job.last_step(SURVIVORS[0]), time.monotonic())
    job.launch(SURVIVORS)
    job.wait_steps(SURVIVORS, shrink[0] + between)
    job.current(SURVIVORS[0]).send_signal(signal.SIGTERM)  # today a returning host is a drain of all
    job.wait_exits(SURVIVORS, EXIT_PREEMPTED)
    grow = (job.last_step(SURVIVORS[0]), time.monotonic())
    job.launch((*SURVIVORS, JOINER))
    job.wait_steps((*SURVIVORS, JOINER), grow[0] + between)
    job.finish((*SURVIVORS, JOINER))
    return shrink, grow


# ---- figures -----------------------------------------------------------------------------------------
def around(job: Job, step: int) -> list[tuple[float, float]]:
    """Per survivor: when step `step` and step `step + 1` were complete."""
    pairs = []
    for node in SURVIVORS:
        times: dict[int, float] = {}
        for line in job.steps(node):
            times.setdefault(line["step"], line["t"])
        if step not in times or step + 1 not in times:
            raise RuntimeError(f"{job.out.name}: host {node} has no steps {step} and {step + 1}")
        pairs.append((times[step], times[step + 1]))
    return pairs


def step_gap(job: Job, step: int) -> float:
    """The longest survivor's time from step `step` complete to step `step + 1` complete."""
    return max(after - before for before, after in around(job, step))


def phase_split(job: Job, step: int, index: int) -> dict[str, float]:
    """The slowest survivor's gap around change `index` (agreed at `step`) by phase, in seconds:
    agreed (its step complete -> the agreement), each phase of the Guard's record, and the first
    step after (the rest of the gap: one ordinary step and the Guard's return; "of which
    optimizer.step": that step's optimizer step, which re-plans DTensor's sharding of every
    optimizer op on the new mesh)."""
    splits = []
    for node, (before, after) in zip(SURVIVORS, around(job, step)):
        record = job.resizes(node)[index]
        walls: dict[int, float] = {}
        for line in job.steps(node):
            walls.setdefault(line["step"], line["wall"])
        split, previous = {"agreed": record["started"] - walls[step]}, 0.0
        for phase in PHASES:
            if phase in record["phases"]:
                split[phase] = record["phases"][phase] - previous
                previous = record["phases"][phase]
        split["first step"] = (after - before) - split["agreed"] - previous
        first = next(line for line in job.steps(node) if line["step"] == step + 1)
        split["of which optimizer.step"] = first.get("optimizer", 0.0)
        splits.append((after - before, split))
    return max(splits, key=lambda pair: pair[0])[1]


def median_optimizer(job: Job) -> float:
    """The median seconds of one optimizer step (every survivor's steps)."""
    return statistics.median(line.get("optimizer", 0.0) for node in SURVIVORS for line in job.steps(node))


def median_step(jobs: list[Job], world: int) -> float:
    """The median time between consecutive steps of one process at `world` ranks (ordinary
    steps, of every job given): the one step each gap after a change to `world` contains."""
    diffs = []
    for job in jobs:
        for node in SURVIVORS:
            lines = job.steps(node)
            diffs += [b["t"] - a["t"] for a, b in itertools.pairwise(lines) if b["step"] == a["step"] + 1
                      and b["pid"] == a["pid"] and b["world"] == a["world"] == world]
    return statistics.median(diffs)


@dataclass
class Row:
    framework: str
    change: str
    step_s: float
    in_place_gap_s: float | None
    guard_pause_s: float | None
    save_s: float | None
    restart_gap_s: float
    restart_exit_s: float  # last step before -> every rank exited
    restart_start_s: float  # every rank exited -> the slowest survivor's first step after
    phases: dict[str, float] | None = None  # in place: the slowest survivor's gap by phase
    optimizer_s: float | None = None  # in place: the median optimizer step
    at_size: bool = False  # the goals at size (issue 19) rather than the small model's (issue 11)

    @property
    def ratio(self) -> float | None:
        return self.restart_gap_s / self.in_place_gap_s if self.in_place_gap_s else None

    @property
    def ratio_less_step(self) -> float | None:
        """The restart path's gap over the in-place one, one ordinary step taken off both (the
        goal at size: the pause itself, without the step every gap contains)."""
        if self.in_place_gap_s is None or self.in_place_gap_s <= self.step_s:
            return None
        return (self.restart_gap_s - self.step_s) / (self.in_place_gap_s - self.step_s)

    @property
    def ratio_guard(self) -> float | None:
        """The restart path's gap less one step over the Guard's own pause (its record)."""
        if not self.guard_pause_s:
            return None
        return (self.restart_gap_s - self.step_s) / self.guard_pause_s

    @property
    def pause_met(self) -> bool | None:
        """The small model's goal: the gap, one step included, <= 0.5 s (an integration's <= 1 s; none at size)."""
        if self.at_size or self.in_place_gap_s is None:
            return None
        return self.in_place_gap_s <= (INTEGRATION_PAUSE_GOAL_S if self.framework in INTEGRATIONS else PAUSE_GOAL_S)

    @property
    def ratio_met(self) -> bool | None:
        """<= 1/5 of the restart path: for the small model the gaps as they are; at size both the
        gap less a step and the Guard's own pause, against the restart's gap less a step."""
        if not self.at_size:
            return None if self.ratio is None else self.ratio >= RATIO_GOAL
        if self.ratio_less_step is None or self.ratio_guard is None:
            return None
        return min(self.ratio_less_step, self.ratio_guard) >= RATIO_GOAL

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "ratio_less_step": self.ratio_less_step,
                "ratio_guard": self.ratio_guard, "pause_goal_met": self.pause_met, "ratio_goal_met": self.ratio_met}


def measure(framework: str, root: Path, args: argparse.Namespace) -> list[Row]:
    restart = Job(root / f"{framework}-restart", framework, args)
    try:
        restart_steps = run_restart(restart)
    finally:
        restart.kill()
    in_place = None
    if framework in IN_PLACE_FRAMEWORKS:
        in_place = Job(root / f"{framework}-in-place", framework, args)
        try:
            in_place_steps = run_in_place(in_place)
        finally:
            in_place.kill()
    rows = []
    for i, (change, new_world) in enumerate((("4 -> 3", 3), ("3 -> 4", 4))):
        step, exited = restart_steps[i]
        before_after = around(restart, step)
        exit_s = exited - max(before for before, _ in before_after)
        start_s = max(after for _, after in before_after) - exited
        gap = pause = save = phases = optimizer = None
        if in_place is not None:
            optimizer = median_optimizer(in_place)
            gap = step_gap(in_place, in_place_steps[i])
            records = [in_place.resizes(n)[i] for n in SURVIVORS]
            pause = max(r["pause"] for r in records)
            save = max(r["save"] for r in records)
            phases = phase_split(in_place, in_place_steps[i], i)
        step_s = median_step([j for j in (in_place, restart) if j is not None], new_world)
        rows.append(Row(framework, change, step_s, gap, pause, save, step_gap(restart, step), exit_s, start_s, phases,
                        optimizer, at_size=bool(args.dim)))
    return rows


def render(rows: list[Row]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def met(value: bool | None) -> str:
        return "-" if value is None else ("met" if value else "MISSED")

    head = (f"{'framework':<10} {'change':<7} {'step':>6} {'in-place gap':>12} {'Guard pause':>11} {'save':>6} "
            f"{'restart gap':>11} {'(exit + start)':>15} {'restart/in-place':>16} {'less a step':>11} "
            f"{'/ Guard':>7}  {'pause':<8} {'<= 1/5':<6}")
    out = [head, "-" * len(head)]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.1f}x"
        less = "-" if r.ratio_less_step is None else f"{r.ratio_less_step:.1f}x"
        guard = "-" if r.ratio_guard is None else f"{r.ratio_guard:.1f}x"
        out.append(f"{r.framework:<10} {r.change:<7} {s(r.step_s):>6} {s(r.in_place_gap_s):>12} "
                   f"{s(r.guard_pause_s):>11} {s(r.save_s):>6} {s(r.restart_gap_s):>11} "
                   f"{r.restart_exit_s:>6.2f} + {r.restart_start_s:>6.2f} {ratio:>16} {less:>11} {guard:>7}  "
                   f"{met(r.pause_met):<8} {met(r.ratio_met):<6}")
    split = [r for r in rows if r.phases]
    if split:
        names = list(split[0].phases)
        out += ["", "in-place gap by phase (s), the slowest survivor: " + ", ".join(names)]
        for r in split:
            assert r.phases is not None
            out.append(f"{r.framework:<10} {r.change:<7} " + "  ".join(
                f"{name} {r.phases.get(name, 0.0):.3f}" for name in names)
                + f"  (median optimizer.step {r.optimizer_s or 0.0:.3f})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="spotguard-membership-"))
    started = time.monotonic()
    rows: list[Row] = []
    try:
        for framework in args.frameworks:
            rows += measure(framework, root, args)
            print(f"{framework}: done at {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    size = f", FSDP2 {args.layers} x Linear({args.dim})" if args.dim else ""
    print(f"survivors' pause (s), 4 ranks on 127.0.0.1, gloo, step sleep {args.step_sleep:g} s, "
          f"{args.steps_between} steps between changes{size}")
    print(render(rows))
    print("gap: last step before -> first step after the change (includes one ordinary step, 'step' = the median "
          "step at the new size); "
          "Guard pause: its record, agreement -> committed; save: the change's durable checkpoint "
          "(copy -> committed, beside the hand-over), inside the gap; "
          "restart exit: last step -> every rank exited 83, start: -> first step of the new processes; "
          "less a step: both gaps less that step; / Guard: the restart's gap less a step over the Guard "
          "pause. Goals ('pause'): the small model's gap <= 0.5 s (an integration's <= 1 s) and "
          "restart/in-place >= 5x; at size 'less a step' "
          "and '/ Guard' both >= 5x")
    if args.json:
        args.json.write_text(json.dumps({"config": {"frameworks": args.frameworks, "step_sleep": args.step_sleep,
                                                    "steps_between": args.steps_between, "dim": args.dim,
                                                    "layers": args.layers},
                                         "rows": [r.as_dict() for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
