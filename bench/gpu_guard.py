"""The Guard's notice path with the model on a GPU: notice -> same-step checkpoint -> exit 83 -> resume.

    python3 bench/gpu_guard.py                                # NCCL, cuda:0, DDP, FSDP2 and plain
    .venv/bin/python bench/gpu_guard.py --backend gloo --device cpu   # the same walk on CPU

One process per run (world size 1: one GPU is enough; a world of several GPUs is what
`bench/nccl_reform.py` covers for the groups). For each mode (DDP and FSDP2 through
`TorchDCPAdapter`, a single process through `PlainTorchAdapter`):
1. a training process (`init_process_group(backend, device_id=...)`, the model and its AdamW state
   on the device, the Guard with `snapshot_every`) trains, sends itself SIGTERM after step
   --signal-at, and must exit 83 with a checkpoint of that step; its `on_reclaim` hook dumps the
   full state (on the host) as the reference;
2. a second process resumes: `guard.resume()` must return the saved step + 1, every parameter and
   optimizer tensor must be bit-identical to the reference and on the device, and it trains on.
Prints one line per check with the notice -> exit time and the checkpoint's size, and exits 1 when
any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_state(model, optimizer) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if not torch.distributed.is_initialized():
        return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "optim": torch.utils._pytree.tree_map(
                    lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, optimizer.state_dict())}
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_state, "optim": optim_state}


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.guard import Guard

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if args.mode != "plain":
        kwargs = {"device_id": device} if args.backend == "nccl" else {}
        dist.init_process_group(args.backend, rank=0, world_size=1, **kwargs)
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)]).to(device)
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if args.device == "cuda" else None)
    elif args.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device, (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.mode == "plain":
        from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter

        adapter = PlainTorchAdapter(model, optimizer, checkpoint_dir=args.ckpt)
    else:
        from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

        adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=args.ckpt)
    guard = Guard(adapter=adapter, grace_seconds=60, snapshot_every=5)
    out = Path(args.out)
    signalled = {}

    @guard.on_reclaim
    def reference(step, notice):
        torch.save(full_state(model, optimizer), out / "reference.pt")
        (out / "reclaim.json").write_text(json.dumps({"step": step, "seconds": time.monotonic() - signalled["at"]}))

    start = guard.resume() or 0
    if args.phase == "resume":
        reference_state = torch.load(out / "reference.pt", weights_only=False)
        now = full_state(model, optimizer)
        flat_ref = torch.utils._pytree.tree_leaves(reference_state)
        flat_now = torch.utils._pytree.tree_leaves(now)
        same = len(flat_ref) == len(flat_now) and all(
            (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b) for a, b in zip(flat_ref, flat_now))
        on_device = all(p.device.type == args.device for p in model.parameters())
        (out / "resumed.json").write_text(json.dumps({"start": start, "identical": same, "on_device": on_device}))
    x = torch.randn(args.batch, width, device=device)
    for step in range(start, start + args.steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if args.phase == "train" and step == args.signal_at:
            signalled["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
        guard.step(step)
    guard.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run_mode(args, mode: str, work: Path) -> bool:
    ckpt, out = work / mode / "ckpt", work / mode / "out"
    out.mkdir(parents=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", PYTHONUNBUFFERED="1")
    if args.backend == "nccl":
        env.update(TORCH_NCCL_ASYNC_ERROR_HANDLING="2", TORCH_NCCL_RETHROW_CUDA_ERRORS="0")
    base = [sys.executable, __file__, "--worker", "--mode", mode, "--backend", args.backend, "--device", args.device,
            "--ckpt", str(ckpt), "--out", str(out), "--width", str(args.width), "--layers", str(args.layers)]
    started = time.monotonic()
    train = subprocess.run([*base, "--phase", "train", "--steps", str(args.signal_at + 10),
                            "--signal-at", str(args.signal_at)], env=env, timeout=600)
    train_seconds = time.monotonic() - started
    reclaim = json.loads((out / "reclaim.json").read_text()) if (out / "reclaim.json").exists() else {}
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.exists() else 0
    ok_train = train.returncode == 83 and reclaim.get("step") == args.signal_at
    print(f"{'ok' if ok_train else 'FAILED':6} {mode:6} notice at step {args.signal_at}: exit {train.returncode}, "
          f"checkpoint of step {reclaim.get('step')} ({size / 1e6:.0f} MB on disk), notice -> reclaim hook "
          f"{reclaim.get('seconds', float('nan')):.2f}s, process {train_seconds:.1f}s", flush=True)
    env["MASTER_PORT"] = str(free_port())
    resume = subprocess.run([*base, "--phase", "resume", "--steps", "3"], env=env, timeout=600)
    resumed = json.loads((out / "resumed.json").read_text()) if (out / "resumed.json").exists() else {}
    ok_resume = (resume.returncode == 0 and resumed.get("start") == args.signal_at + 1
                 and resumed.get("identical") and resumed.get("on_device"))
    print(f"{'ok' if ok_resume else 'FAILED':6} {mode:6} resume: exit {resume.returncode}, "
          f"start {resumed.get('start')}, "
          f"state bit-identical {resumed.get('identical')}, on {args.device} {resumed.get('on_device')}, trained on",
          flush=True)
    return ok_train and ok_resume


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--modes", default="ddp,fsdp2,plain")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8, help="Linear layers of --width (default 8: ~400 MB of state)")
    p.add_argument("--signal-at", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("train", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no GPU visible: nothing ran (use --backend gloo --device cpu)")
        return 2
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    nccl = f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if args.backend == "nccl" else ""
    print(f"torch {torch.__version__}, backend {args.backend}{nccl}, {where}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="spotguard-gpu-guard-") as tmp:
        for mode in args.modes.split(","):
            ok &= run_mode(args, mode, Path(tmp))
    print("all checks passed" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
