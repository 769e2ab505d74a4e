"""Shrink and grow of the default group on however many GPUs this machine has (1 included),
through spotguard's own re-form path (`hooks/group_session.py`: `GroupSession.reform` with an
NCCL `Rendezvous`), and what it checked.

    .venv/bin/python bench/nccl_reform.py                       # NCCL on every visible GPU
    .venv/bin/python bench/nccl_reform.py --backend gloo --world 3   # the same walk on CPU (CI)

One process per GPU. The walk, each formation at a fresh store prefix on rank 0's store:
1. `g0/`: every rank forms (NCCL: communicators made eagerly, `device_id`), one all_reduce;
2. shrink: the last rank leaves (with one GPU: the only rank re-forms alone); every rank
   synchronises its stream and aborts its groups (`nccl.quiesce_and_abort`, never a blocking
   destroy); the others form `g1/` and all_reduce;
3. grow: a NEW process takes the freed rank (GPU) and every rank forms `g2/` and all_reduces.
In every formation the Guard's control group (gloo, `GroupCollectives`) votes once too.
Prints one line per check (ok / FAILED, with the seconds each formation and abort took) and
exits 1 when any check failed. NCCL runs refuse to start below the safe versions (`nccl.check`).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

RECIPE_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def form_and_check(session, prefix: str, rank: int, world: int, report, backend: str) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.agreement.collectives import GroupCollectives

    rdzv = session.rendezvous
    t0 = time.monotonic()
    session.reform(f"127.0.0.1:{rdzv.port}", prefix, rank, world, session.timeouts.reform)
    formed = time.monotonic() - t0
    device = torch.device("cuda", rdzv.local_rank) if backend == "nccl" else torch.device("cpu")
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    control = GroupCollectives() if world > 1 else None
    voted = control.all_ok(True) if control is not None else True
    report.put((prefix, rank, world, float(ones.item()) == world and voted, formed))


def finish(backend: str) -> None:
    """The walk's last formation ends as a job does, every peer alive: a plain destroy."""
    import torch.distributed as dist

    if backend == "nccl":
        import torch

        torch.cuda.synchronize()
    dist.destroy_process_group()


def member(rank: int, world: int, port: int, backend: str, report, plan: str) -> None:
    """`plan`: "walk" (ranks of g0; the last leaves after g0 unless alone), or "join" (g2 only)."""
    os.environ.update(RECIPE_ENV)
    from spotguard.hooks.elastic import nccl
    from spotguard.hooks.elastic.rendezvous import Rendezvous
    from spotguard.hooks.group_session import GroupSession, Timeouts

    session = GroupSession(Timeouts.of(60.0), Rendezvous("127.0.0.1", port, backend=backend, local_rank=rank))
    if rank == 0:
        session.rendezvous.serve(session.timeouts.reform)
    try:
        if backend == "nccl":
            nccl.check(session.timeouts.reform)
        if plan == "join":
            form_and_check(session, "g2/", rank, world, report, backend)
            finish(backend)
            return
        form_and_check(session, "g0/", rank, world, report, backend)
        t0 = time.monotonic()
        session.leave()  # NCCL: the stream synchronised, the communicators aborted; gloo: destroyed
        report.put(("abort", rank, world, True, time.monotonic() - t0))
        leaving = world > 1 and rank == world - 1
        if leaving:
            return
        form_and_check(session, "g1/", rank, max(world - 1, 1), report, backend)
        if world > 1:
            form_and_check(session, "g2/", rank, world, report, backend)
        finish(backend)
    except Exception as exc:  # every failure is a line of the report
        report.put(("error", rank, world, False, f"{type(exc).__name__}: {exc}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU; gloo: 2)")
    args = p.parse_args(argv)
    import torch

    world = args.world or (torch.cuda.device_count() if args.backend == "nccl" else 2)
    if world < 1:
        print("no GPU visible: nothing ran (use --backend gloo for the CPU walk)")
        return 1
    print(f"torch {torch.__version__}, backend {args.backend}, world {world}"
          + (f", NCCL {torch.cuda.nccl.version()}" if args.backend == "nccl" else ""))
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=member, args=(r, world, port, args.backend, report, "walk")) for r in range(world)]
    for proc in procs:
        proc.start()
    if world > 1:
        procs[-1].join(timeout=300)  # the leaving rank is gone: its GPU is free for the joiner
        joiner = ctx.Process(target=member, args=(world - 1, world, port, args.backend, report, "join"))
        joiner.start()
        procs.append(joiner)
    for proc in procs:
        proc.join(timeout=300)
    lines = []
    while not report.empty():
        lines.append(report.get())
    expected = {"g0/": world, "abort": world, "g1/": max(world - 1, 1), "g2/": world if world > 1 else 0}
    ok = all(proc.exitcode == 0 for proc in procs)
    for what, count in expected.items():
        got = [line for line in lines if line[0] == what]
        passed = len(got) == count and all(line[3] for line in got)
        ok &= passed
        slowest = max((line[4] for line in got), default=0.0)
        print(f"{'ok' if passed else 'FAILED':6} {what:6} {len(got)}/{count} ranks, slowest {slowest:.3f}s")
    for line in lines:
        if line[0] == "error":
            ok = False
            print(f"FAILED rank {line[1]}: {line[4]}")
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
