"""A tiny training job for the Guard/adapter tests: one rank per process (plain env or torchrun).

    python trainer.py --mode ddp|fsdp2|deepspeed|plain --ckpt DIR --steps N --out DIR [...]

Deterministic: the model starts from seed 0 on every rank; step s on rank r trains on a batch
drawn from seed (s, r). Files it writes into --out (tests read them):
- progress-<rank>: the last finished step (rewritten every step);
- saved-<rank>.json: what the Guard did at the agreed step (step, saved step, snapshot, notice);
- exit-<rank>: the exit status this rank leaves with;
- state-<tag>.pt (rank 0): the full training state at `save` (the agreed step), `resume`
  (just after loading) and `final`: parameters and optimizer state gathered to full tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

from spotguard.hooks.guard import Guard
from state_dump import flatten  # a sibling: the workers run as scripts


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "ddp", "fsdp2", "deepspeed"], required=True)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="periodic fresh saves (async for DCP)")
    p.add_argument("--agree-every", type=int, default=1)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--signal-at", type=int, default=-1, help="rank --signal-rank sends itself SIGTERM after this step")
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--no-compare", action="store_true", help="skip the full-state dumps")
    p.add_argument("--fresh", action="store_true", help="start at step 0 without loading any checkpoint")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="every rank holds step N (before training it: holding-<rank> written) until <out>/release")
    p.add_argument("--hold-rank", type=int, default=-1, help="only this rank holds (-1: every rank)")
    p.add_argument("--hold-build", action="store_true",
                   help="hold before building the model (building-<rank> written) until <out>/release")
    p.add_argument("--slow-async-from", type=int, default=-1,
                   help="periodic saves of this step and later write only once <out>/release-async exists")
    p.add_argument("--fail-notice-write", action="store_true", help="writing a notice's checkpoint raises")
    p.add_argument("--hold-when", default="",
                   help="rank --hold-rank holds the first step that starts once <out>/NAME exists (as --hold-at)")
    p.add_argument("--hold-after-step", action="store_true",
                   help="a held step holds after training it, before guard.step (a rank-0 evaluation pass)")
    p.add_argument("--log-snapshots", action="store_true", help="each snapshot's step appended to snapshots-<rank>")
    return p.parse_args(argv)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


class Job:
    """Model, optimizer and one training step for one mode; `full_state()` for comparisons."""

    def __init__(self, args):
        self.args = args
        self.mode = args.mode
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        if self.mode == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            model = build_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                      "zero_optimization": {"stage": args.zero_stage}, "zero_allow_untested_optimizer": True,
                      "steps_per_print": 10**9, "wall_clock_breakdown": False}
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            self.model = self.engine
        else:
            if self.mode != "plain":
                dist.init_process_group("gloo")
            model = build_model()
            if self.mode == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            elif self.mode == "fsdp2":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (self.world,))
                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(self, step: int) -> None:
        x, y = batch(step, self.rank)
        if self.mode == "deepspeed":
            loss = torch.nn.functional.mse_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
        else:
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and Adam moment as full tensors (collective; rank 0's result is complete)."""
        out: dict[str, torch.Tensor] = {}
        if self.mode == "deepspeed":
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
            if link is not None:  # a plain (non-universal) load links optimizer fragments only at the next step
                link()
            for name, param in self.engine.module.named_parameters():
                out[f"param/{name}"] = safe_get_full_fp32_param(param).clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).clone()
            out["global_steps"] = torch.tensor(self.engine.global_steps)
            return out
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.rank != 0:
            return {}
        return flatten(model_state, optim_state)


def hold(out: Path, rank: int, step: int, what: str = "holding", release: str = "release") -> None:
    """A long step (an evaluation pass, a data stall) that lasts until the test releases it."""
    (out / f"{what}-{rank}").write_text(str(step))
    while not (out / release).exists():
        time.sleep(0.02)


def faulty_writes(adapter, args, out: Path, rank: int) -> None:
    """--slow-async-from / --fail-notice-write: the adapter's writes held or failed by checkpoint tag."""
    write = adapter._write_state

    def gated(pending, state):
        tag = pending.tag
        if args.fail_notice_write and tag.endswith("-notice"):
            raise OSError(f"rank {rank}: injected failure writing {tag}")
        if tag.endswith("-periodic") and 0 <= args.slow_async_from <= int(tag.split("-")[1]):
            hold(out, rank, int(tag.split("-")[1]), "slow-async", "release-async")
        write(pending, state)

    adapter._write_state = gated


def log_snapshots(adapter, out: Path, rank: int) -> None:
    """--log-snapshots: every in-memory snapshot's step, one a line, in <out>/snapshots-<rank>."""
    snapshot = adapter.snapshot

    def logged(step):
        snapshot(step)
        with open(out / f"snapshots-{rank}", "a") as f:
            f.write(f"{step}\n")

    adapter.snapshot = logged


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.hold_build:
        hold(out, int(os.environ.get("RANK", 0)), -1, "building")
    job = Job(args)
    rank = job.rank

    def dump(tag: str) -> None:
        if args.no_compare:
            return
        state = job.full_state()
        if rank == 0:
            torch.save(state, out / f"state-{tag}.pt")

    if args.mode == "deepspeed":
        from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter

        adapter = DeepSpeedAdapter(job.engine, checkpoint_dir=args.ckpt)
    elif args.mode == "plain":
        from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter

        adapter = PlainTorchAdapter(job.model, job.optimizer, checkpoint_dir=args.ckpt)
    else:
        from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

        adapter = TorchDCPAdapter(job.model, job.optimizer, checkpoint_dir=args.ckpt)
    faulty_writes(adapter, args, out, rank)
    if args.log_snapshots:
        log_snapshots(adapter, out, rank)
    guard = Guard.from_env(adapter=adapter, agree_every=args.agree_every, grace_seconds=args.grace,
                           snapshot_every=args.snapshot_every)

    @guard.on_reclaim
    def record(step, notice):
        dump("save")

    start = 0 if args.fresh else guard.resume()
    if start:
        dump("resume")
    try:
        for step in range(start, args.steps):
            holding = args.hold_rank in (-1, rank) and (step == args.hold_at
                                                        or bool(args.hold_when and (out / args.hold_when).exists()))
            if holding and not args.hold_after_step:
                hold(out, rank, step)
            job.train_step(step)
            if holding and args.hold_after_step:
                hold(out, rank, step)
            if args.save_every and step % args.save_every == 0:
                if hasattr(adapter, "save_async"):
                    adapter.save_async(step)
                else:
                    adapter.save(step)
            (out / f"progress-{rank}").write_text(str(step))
            if step == args.signal_at and rank == args.signal_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            guard.step(step)
        if hasattr(adapter, "wait"):
            adapter.wait()
        dump("final")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        record = guard.last_drain
        if record is not None:
            (out / f"saved-{rank}.json").write_text(json.dumps({
                "rank": rank, "step": record.step, "saved_step": record.saved_step, "snapshot": record.used_snapshot,
                "notice": record.notice.id, "kind": record.notice.kind.value, "ok": record.ok}))
    (out / f"exit-{rank}").write_text(str(code))
    guard.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
