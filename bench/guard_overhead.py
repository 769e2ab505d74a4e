"""Guard cost per step with no notice pending: the same training loop with and without the Guard.

    .venv/bin/python bench/guard_overhead.py                    # 4 ranks, 50 ms steps, 120 steps per arm
    .venv/bin/python bench/guard_overhead.py --steps 600 --agree-every 1

Each rank's step is `--step-ms` of synthetic compute (sleep) plus a DDP step of a tiny model
on gloo over 127.0.0.1. The two arms alternate in blocks inside the same processes (so drift hits both);
the Guard arms call `guard.step(step)` after every step: "blocking" does one all_reduce(MAX)
of a 3-element tensor on the Guard's own gloo group every `--agree-every` steps; "piggyback"
(`guard.piggyback_on(ddp_model)`, what TorchDCPAdapter does for DDP) adds one element to the
model's own last gradient bucket instead; "pipelined"
(`Guard(pipeline=True)`) overlaps that all_reduce with the next step. Printed: mean step time
of each arm, the overhead ratio against the arm without a Guard (goal <= 1%), and the time
spent inside guard.step() itself.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=120, help="steps per arm")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks per arm")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--agree-every", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.guard import Guard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    step_seconds = args.step_ms / 1000

    def train_step(ddp=None, opt=None) -> None:
        # the synthetic step: a fixed 50 ms of "compute" (sleep), then a real DDP step (its
        # gradient all_reduce is the training collective the Guard's agreement sits beside;
        # the piggyback arm's model carries the Guard's flag inside that all_reduce)
        ddp, opt = ddp or model, opt or optimizer
        time.sleep(step_seconds)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    guards = {"blocking": Guard(agree_every=args.agree_every, install_signals=True, exit_on_drain=False),
              "pipelined": Guard(agree_every=args.agree_every, install_signals=False, exit_on_drain=False,
                                 pipeline=True),
              "piggyback": Guard(install_signals=False, exit_on_drain=False)}
    piggy_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    piggy_optimizer = torch.optim.SGD(piggy_model.parameters(), lr=0.01)
    assert guards["piggyback"].piggyback_on(piggy_model)
    arms = ("without", "blocking", "pipelined", "piggyback")
    per_block = max(1, args.steps // args.blocks)
    times = dict.fromkeys(arms, 0.0)
    inside = dict.fromkeys(arms, 0.0)
    step = 0
    def step_of(arm):
        return (lambda: train_step(piggy_model, piggy_optimizer)) if arm == "piggyback" else train_step

    for arm, guard in guards.items():  # warm-up of every path
        for _ in range(3):
            step_of(arm)()
            guard.step(step)
            step += 1
    for block in range(len(arms) * args.blocks):
        arm = arms[block % len(arms)]
        guard = guards.get(arm)
        dist.barrier()
        t0 = time.perf_counter()
        run_step = step_of(arm)
        for _ in range(per_block):
            run_step()
            if guard is not None:
                g0 = time.perf_counter()
                guard.step(step)
                inside[arm] += time.perf_counter() - g0
            step += 1
        if guard is not None:  # the last overlapped all_reduce (pipelined) belongs to this arm
            guard.agreement.settle()
        times[arm] += time.perf_counter() - t0
    for guard in guards.values():
        guard.close()
    if rank == 0:
        steps = per_block * args.blocks
        Path(args.result).write_text(json.dumps({"steps": steps, "time": {a: times[a] / steps for a in arms},
                                                 "inside": {a: inside[a] / steps for a in arms}}))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port = str(free_port())
        procs = []
        try:
            for rank in range(args.ranks):
                env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
                env.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--result", str(result),
                                               "--steps", str(args.steps), "--blocks", str(args.blocks),
                                               "--step-ms", str(args.step_ms), "--agree-every", str(args.agree_every)],
                                              env=env))
            timeout = 60 + 3 * 2 * args.steps * args.step_ms / 1000
            codes = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        if any(codes):
            print(f"workers failed: exit codes {codes}", file=sys.stderr)
            return 1
        r = json.loads(result.read_text())
    base = r["time"]["without"]
    print(f"guard_overhead: {args.ranks} ranks, gloo, {args.step_ms:.0f} ms step, agree every {args.agree_every}, "
          f"{r['steps']} steps per arm (arms interleaved in blocks)")
    print(f"  step without Guard       : {base * 1000:8.3f} ms")
    for arm in ("blocking", "pipelined", "piggyback"):
        t, inside = r["time"][arm], r["inside"][arm]
        overhead = (t - base) / base
        print(f"  step with Guard {arm:9}: {t * 1000:8.3f} ms  overhead {overhead * 100:+6.2f}% "
              f"(goal <= 1%: {'met' if overhead <= 0.01 else 'NOT met'}); inside guard.step() {inside * 1000:.3f} ms")
    print("  (blocking: the Guard's own all_reduce, a notice acts at the next step boundary; pipelined: that\n"
          "   all_reduce overlapped, one agreement later; piggyback (the default for DDP): the flag rides in the\n"
          "   gradient all_reduce, a notice acts at the next boundary; see bench/guard_reaction.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
