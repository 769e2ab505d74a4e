"""Checkpoint speed: time until durable and training stall, spotguard's path vs the frameworks.

    .venv/bin/python bench/checkpoint_speed.py                 # ~1 GB of state (default)
    .venv/bin/python bench/checkpoint_speed.py --size-mb 256 --files 4 --dir /mnt/pvc/tmp

The state is a model (Linear layers) plus its AdamW state after one step, ~--size-mb in all;
every method saves these same bytes once (one run, no repetition). "stall" is how long the
training loop is blocked; "durable" is until the bytes (and the commit) are fsynced. Raw
limits: a memcpy of the state into preallocated buffers, and one sequential write + fsync of
the same bytes. Goals (issue 5): durable <= 1.25x the raw write; stall <= 2x the memcpy;
faster than torch.save, dcp.save and DeepSpeed save_checkpoint. Files go to a temporary
directory (under /tmp unless --dir) that is removed at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from spotguard.hooks.checkpoint import CheckpointStore, FastCheckpointer
from spotguard.hooks.checkpoint.layout import flatten
from spotguard.hooks.checkpoint.rawformat import as_bytes


def build_state(size_mb: int):
    """A Linear stack + AdamW (one step taken): parameters are a third of the bytes."""
    params_bytes = size_mb * (1 << 20) // 3
    width = 2048
    layers = max(1, params_bytes // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def state_of(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for _, t in flatten(state)[1])


def measure_memcpy(state) -> float:
    _, tensors = flatten(state)
    dst = [torch.empty_like(t) for _, t in tensors]
    for d in dst:
        d.zero_()  # fault the pages in first, as the fast path does at prepare time
    started = time.perf_counter()
    for d, (_, t) in zip(dst, tensors):
        d.copy_(t)
    return time.perf_counter() - started


def measure_raw_write(state, directory: Path) -> float:
    _, tensors = flatten(state)
    started = time.perf_counter()
    fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _, t in tensors:
            view = as_bytes(t.contiguous())
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos:pos + (8 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def measure_fast(state, directory: Path, files: int, mode: str) -> tuple[float, float]:
    store = CheckpointStore(directory / f"fast-{mode}")
    with FastCheckpointer(files=files, mode=mode) as fast:
        fast.prepare(state)
        started = time.perf_counter()
        _snap, done = fast.save(store, "bench", state, step=1)
        stall = time.perf_counter() - started
        done.result()
        durable = time.perf_counter() - started
    return stall, durable


def measure_torch_save(state, directory: Path) -> float:
    path = directory / "torch_save.pt"
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def measure_dcp(state, directory: Path) -> float:
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory / "dcp", sync_files=True))
    return time.perf_counter() - started


def init_gloo() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def measure_deepspeed(model, opt, directory: Path, via_store: bool) -> float:
    import deepspeed

    init_gloo()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    save_dir = directory / ("ds-store" if via_store else "ds")
    if via_store:
        store = CheckpointStore(save_dir)
        engine.checkpoint_engine = store.deepspeed_engine()
        engine.checkpoint_engine.prepare({"step": 1})
    started = time.perf_counter()
    engine.save_checkpoint(str(save_dir), tag="bench", save_latest=not via_store)
    if not via_store:  # DeepSpeed's own engine does not fsync: do it so the bytes are durable
        for path in (save_dir / "bench").iterdir():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elapsed = time.perf_counter() - started
    if via_store:
        engine.checkpoint_engine.cleanup()
    return elapsed


def settle(directory: Path) -> None:
    """Removes the previous method's files and flushes dirty pages so methods do not overlap."""
    for entry in directory.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    os.sync()


def _min(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def print_table(label: str, rows: dict, nbytes: int) -> None:
    """One table of the methods with ratios, then the goals for the best spotguard mode."""
    memcpy = rows["memcpy of the state (raw limit)"][0]
    raw = rows["sequential write + fsync (raw limit)"][1]
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    ratio = lambda v, base: f"{v / base:7.2f}x" if v is not None else "       -"  # noqa: E731
    print(f"\n[{label}]")
    print(f"{'method':50s} {'stall s':>8s} {'/memcpy':>8s} {'durable s':>9s} {'/raw wr':>8s} {'GB/s':>6s}")
    for name, (stall, durable) in rows.items():
        rate = f"{nbytes / durable / 1e9:6.2f}" if durable else "     -"
        print(f"{name:50s} {fmt(stall)} {ratio(stall, memcpy)} {fmt(durable):>9s} {ratio(durable, raw)} {rate}")
    best = min((k for k in rows if k.startswith("spotguard")), key=lambda k: rows[k][1])
    stall, durable = rows[best]
    print(f"goals for the best spotguard mode ({best}):")
    print(f"  durable {durable:.3f}s <= 1.25 x raw write {raw:.3f}s = {1.25 * raw:.3f}s: "
          f"{'MET' if durable <= 1.25 * raw else 'NOT MET'}")
    print(f"  stall {stall:.3f}s <= 2 x memcpy {memcpy:.3f}s = {2 * memcpy:.3f}s: "
          f"{'MET' if stall <= 2 * memcpy else 'NOT MET'}")
    for name in ("torch.save + fsync", "dcp.save", "DeepSpeed save_checkpoint (ZeRO-0) + fsync"):
        if name in rows:
            other = rows[name][1]
            print(f"  faster than {name}: {durable:.3f}s vs {other:.3f}s ({other / durable:.1f}x): "
                  f"{'MET' if durable < other else 'NOT MET'}")


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="approximate state size (default 1024)")
    parser.add_argument("--files", type=int, default=4, help="parallel data files of the fast path (default 4)")
    parser.add_argument("--dir", default=None, help="parent directory for the temporary files (default /tmp)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all methods; medians shown (default 3)")
    parser.add_argument("--skip-deepspeed", action="store_true", help="leave out the DeepSpeed rows")
    args = parser.parse_args(argv)
    wall = time.perf_counter()
    parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    need = args.size_mb * (1 << 20) * 2
    if free < need:
        print(f"not enough disk space in {parent}: {free / 2**30:.1f} GiB free, need {need / 2**30:.1f} GiB",
              file=sys.stderr)
        return 1
    model, opt = build_state(args.size_mb)
    state = state_of(model, opt)
    nbytes = state_bytes(state)
    work = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir=parent))
    rounds: list[dict[str, tuple[float | None, float | None]]] = []
    try:
        print(f"state: {nbytes / 1e6:.0f} MB in {len(flatten(state)[1])} tensors; dir {work} "
              f"({free / 2**30:.0f} GiB free); {os.cpu_count()} CPUs; {args.repeat} round(s), median shown", flush=True)
        measure_raw_write(state, work)  # warm-up: the first write to fresh disk blocks is slower here
        for _ in range(args.repeat):
            rows: dict[str, tuple[float | None, float | None]] = {}
            settle(work)
            rows["memcpy of the state (raw limit)"] = (measure_memcpy(state), None)
            settle(work)
            rows["sequential write + fsync (raw limit)"] = (None, measure_raw_write(state, work))
            for mode in ("thread", "process"):
                settle(work)
                rows[f"spotguard fast path ({mode} writers)"] = measure_fast(state, work, args.files, mode)
            settle(work)
            t = measure_torch_save(state, work)
            rows["torch.save + fsync"] = (t, t)
            settle(work)
            t = measure_dcp(state, work)
            rows["dcp.save"] = (t, t)
            if not args.skip_deepspeed:
                settle(work)
                t = measure_deepspeed(model, opt, work, via_store=False)
                rows["DeepSpeed save_checkpoint (ZeRO-0) + fsync"] = (t, t)
                settle(work)
                t = measure_deepspeed(model, opt, work, via_store=True)
                rows["DeepSpeed save_checkpoint via spotguard engine"] = (t, t)
            rounds.append(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # This disk's speed wanders by 2x between identical writes, so both statistics are shown,
    # each computed the same way for every method: the median round and the best round.
    for label, pick in (("median of rounds", _median), ("best round", _min)):
        rows = {name: tuple(pick([r[name][i] for r in rounds]) for i in (0, 1)) for name in rounds[0]}
        print_table(label, rows, nbytes)
    print(f"\nsize {nbytes / 1e6:.0f} MB; bench wall time {time.perf_counter() - wall:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
