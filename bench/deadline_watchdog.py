"""The deadline watchdog: its margin at the deadline over repeated trials, and its cost at rest.

    .venv/bin/python bench/deadline_watchdog.py                  # 5 trials, 10 s grace; 600 steps at rest
    .venv/bin/python bench/deadline_watchdog.py --trials 10 --grace 5

Margin: each trial starts 2 DDP ranks (gloo, a snapshot every 2 steps), holds rank 1 at step 9
for good (a step that outlasts the deadline: rank 0 waits in DDP's all_reduce meanwhile) and
sends it SIGTERM with `--grace` seconds: the watchdog must persist the snapshot of step 8 and
every rank must leave with 83 before the deadline. Reported: the exit codes, the margin each
rank's termination message states, and the margin this script sees (deadline - the later exit).

At rest: 2 ranks train `--steps` 50 ms steps (sleep + a DDP step, no snapshots) under the Guard,
in blocks of 50 steps alternating the watchdog running and stopped (ABBA); reported: the mean step time of
each arm, the time inside `guard.step()`, and the CPU time the watchdog's thread used per
second of training (psutil, per thread).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 50


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=600, help="steps of the at-rest run (blocks of 50)")
    p.add_argument("--worker", choices=("margin", "rest"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- workers -----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
    from spotguard.hooks.guard import Guard

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(args.out)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=str(out / "ckpt"))
    guard = Guard.from_env(adapter=adapter, snapshot_every=2 if args.worker == "margin" else 0)
    x = torch.randn(8, 64)
    if args.worker == "margin":
        for step in range(10**6):
            if step == 9 and rank == 1:
                (out / "holding").write_text("1")
                while True:
                    time.sleep(0.02)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            guard.step(step)
    rest(args, guard, model, optimizer, x, rank, out)


def rest(args, guard, model, optimizer, x, rank: int, out: Path) -> None:
    import psutil
    import torch.distributed as dist

    from spotguard.hooks.deadline_watchdog import DeadlineWatchdog

    arms: dict[str, list[float]] = {"on": [], "off": []}
    inside: dict[str, list[float]] = {"on": [], "off": []}
    cpu, trained = 0.0, 0.0
    for block in range(args.steps // BLOCK):
        arm = "on" if block % 4 in (0, 3) else "off"
        if arm == "off" and guard.deadline is not None:
            guard.deadline.close()
            guard.deadline = None
        elif arm == "on" and guard.deadline is None:
            guard.deadline = DeadlineWatchdog(lambda: guard.adapter, guard.save_margin_seconds).start()
        dist.barrier()
        started = time.perf_counter()
        for step in range(block * BLOCK, (block + 1) * BLOCK):
            t0 = time.perf_counter()
            time.sleep(0.05)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            t1 = time.perf_counter()
            guard.step(step)
            t2 = time.perf_counter()
            arms[arm].append(t2 - t0)
            inside[arm].append(t2 - t1)
        if arm == "on":
            native = guard.deadline._thread.native_id
            used = sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native)
            cpu += used
            trained += time.perf_counter() - started
            guard.deadline.close()
            guard.deadline = None
    (out / f"rest-{rank}.json").write_text(json.dumps({
        arm: {"step_ms": 1e3 * statistics.mean(arms[arm]), "inside_ms": 1e3 * statistics.mean(inside[arm])}
        for arm in arms} | {"cpu_per_s": cpu / trained if trained else 0.0, "trained_s": trained}))
    guard.close()
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------------
def start(world_dir: Path, mode: str, grace: float) -> list[subprocess.Popen]:
    from spotguard.processes import free_port

    port, procs = str(free_port()), []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   SPOTGUARD_GRACE_SECONDS=str(grace), SPOTGUARD_TERMINATION_LOG=str(world_dir / f"term-{rank}"))
        log = open(world_dir / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", mode, "--out", str(world_dir)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(end - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            codes.append(None)
    return codes


def margin_trial(root: Path, grace: float) -> dict:
    root.mkdir(parents=True)
    procs = start(root, "margin", grace)
    end = time.monotonic() + 300
    while not (root / "holding").exists():
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            finish(procs, 1)
            raise RuntimeError(f"trial did not reach the long step: {root}")
        time.sleep(0.02)
    signalled = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)
    exited = []
    for proc in procs:
        codes = finish([proc], grace + 60)
        exited.append((codes[0], time.monotonic()))
    stated = [json.loads((root / f"term-{r}").read_text()) for r in range(2)]
    return {"codes": [c for c, _ in exited], "seen_margin": grace - (max(t for _, t in exited) - signalled),
            "stated": [m.get("margin_seconds") for m in stated], "saved": [m.get("saved_step") for m in stated]}


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-deadline-") as tmp:
        trials = [margin_trial(Path(tmp) / f"trial-{i}", args.grace) for i in range(args.trials)]
        for i, t in enumerate(trials):
            print(f"trial {i}: exit {t['codes']}, saved step {t['saved']}, margin stated "
                  f"{t['stated']} s, seen {t['seen_margin']:.2f} s", flush=True)
        seen = [t["seen_margin"] for t in trials]
        ok = sum(t["codes"] == [83, 83] and t["seen_margin"] > 0 for t in trials)
        print(f"margin at the deadline ({args.grace:g} s grace): {ok}/{len(trials)} trials left with 83 before it; "
              f"seen margin min {min(seen):.2f}, median {statistics.median(seen):.2f} s")
        root = Path(tmp) / "rest"
        root.mkdir()
        codes = finish(start(root, "rest", 30.0), 60 + args.steps * 0.2)
        if codes != [0, 0]:
            print(f"at-rest run failed: {codes}; see {root}")
            return 1
        for rank in range(2):
            r = json.loads((root / f"rest-{rank}.json").read_text())
            change = 100 * (r["on"]["step_ms"] / r["off"]["step_ms"] - 1)
            print(f"at rest, rank {rank}: step {r['on']['step_ms']:.3f} ms with the watchdog vs "
                  f"{r['off']['step_ms']:.3f} ms without ({change:+.2f}%); "
                  f"inside guard.step() {1e3 * r['on']['inside_ms']:.1f} vs {1e3 * r['off']['inside_ms']:.1f} us; "
                  f"the watchdog thread's CPU {1e3 * r['cpu_per_s']:.3f} ms per second (psutil counts 10 ms "
                  f"ticks: below {10 / r['trained_s']:.3f} ms per second when 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
