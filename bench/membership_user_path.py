"""An in-place shrink as users run it: a README FSDP2 script on 4 hosts under `spotguard launch`,
SIGTERM to one launcher; survivors' host memory sampled from outside, and the change's cost
against a torchrun relaunch of the same script measured right after.

    .venv/bin/python bench/membership_user_path.py                       # 0.94 GiB: 5 x Linear(4096)
    .venv/bin/python bench/membership_user_path.py --dim 1024 --layers 2 --step-sleep 0.2   # quick

The script is `bench/_user_fsdp2.py`: `TorchDCPAdapter(model, opt, checkpoint_dir=..., build=...)`,
`Guard.from_env(adapter=...)`, nothing else (no `prepare()`), one JSON line per completed step.
Hosts a-d each run `spotguard launch --nnodes 4 --node-rank I --nproc-per-node 1` (gloo on
127.0.0.1, one CPU thread per rank). Once every rank completed `--warm` steps, this process sends
SIGTERM to host a's launcher (a hosts the job's store); a's rank drains in place (exit 83) and b,
c, d re-form a group of 3 in their processes; once each trained `--after` steps at 3 they are
stopped. Every survivor's RSS is sampled from outside every `--period` seconds (psutil).
- Peak extra per survivor: the highest RSS between the SIGTERM and the end of the change (its
  `guard.step` returning at the agreed step, in the group of 3), minus its steady state, over its
  new shard (parameters + AdamW moments / 3). Steady state is the peak RSS of its last complete
  step before the signal (a step's all-gathers and gradients come and go, ~250 MiB at size: the
  RSS at one moment of the step is no baseline); the extra over the last sample before the
  signal is printed beside it. Goal <= 1.5x. The steps after the change hold the larger shard
  and its re-sized snapshot buffers: a new steady state, not the change's.
- The change's cost beyond one step: over the survivors, the longest gap between the last step
  completed before the change and the first after it, less the median step at 3 ranks. The
  relaunch: `torchrun --nproc-per-node 3` of the same script from the change's checkpoint, from
  its start to its first step completed, less the median step of the relaunched job: a lower
  bound of the restart path (its drain's checkpoint and exit are not counted). Goal: change /
  relaunch <= 0.2.
The change's phases on the slowest survivor, in the order reached (its Guard's record: agreed,
decided, checkpointed, handover beside the write, left, formed, rebuilt, transferred, then durable:
the checkpoint commits through the old formation's store while the survivors re-form; committed)
and the load of the machine (1-minute load average, cores) are printed with the figures.
"""
from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from pathlib import Path

from membership_memory import Sampler, state_bytes  # a sibling: the bench scripts run as scripts

from spotguard.processes import free_port

SCRIPT = Path(__file__).resolve().with_name("_user_fsdp2.py")
HOSTS = ("a", "b", "c", "d")
MEMORY_GOAL, COST_GOAL = 1.5, 0.2


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=4096, help="width of each Linear layer")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--warm", type=int, default=3, help="steps every rank completes before the SIGTERM")
    p.add_argument("--after", type=int, default=4, help="steps the survivors train after the change")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pretend compute per step (quick runs)")
    p.add_argument("--period", type=float, default=0.02, help="RSS sampling period, seconds")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--reform-timeout", type=float, default=120.0,
                   help="spotguard launch --reform-timeout: the first group's start on a loaded machine")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, steps) and print where")
    args = p.parse_args(argv)
    if args.dim < 1 or args.layers < 1 or args.warm < 1 or args.after < 2:
        p.error("--dim, --layers, --warm must be >= 1 and --after >= 2")
    return args


def steps_of(out: Path, node: str) -> list[dict]:
    path = out / f"steps-{node}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(predicate, timeout: float, what: str, procs: dict[str, subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None and p.returncode not in (0, 83)}
        if dead:
            raise SystemExit(f"while waiting for {what}: {dead} exited")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def script_args(args: argparse.Namespace, out: Path, ckpt: Path, steps: int) -> list[str]:
    return [str(SCRIPT), "--out", str(out), "--ckpt", str(ckpt), "--dim", str(args.dim), "--layers",
            str(args.layers), "--steps", str(steps), "--step-sleep", str(args.step_sleep)]


def launch_hosts(args: argparse.Namespace, out: Path, ckpt: Path, steps: int) -> dict[str, subprocess.Popen]:
    """The four launchers, one per host, each starting its one worker."""
    master = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for index, host in enumerate(HOSTS):
        cmd = [sys.executable, "-m", "spotguard", "launch", "--nnodes", str(len(HOSTS)), "--node-rank", str(index),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
               "--node-name", host, "--rdzv-host", "127.0.0.1",
               "--rdzv-port", str(master if index == 0 else free_port()),  # node 0's store is the job's
               "--reform-timeout", str(args.reform_timeout),
               *script_args(args, out, ckpt, steps)]
        procs[host] = subprocess.Popen(cmd, env=env, stdout=open(out / f"launch-{host}.log", "w"),
                                       stderr=subprocess.STDOUT)
    return procs


def run_in_place(args: argparse.Namespace, root: Path) -> dict:
    """The shrink: {samples, signal_t, load, steps (per host), codes}."""
    out = root / "in-place"
    out.mkdir(parents=True)
    procs = launch_hosts(args, out, root / "ckpt", 10 ** 6)  # the survivors are stopped once measured
    try:
        wait_for(lambda: all(len(steps_of(out, h)) >= args.warm for h in HOSTS), args.timeout,
                 f"{args.warm} steps on every host", procs)
        pids = {h: steps_of(out, h)[0]["pid"] for h in HOSTS[1:]}
        sampler = Sampler(pids, args.period)
        sampler.start()
        seen = {h: len(steps_of(out, h)) for h in HOSTS}  # steady state: two whole steps sampled on every host
        wait_for(lambda: all(len(steps_of(out, h)) >= seen[h] + 2 for h in HOSTS), args.timeout, "steps sampled",
                 procs)
        signal_t, load = time.monotonic(), os.getloadavg()[0]
        procs["a"].send_signal(signal.SIGTERM)

        def changed_and_trained() -> bool:
            return all(sum(1 for s in steps_of(out, h) if s["world"] == 3) >= args.after for h in HOSTS[1:])

        wait_for(changed_and_trained, args.timeout, "the survivors' steps at 3", procs)
        sampler.stop.set()
        sampler.join()
        codes = {"a": procs["a"].wait(timeout=args.timeout)}
        for host, pid in pids.items():  # nothing is saved after the change: stopping them loses nothing measured
            with contextlib.suppress(ProcessLookupError):  # it may have gone already with the store's host
                os.kill(pid, signal.SIGKILL)
            procs[host].wait(timeout=args.timeout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {"samples": sampler.samples, "signal_t": signal_t, "load": load, "codes": codes,
            "steps": {h: steps_of(out, h) for h in HOSTS}}


def run_relaunch(args: argparse.Namespace, root: Path, resume_step: int) -> dict:
    """torchrun of the same script on 3 ranks from the change's checkpoint: {start_t, steps, load}."""
    out = root / "relaunch"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *script_args(args, out, root / "ckpt", resume_step + args.after)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env["OMP_NUM_THREADS"] = "1"
    load = os.getloadavg()[0]
    start_t = time.monotonic()
    with open(out / "torchrun.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if code != 0:
        raise SystemExit(f"the torchrun relaunch exited {code}: see {out / 'torchrun.log'}")
    return {"start_t": start_t, "load": load, "steps": [steps_of(out, f"rank{r}") for r in range(3)]}


def step_median(lines: list[list[dict]], world: int) -> float:
    """The median time between consecutive steps at `world` ranks, over the given ranks' lines."""
    gaps = [b["t"] - a["t"] for rank in lines for a, b in itertools.pairwise(rank)
            if a["world"] == b["world"] == world and b["step"] == a["step"] + 1]
    if not gaps:
        raise SystemExit(f"no two consecutive steps at {world} ranks to time a step by")
    return statistics.median(gaps)


def memory_rows(run: dict, shard: float) -> dict[str, dict]:
    """Per survivor: its steady state before the signal (the last sample, and the peak of its last
    complete step), the peak between the signal and the end of the change (its Guard's return at
    the agreed step), and the extra over each, in MiB and over the new shard."""
    rows = {}
    for host, series in run["samples"].items():
        lines = run["steps"][host]
        agreed = max((s for s in lines if s["world"] == 4), key=lambda s: s["step"])
        ends = [s["t"] for s in lines if s["t"] <= run["signal_t"]][-2:]
        before = [rss for t, rss in series if t <= run["signal_t"]]
        step_peak = max((rss for t, rss in series if len(ends) == 2 and ends[0] <= t <= ends[1]), default=None)
        during = [rss for t, rss in series if run["signal_t"] <= t <= agreed["back"]]
        if not before or not during or step_peak is None:
            raise SystemExit(f"{host}: no RSS sampled over a steady step before the signal or during the change")
        peak = max(during)
        rows[host] = {"last_mib": before[-1] / 2 ** 20, "step_peak_mib": step_peak / 2 ** 20,
                      "peak_mib": peak / 2 ** 20, "over_last": (peak - before[-1]) / shard,
                      "ratio": (peak - step_peak) / shard, "samples": len(during)}
    return rows


def timeline(run: dict) -> dict[str, dict]:
    """Per survivor, seconds from the SIGTERM: its RSS samples (MiB) and its steps (the --json file)."""
    t0 = run["signal_t"]
    return {host: {"rss": [(round(t - t0, 3), round(rss / 2 ** 20, 1)) for t, rss in series],
                   "steps": [(s["step"], s["world"], round(s["t"] - t0, 3)) for s in run["steps"][host]]}
            for host, series in run["samples"].items()}


def phase_split(run: dict) -> tuple[str, dict[str, float]]:
    """The slowest survivor's change, phase by phase (seconds each, in the order reached)."""
    changes = {h: next(s for s in run["steps"][h] if "phases" in s) for h in HOSTS[1:]}
    host = max(changes, key=lambda h: changes[h]["back"] - changes[h]["t"])
    split, previous = {}, 0.0
    for phase, at in sorted(changes[host]["phases"].items(), key=lambda item: item[1]):
        split[phase], previous = at - previous, at
    return host, split


def change_cost(run: dict) -> tuple[float, float, int]:
    """(the survivors' longest gap across the change, one step at 3 ranks, the agreed step)."""
    gaps, agreed = [], -1
    for host in HOSTS[1:]:
        lines = run["steps"][host]
        last4 = max((s for s in lines if s["world"] == 4), key=lambda s: s["step"])
        first3 = min((s for s in lines if s["world"] == 3), key=lambda s: s["step"])
        gaps.append(first3["t"] - last4["t"])
        agreed = last4["step"]
    return max(gaps), step_median([run["steps"][h] for h in HOSTS[1:]], 3), agreed


def relaunch_cost(relaunch: dict) -> tuple[float, float]:
    """(from torchrun's start to the last rank's first step, one step of the relaunched job)."""
    firsts = [rank[0]["t"] for rank in relaunch["steps"] if rank]
    if len(firsts) != 3:
        raise SystemExit("the relaunch did not complete a step on every rank")
    return max(firsts) - relaunch["start_t"], step_median(relaunch["steps"], 3)


@contextlib.contextmanager
def folder(keep: bool) -> Iterator[str]:
    """The run's folder: removed after a run that measured, unless `keep`; kept (its path printed)
    after a failure, with the launchers' and torchrun's logs."""
    path = tempfile.mkdtemp(prefix="membership-user-path-")
    if keep:
        print(f"the run's folder: {path}", flush=True)
    try:
        yield path
    except BaseException:
        print(f"the run's folder, kept: {path}", flush=True)
        raise
    if not keep:
        shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> int:
    args = parse(argv)
    total = state_bytes(args)
    shard = total / 3
    with folder(args.keep) as tmp:
        run = run_in_place(args, Path(tmp))
        if run["codes"]["a"] != 83:
            raise SystemExit(f"host a's launcher exited {run['codes']['a']}, not 83 (see {tmp}/in-place)")
        gap, step3, agreed = change_cost(run)
        relaunch = run_relaunch(args, Path(tmp), agreed + 1)
    rows = memory_rows(run, shard)
    start, step_r = relaunch_cost(relaunch)
    change, restart = gap - step3, start - step_r
    ratio = change / restart if restart > 0 else float("inf")
    worst = max(r["ratio"] for r in rows.values())
    print(f"FSDP2, {args.layers} x Linear({args.dim}), parameters + AdamW moments = {total / 2**30:.2f} GiB on 4 "
          f"hosts under spotguard launch; SIGTERM to a's launcher; RSS every {args.period * 1000:.0f} ms; "
          f"{os.cpu_count()} cores, load average {run['load']:.1f} at the change, {relaunch['load']:.1f} at the "
          "relaunch")
    print(f"  {'host':5} {'steady: last MiB':>16} {'step peak MiB':>14} {'change peak MiB':>16} "
          f"{'extra/new shard over last':>26} {'over step peak':>15}")
    for host, row in rows.items():
        print(f"  {host:5} {row['last_mib']:16.1f} {row['step_peak_mib']:14.1f} {row['peak_mib']:16.1f} "
              f"{row['over_last']:25.2f}x {row['ratio']:14.2f}x")
    print(f"  new shard {shard / 2**20:.1f} MiB; worst peak extra over the steady step's peak {worst:.2f}x the new "
          f"shard (goal <= {MEMORY_GOAL}x): {'met' if worst <= MEMORY_GOAL else 'NOT MET'}; over the last sample "
          f"before the signal {max(r['over_last'] for r in rows.values()):.2f}x")
    print(f"  change at step {agreed}: survivors' gap {gap:.2f}s, one step at 3 {step3:.2f}s -> {change:.2f}s beyond "
          f"a step; torchrun relaunch: first step {start:.2f}s after its start, one step {step_r:.2f}s -> "
          f"{restart:.2f}s; ratio {ratio:.2f} (goal <= {COST_GOAL}): {'met' if ratio <= COST_GOAL else 'NOT MET'}")
    host, split = phase_split(run)
    print(f"  the change on {host} (the slowest survivor), by phase: "
          + ", ".join(f"{name} {seconds:.2f}" for name, seconds in split.items()) + " s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "worst": worst, "change_s": change, "relaunch_s": restart,
                                         "ratio": ratio, "load": [run["load"], relaunch["load"]],
                                         "phases": split, "timeline": timeline(run)}, indent=1))
    return 0 if worst <= MEMORY_GOAL and ratio <= COST_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
