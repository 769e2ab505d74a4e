"""Checkpoint speed: each adapter's notice path (stall, time to durable) against the frameworks' saves.

    .venv/bin/python bench/checkpoint_speed.py                      # ~1 GB of state (default)
    .venv/bin/python bench/checkpoint_speed.py --size-mb 256 --repeat 3 --dir /mnt/pvc/tmp
    python3 bench/checkpoint_speed.py --device cuda --skip-deepspeed   # the state on a GPU

The state is a model (Linear layers) plus its AdamW state after one step, ~--size-mb in all. In
one run, each round saves these same bytes once per method:
- the adapters' notice path, `adapter.save(step, reason="notice")` as the Guard calls it, after
  `adapter.prepare()` (buffers allocated before the notice, as in a job that snapshots):
  PlainTorchAdapter, TorchDCPAdapter, DeepSpeedAdapter (ZeRO-0). "stall" is the snapshot engine's
  copy (the time the training state is held), "durable" the whole call (committed, fsynced);
- the frameworks' own saves of the same state: torch.save + fsync, dcp.save (sync_files),
  DeepSpeed save_checkpoint + fsync (synchronous: stall = durable);
- the raw limits: a memcpy of the state into preallocated buffers, and one sequential write +
  fsync of the same bytes.
Goals (issue 21), for every adapter: stall <= 2x memcpy, durable <= 1.25x the raw write. Files go
to a temporary directory (under /tmp unless --dir) removed at the end.

With `--device cuda` the model and its optimizer state live on the GPU, and the engine's buffers
are pinned host memory filled on a side stream. The memcpy limit is then a device-to-host copy
into preallocated pinned buffers (synchronised); the stall has two rows per adapter: the host's (the time
`adapter.save` holds the loop before queueing the copy), and "GPU stall", the time the training
stream waits for that same save's snapshot (its copy into the pinned buffers, timed with CUDA
events on the GPU). Each adapter's buffers must be allocated once, at `prepare()`: the bench
prints how many allocations each made (1 expected). Extra
rows: `tensor.cpu()` of the state (pageable, allocating) and a copy into pageable preallocated
buffers, the two ways a snapshot is usually written. After the rounds every adapter saves once
more, the model and optimizer are zeroed, `adapter.resume()` loads the checkpoint back onto the
device, and the bench checks every tensor is bit-identical to what was saved ("verify" lines).
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
from torch.utils._pytree import tree_leaves

from spotguard.hooks.checkpoint import CheckpointStore

from _raw_limits import raw_write_seconds  # bench/_raw_limits.py

MEMCPY = "memcpy of the state (raw limit)"
RAW = "sequential write + fsync (raw limit)"
ADAPTERS = ("PlainTorchAdapter.save (notice)", "TorchDCPAdapter.save (notice)",
            "DeepSpeedAdapter.save (notice, ZeRO-0)")


def build_state(size_mb: int, device: str = "cpu"):
    """A Linear stack + AdamW (one step taken): parameters are a third of the bytes."""
    params_bytes = size_mb * (1 << 20) // 3
    width = 2048
    layers = max(1, params_bytes // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def tensors_of(state) -> list[torch.Tensor]:
    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def on_gpu(state) -> bool:
    return any(t.is_cuda for t in tensors_of(state))


def sync(state) -> None:
    if on_gpu(state):
        torch.cuda.synchronize()


def measure_memcpy(state, pinned: bool | None = None) -> float:
    """A copy into preallocated host buffers (pinned ones when the state is on a GPU, unless
    `pinned` says otherwise), synchronised."""
    tensors = tensors_of(state)
    pin = on_gpu(state) if pinned is None else pinned
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.numel() > 0) for t in tensors]
    for d in dst:
        d.zero_()  # fault the pages in first, as the engine does when it allocates
    sync(state)
    started = time.perf_counter()
    for d, t in zip(dst, tensors):
        d.copy_(t, non_blocking=pin)
    sync(state)
    return time.perf_counter() - started


def measure_cpu_copy(state) -> float:
    """`tensor.cpu()` of every tensor: pageable host memory allocated by the copy."""
    sync(state)
    started = time.perf_counter()
    copies = [t.cpu() for t in tensors_of(state)]
    elapsed = time.perf_counter() - started
    del copies
    return elapsed


def gpu_stall(adapter) -> float | None:
    """What the training stream waited for in the adapter's last save: its snapshot's copy into
    the pinned buffers, timed on the GPU by CUDA events (None on CPU)."""
    return adapter.snapshot_engine.buffers.gpu_copy_seconds()


def measure_raw_write(state, directory: Path) -> float:
    """One sequential write + fsync of the state's bytes (host tensors: a GPU state's host copy)."""
    return raw_write_seconds(tensors_of(state), directory)


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


def measure_deepspeed_save(engine, directory: Path) -> float:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ours = engine.checkpoint_engine
    engine.checkpoint_engine = TorchCheckpointEngine()
    save_dir = directory / "ds"
    try:
        started = time.perf_counter()
        engine.save_checkpoint(str(save_dir), tag="bench", save_latest=False)
        for path in (save_dir / "bench").iterdir():  # DeepSpeed does not fsync: do it so the bytes are durable
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return time.perf_counter() - started
    finally:
        engine.checkpoint_engine = ours


def measure_adapter(adapter, step: int) -> tuple[float, float]:
    """The notice path: stall (the engine's copy) and durable (the whole save)."""
    started = time.perf_counter()
    adapter.save(step, reason="notice")
    durable = time.perf_counter() - started
    return adapter.snapshot_engine.snapshot_seconds[-1], durable


def init_gloo(with_deepspeed: bool = True) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not with_deepspeed:
        dist.init_process_group("gloo")
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def verify_resume(adapters: dict, model, opt, step: int) -> bool:
    """Each adapter saves `step`, the state is zeroed, `resume()` loads it back: bit-identical?"""
    reference = [t.detach().cpu().clone() for t in tensors_of({"m": model.state_dict(), "o": opt.state_dict()})]
    ok = True
    for name, adapter in adapters.items():
        adapter.save(step, reason="notice")
        with torch.no_grad():
            for t in tensors_of({"m": model.state_dict(), "o": opt.state_dict()}):
                if t.is_floating_point():
                    t.zero_()
        start = adapter.resume()  # the step to start from: the saved one + 1
        now = tensors_of({"m": model.state_dict(), "o": opt.state_dict()})
        same = len(now) == len(reference) and all(torch.equal(a.cpu(), b) for a, b in zip(now, reference))
        devices = sorted({str(t.device) for t in now})
        passed = same and start == step + 1
        print(f"verify {name}: resume() -> start {start}, {len(now)} tensors on {devices}, "
              f"{'bit-identical' if passed else 'MISMATCH'}", flush=True)
        ok &= passed
    return ok


def settle(directory: Path) -> None:
    """Removes the previous method's files and flushes dirty pages so methods do not overlap."""
    for entry in directory.iterdir():
        if entry.name.startswith("store-"):
            for sub in entry.iterdir():  # the adapters' stores stay open: only their checkpoints go
                if sub.is_dir() and not sub.name.startswith("."):
                    shutil.rmtree(sub)
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    os.sync()


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _min(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def print_table(label: str, rows: dict, nbytes: int) -> None:
    memcpy, raw = rows[MEMCPY][0], rows[RAW][1]
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    ratio = lambda v, base: f"{v / base:7.2f}x" if v is not None else "       -"  # noqa: E731
    print(f"\n[{label}]")
    print(f"{'method':50s} {'stall s':>8s} {'/memcpy':>8s} {'durable s':>9s} {'/raw wr':>8s} {'GB/s':>6s}")
    for name, (stall, durable) in rows.items():
        rate = f"{nbytes / durable / 1e9:6.2f}" if durable else "     -"
        print(f"{name:50s} {fmt(stall)} {ratio(stall, memcpy)} {fmt(durable):>9s} {ratio(durable, raw)} {rate}")
    print("goals, every adapter: stall <= 2x memcpy, durable <= 1.25x raw write")
    for name in ADAPTERS:
        if name not in rows:
            continue
        stall, durable = rows[name]
        gpu_stall = rows.get(f"{name.split('.')[0]} GPU stall (pinned copy-in)", (None,))[0]
        stall_text = f"stall {stall / memcpy:.2f}x {'MET' if stall <= 2 * memcpy else 'NOT MET'}"
        if gpu_stall is not None:  # on a GPU the training stream's wait is the stall that counts
            stall_text = (f"host stall {stall / memcpy:.2f}x, GPU stall {gpu_stall / memcpy:.2f}x "
                          f"{'MET' if max(stall, gpu_stall) <= 2 * memcpy else 'NOT MET'}")
        print(f"  {name}: {stall_text}; durable {durable / raw:.2f}x {'MET' if durable <= 1.25 * raw else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="approximate state size (default 1024)")
    parser.add_argument("--dir", default=None, help="parent directory for the temporary files (default /tmp)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all methods; medians shown (default 3)")
    parser.add_argument("--skip-deepspeed", action="store_true", help="leave out the DeepSpeed rows")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and optimizer state live (default cpu)")
    parser.add_argument("--no-verify", action="store_true", help="skip the save / zero / resume check")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no GPU visible to torch", file=sys.stderr)
        return 1
    wall = time.perf_counter()
    parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    need = args.size_mb * (1 << 20) * 3
    if free < need:
        print(f"not enough disk space in {parent}: {free / 2**30:.1f} GiB free, need {need / 2**30:.1f} GiB",
              file=sys.stderr)
        return 1
    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

    init_gloo(with_deepspeed=not args.skip_deepspeed)
    model, opt = build_state(args.size_mb, args.device)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    gpu = args.device == "cuda"
    host_state = [t.detach().cpu() for t in tensors_of(state)] if gpu else state  # the raw write's bytes
    work = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir=parent))
    adapters = {ADAPTERS[0]: PlainTorchAdapter(model, opt, store=CheckpointStore(work / "store-plain", keep_last=1)),
                ADAPTERS[1]: TorchDCPAdapter(model, opt, store=CheckpointStore(work / "store-dcp", keep_last=1))}
    ds_engine = None
    if not args.skip_deepspeed:
        import deepspeed
        from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter

        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
               "zero_allow_untested_optimizer": True}
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        adapters[ADAPTERS[2]] = DeepSpeedAdapter(ds_engine, store=CheckpointStore(work / "store-ds", keep_last=1))
    rounds: list[dict[str, tuple[float | None, float | None]]] = []
    try:
        load = os.getloadavg()
        where = torch.cuda.get_device_name() if gpu else "cpu"
        print(f"state: {nbytes / 1e6:.0f} MB in {len(tensors_of(state))} tensors on {where}; dir {work} "
              f"({free / 2**30:.0f} GiB free); {os.cpu_count()} CPUs, load {load[0]:.1f} / {load[1]:.1f}; "
              f"{args.repeat} round(s)", flush=True)
        for adapter in adapters.values():
            adapter.prepare()  # the buffers, allocated before any notice
        measure_raw_write(host_state, work)  # warm-up: the first write to fresh disk blocks is slower here
        for round_no in range(args.repeat):
            rows: dict[str, tuple[float | None, float | None]] = {}
            settle(work)
            rows[MEMCPY] = (measure_memcpy(state), None)
            settle(work)
            rows[RAW] = (None, measure_raw_write(host_state, work))
            if gpu:
                rows["copy into pageable preallocated buffers"] = (measure_memcpy(state, pinned=False), None)
                rows["tensor.cpu() (pageable, allocating)"] = (measure_cpu_copy(state), None)
            for name, adapter in adapters.items():
                settle(work)
                sync(state)
                rows[name] = measure_adapter(adapter, round_no + 1)
                if gpu:
                    rows[f"{name.split('.')[0]} GPU stall (pinned copy-in)"] = (gpu_stall(adapter), None)
            settle(work)
            t = measure_torch_save(state, work)
            rows["torch.save + fsync"] = (t, t)
            settle(work)
            t = measure_dcp(state, work)
            rows["dcp.save"] = (t, t)
            if ds_engine is not None:
                settle(work)
                t = measure_deepspeed_save(ds_engine, work)
                rows["DeepSpeed save_checkpoint (ZeRO-0) + fsync"] = (t, t)
            rounds.append(rows)
            ratios = ", ".join(f"{name.split('.')[0]} {rows[name][1] / rows[RAW][1]:.2f}x" for name in adapters)
            print(f"round {round_no + 1} done, load {os.getloadavg()[0]:.1f}; durable / raw write: {ratios}",
                  flush=True)
        allocations = {name.split(".")[0]: a.snapshot_engine.buffers.allocations for name, a in adapters.items()}
        print(f"snapshot buffer allocations over the rounds (1 expected): {allocations}", flush=True)
        verified = True if args.no_verify else verify_resume(adapters, model, opt, args.repeat + 1)
    finally:
        for adapter in adapters.values():
            adapter.close()
        shutil.rmtree(work, ignore_errors=True)
    # The disk's speed wanders between identical writes, so both statistics are shown, each
    # computed the same way for every method: the median round and the best round.
    for label, pick in (("median of rounds", _median), ("best round", _min)):
        rows = {name: tuple(pick([r[name][i] for r in rounds]) for i in (0, 1)) for name in rounds[0]}
        print_table(label, rows, nbytes)
    print(f"\nsize {nbytes / 1e6:.0f} MB; load at the end {os.getloadavg()[0]:.1f}; "
          f"bench wall time {time.perf_counter() - wall:.1f}s")
    if not verified:
        print("a resumed state differs from the saved one (see the verify lines)", file=sys.stderr)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
