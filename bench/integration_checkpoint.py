"""Integration checkpoints: each integration's notice path (stall, time to durable) vs the framework's own save.

    .venv/bin/python bench/integration_checkpoint.py                          # ~256 MB of state, 3 rounds
    .venv/bin/python bench/integration_checkpoint.py --frameworks lightning --size-mb 512 --repeat 5 --dir /mnt/pvc

For each framework (the Trainer, Accelerate, Lightning) one process trains a Linear stack with AdamW
for one step (parameters a third of ~--size-mb, the optimizer's moments the rest), then, in rounds,
saves these same bytes once per method:
- spotguard's notice path, `adapter.save(step, reason="notice")` as the Guard's drain calls it, after
  `adapter.prepare()` (buffers allocated before the notice, as the integrations do at a run's first
  step): "stall" is the snapshot engine's part at the step boundary (the framework's save call with
  its writes captured, and the copy into the buffers, until it landed: with `--device cuda` a copy
  into pinned buffers on a side stream), "durable" the whole call (the store's commit);
- the framework's own save of the same state into a fresh directory, then an fsync of every file it
  wrote (Trainer._save_checkpoint, accelerator.save_state, trainer.save_checkpoint): synchronous, so
  its stall is its time to durable;
- the raw limits: a memcpy of the state's tensors into preallocated host buffers (pinned, from a
  GPU), and one sequential write + fsync of the same bytes.
Goals (issue 21), for every adapter's notice path: stall <= 2x memcpy, durable <= 1.25x the raw
write. Printed per framework: the median of each method over the rounds, and its ratio to the limit.
Files go to a temporary directory (under /tmp unless --dir), removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _raw_limits import raw_write_seconds  # bench/_raw_limits.py

FRAMEWORKS = ("hf", "accelerate", "lightning")
WIDTH = 2048
NOTICE, OWN, MEMCPY, RAW = "spotguard notice path", "framework's own save + fsync", "memcpy (raw limit)", \
    "sequential write + fsync (raw limit)"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--size-mb", type=int, default=256, help="bytes of state (parameters + AdamW moments)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (each method once per round)")
    p.add_argument("--dir", default=None, help="where the files go (a temporary directory under it)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the state and the raw limits ---------------------------------------------------------------
def linear_stack(size_mb: int):
    """A Linear stack whose parameters are a third of `size_mb` (AdamW's two moments the rest)."""
    import torch

    class Stack(torch.nn.Module):
        def __init__(self, layers: int):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])

        def forward(self, x, labels=None):
            return {"loss": self.net(x).square().mean()}

    return Stack(max(1, size_mb * (1 << 20) // 3 // (WIDTH * WIDTH * 4)))


def tensors(model, optimizer) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    state = [model.state_dict(), optimizer.state_dict()]
    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def memcpy_seconds(sources: list) -> float:
    """A copy of `sources` into host buffers allocated (and touched) first: pinned, from a GPU."""
    import torch

    on_gpu = any(t.is_cuda for t in sources)
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in sources]
    for t in targets:
        t.zero_()  # pages faulted in first, as the engine's buffers are
    started = time.perf_counter()
    for target, source in zip(targets, sources):
        target.copy_(source, non_blocking=on_gpu)
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def timed_stalls(engine) -> list[float]:
    """Seconds of each of `engine`'s snapshots, until their copies landed (on a GPU the snapshot
    returns once they are queued, and the training stream waits for them): the step's stall."""
    import torch

    stalls: list[float] = []
    real = engine.snapshot

    def snapshot(*args, **kwargs):
        started = time.perf_counter()
        snap = real(*args, **kwargs)
        if engine.buffers.pinned:
            torch.cuda.current_stream().synchronize()
        stalls.append(time.perf_counter() - started)
        return snap

    engine.snapshot = snapshot
    return stalls


def own_save_seconds(save, directory: Path) -> float:
    """The framework's own save into `directory`, then every file it wrote fsynced."""
    from spotguard.hooks.checkpoint import fsutil

    started = time.perf_counter()
    save(directory)
    fsutil.fsync_tree(directory)
    return time.perf_counter() - started


def settle(work: Path, store_root: Path) -> None:
    """Removes the previous method's files (the store's checkpoints, not the store) and flushes dirty pages."""
    for entry in work.iterdir():
        if entry == store_root:
            for sub in entry.iterdir():
                if sub.is_dir() and not sub.name.startswith("."):
                    shutil.rmtree(sub)
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    os.sync()


# ---- one framework's set-up: (adapter, own save of a directory, model, optimizer) ---------------
def hf_setup(size_mb: int, work: Path, device: str):
    import torch
    from transformers import Trainer, TrainingArguments

    from spotguard.integrations.hf import TrainerSave

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.randn(WIDTH)}

    args = TrainingArguments(output_dir=str(work / "store"), per_device_train_batch_size=4, max_steps=1,
                             save_strategy="no", logging_strategy="no", report_to=[],
                             remove_unused_columns=False, disable_tqdm=True, use_cpu=device == "cpu")
    trainer = Trainer(model=linear_stack(size_mb), args=args, train_dataset=Rows())
    trainer.train()

    def own(directory: Path) -> None:
        args.output_dir = str(directory)
        try:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        finally:
            args.output_dir = str(work / "store")

    return TrainerSave(trainer), own, trainer.model, trainer.optimizer


def accelerate_setup(size_mb: int, work: Path, device: str):
    import torch
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AcceleratorSave

    accelerator = Accelerator(cpu=device == "cpu")
    model = linear_stack(size_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, WIDTH, device=accelerator.device))["loss"])
    optimizer.step()
    optimizer.zero_grad()
    return (AcceleratorSave(accelerator, work / "store"), lambda d: accelerator.save_state(str(d)), model,
            optimizer.optimizer)


def lightning_setup(size_mb: int, work: Path, device: str):
    import lightning.pytorch as pl
    import torch

    from spotguard.integrations.lightning import LightningSave

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = linear_stack(size_mb)

        def training_step(self, batch, batch_idx):
            return self.model(batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(8, WIDTH), batch_size=4))
    if device == "cuda":  # fit()'s teardown moved the module and the optimizer's state to the host
        module.cuda()
        for state in trainer.optimizers[0].state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.cuda()
    return (LightningSave(trainer, work / "store"), lambda d: trainer.save_checkpoint(str(d / "last.ckpt")), module,
            trainer.optimizers[0])


def worker(args) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"spotguard-bench-{args.worker}-", dir=args.dir))
    try:
        setup = {"hf": hf_setup, "accelerate": accelerate_setup, "lightning": lightning_setup}[args.worker]
        adapter, own, model, optimizer = setup(args.size_mb, work, args.device)
        store_root = adapter.store.root
        adapter.prepare()
        engine = adapter.snapshot_engine
        stalls = timed_stalls(engine)
        sources = tensors(model, optimizer)
        host = [t.cpu() for t in sources]
        rows: dict[str, list[list[float]]] = {NOTICE: [], OWN: [], MEMCPY: [], RAW: []}
        persist: list[float] = []
        raw_write_seconds(host, work)  # warm-up: the first write to fresh disk blocks is slower here
        adapter.save(0, reason="notice")  # warm-up: the writer threads, the serializers' imports
        own(work / "own-warm-up")
        for round_no in range(args.repeat):
            settle(work, store_root)
            started = time.perf_counter()
            adapter.save(round_no + 1, reason="notice")
            rows[NOTICE].append([stalls[-1], time.perf_counter() - started])
            adapter.wait()  # what is queued behind the commit (freeing the old last.ckpt) ends before the next method
            persist.append(engine.persist_seconds[-1])
            settle(work, store_root)
            seconds = own_save_seconds(own, work / f"own-{round_no}")
            rows[OWN].append([seconds, seconds])
            rows[MEMCPY].append([memcpy_seconds(sources), None])
            settle(work, store_root)
            rows[RAW].append([None, raw_write_seconds(host, work)])
        Path(args.result).write_text(json.dumps({
            "bytes": engine.buffers.nbytes, "state_bytes": sum(t.nbytes for t in sources), "rows": rows,
            "persist": persist, "load": os.getloadavg()[0], "devices": sorted({str(t.device) for t in sources}),
            "allocations": engine.buffers.allocations, "pinned": engine.buffers.pinned}))
        adapter.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_framework(framework: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), DS_ACCELERATOR="cpu")
        command = [sys.executable, __file__, "--worker", framework, "--result", str(result), "--size-mb",
                   str(args.size_mb), "--repeat", str(args.repeat), "--device", args.device] + (
                       ["--dir", args.dir] if args.dir else [])
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"{framework}: the worker failed ({done.returncode}): {done.stderr[-3000:]}")
        return json.loads(result.read_text())


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(framework: str, r: dict) -> None:
    rows = {name: (median(v[0] for v in runs), median(v[1] for v in runs)) for name, runs in r["rows"].items()}
    memcpy, raw = rows[MEMCPY][0], rows[RAW][1]

    def fmt(value, limit):
        return f"{value:8.3f} s {value / limit:5.2f}x" if value is not None else " " * 16

    print(f"{framework}: {r['bytes'] / 1e6:.0f} MB copied by the engine ({r['state_bytes'] / 1e6:.0f} MB of model + "
          f"optimizer tensors on {', '.join(r['devices'])}), {len(r['persist'])} rounds, load {r['load']:.1f}; "
          "medians, ratio to the limit")
    print(f"  {'method':40s} {'stall':>8s} {'/memcpy':>7s} {'durable':>10s} {'/raw':>5s}")
    for name, (stall, durable) in rows.items():
        print(f"  {name:40s} {fmt(stall, memcpy)} {fmt(durable, raw)}")
    stall, durable = rows[NOTICE]
    print(f"  notice path: stall {stall / memcpy:.2f}x memcpy ({'MET' if stall <= 2 * memcpy else 'NOT MET'}), "
          f"durable {durable / raw:.2f}x the raw write ({'MET' if durable <= 1.25 * raw else 'NOT MET'}); the "
          f"engine's persist {median(r['persist']):.3f} s; framework's own save {rows[OWN][1] / durable:.2f}x the "
          f"notice path's time to durable, {rows[OWN][0] / stall:.1f}x its stall; buffers allocated "
          f"{r['allocations']}x{' (pinned)' if r['pinned'] else ''}", flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    print(f"integration_checkpoint: ~{args.size_mb} MB of state on {args.device}, {args.repeat} rounds; goals: "
          f"stall <= 2x memcpy, durable <= 1.25x the raw write")
    for framework in args.frameworks:
        report(framework, run_framework(framework, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
