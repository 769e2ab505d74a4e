"""The reference elastic trainer: what a user's training script looks like with spotguard.

    torchrun --nnodes=... --nproc-per-node=1 -m spotguard.trainer.train --framework ddp --checkpoint-dir /ckpt

- torch DDP with the DCP adapter, or DeepSpeed ZeRO with its adapter (`--framework deepspeed`);
- resumes from the newest complete checkpoint at any world size (DCP reshards; DeepSpeed goes
  through a universal checkpoint when the data-parallel size changed);
- the data: `--samples` fixed samples dealt out by `spotguard.data.ElasticSampler` (through a
  DataLoader with `--data-workers` workers), its position in every checkpoint, so each epoch sees
  every sample once at any world size; `--ledger DIR` records the sample ids of every step;
- `--batch-policy keep-global` (the fixed policy's choice) keeps the global batch when workers
  leave by accumulating gradients; `scale-lr` (the elastic policy's choice) keeps each rank's
  batch and scales the learning rate with the world size;
- a notice (from the sidecar, or SIGTERM) makes every rank checkpoint the same step, then the
  rank exits with 83 (`EXIT_PREEMPTED`); logs step, loss, world size and throughput as JSON lines
  (`SPOTGUARD_EVENT_LOG`, see `trainer.events`), and the digest of each state the Guard snapshots;
- `--no-guard` is the baseline without spotguard: the Guard's module is not even imported (its
  import installs a SIGTERM handler that leaves with 83, nothing lost, which a process that trains
  without a Guard must not have);
- by default the trainer leaves by itself after a drain (the Guard's `exit_on_drain=False`);
  `--exit-on-drain` lets the Guard end the process, as users' scripts do, which runs the deadline
  watchdog: a notice whose deadline comes before the next step boundary (`--long-step S:T`: step S
  takes T seconds) is answered by persisting the held snapshot, and the process ends from the
  watchdog's thread (its termination message is the account of it: no events);
- SIGUSR1 writes the stack of every thread to stderr (`faulthandler`) and training goes on: the
  dry-run sends it to a rank still running when its node dies (`trainer.reaper.dump_stacks`).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from spotguard.data import ElasticSampler
from spotguard.hooks.elastic import elastic_process
from spotguard.hooks.step_result import CONTINUED
from spotguard.trainer.events import EventLog, process_fields
from spotguard.trainer.model import Samples, build_model, state_digest
from spotguard.trainer.console import ConsoleEcho

if TYPE_CHECKING:
    from spotguard.hooks.guard import Guard

log = logging.getLogger("spotguard.trainer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spotguard.trainer.train", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("ddp", "fsdp2", "deepspeed"), default="ddp")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per forward/backward")
    p.add_argument("--batch-policy", choices=("keep-global", "scale-lr"), default="keep-global")
    p.add_argument("--base-world-size", type=int, default=0,
                   help="world size the learning rate is tuned for (scale-lr; default: the first run's)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra synthetic compute per step")
    p.add_argument("--long-step", type=long_step, default=None, metavar="STEP:SECONDS",
                   help="step STEP (0-based) takes SECONDS instead of --step-seconds (an evaluation pass)")
    p.add_argument("--exit-on-drain", action="store_true",
                   help="the Guard ends the process on a drain (its default; the deadline watchdog runs)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--snapshot-every", type=int, default=0, help="in-memory snapshot every K steps")
    p.add_argument("--checkpoint-every", type=int, default=0, help="periodic checkpoint every K steps")
    p.add_argument("--checkpoint-first", action="store_true",
                   help="a durable checkpoint after this process's first step (not a joiner's): the Guard's "
                        "save estimate is measured before any notice (a replacement hold needs one)")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--deepspeed-config", default=None, help="DeepSpeed JSON config (default: built in)")
    p.add_argument("--no-guard", action="store_true", help="baseline: no spotguard (periodic checkpoints only)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=4096, help="samples in the dataset (an epoch)")
    p.add_argument("--data-workers", type=int, default=0, help="the DataLoader's num_workers")
    p.add_argument("--ledger", default=None, help="directory: each rank appends the sample ids of each step it "
                                                  "trains to ledger-<pid>.jsonl")
    p.add_argument("--event-log", default=os.environ.get("SPOTGUARD_EVENT_LOG"))
    args = p.parse_args(argv)
    for name in ("steps", "global_batch", "micro_batch", "log_every", "samples"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def long_step(text: str) -> tuple[int, float]:
    """`STEP:SECONDS` (argparse type): a step >= 0 and seconds > 0."""
    step, _, seconds = text.partition(":")
    try:
        parsed = int(step), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP:SECONDS, got {text!r}") from None
    if parsed[0] < 0 or not parsed[1] > 0 or not math.isfinite(parsed[1]):
        raise argparse.ArgumentTypeError(f"expected a step >= 0 and seconds > 0, got {text!r}")
    return parsed


def compute_seconds(args: argparse.Namespace, step: int) -> float:
    """The synthetic compute of `step`: --step-seconds, or the long step's seconds."""
    return args.long_step[1] if args.long_step is not None and step == args.long_step[0] else args.step_seconds


class Batching:
    """How the global batch maps onto this world: per-rank samples, micro-batches, lr."""

    def __init__(self, args: argparse.Namespace, world_size: int, base_world: int):
        if args.batch_policy == "keep-global":
            if args.global_batch % world_size:
                raise SystemExit(f"--global-batch {args.global_batch} is not divisible by world size {world_size}")
            self.global_size = args.global_batch
            self.lr = args.lr
        else:
            per_rank = args.global_batch // base_world
            self.global_size = per_rank * world_size
            self.lr = args.lr * world_size / base_world
        self.per_rank = self.global_size // world_size
        self.micro = min(args.micro_batch, self.per_rank)
        self.accumulation = math.ceil(self.per_rank / self.micro)


def setup_distributed(framework: str = "ddp") -> tuple[int, int]:
    """Joins or starts the job's group (in place under `spotguard launch`, else torch's env://).
    DeepSpeed is imported first, as a user's script does: a joiner's warm-up then imports what its
    first engine needs before it says it is ready."""
    from spotguard.hooks.elastic import init_process_group

    if framework == "deepspeed":
        import deepspeed  # noqa: F401

    if ("RANK" in os.environ or os.environ.get("SPOTGUARD_JOIN") == "1") and not dist.is_initialized():
        init_process_group("gloo")
    return current_world()


def current_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def digest_of(model, optimizer) -> str:
    """A digest of this rank's state, made without communication: FSDP2 digests this rank's
    shards. Never a collective: a joiner writes its `start` event where the survivors, already
    training, make none, and a collective only one side makes breaks the group."""
    module = getattr(model, "module", model)
    params = _local(module.state_dict())
    if optimizer is None:
        return state_digest(params)
    return state_digest(params, _local(optimizer.state_dict().get("state", {})))


def _local(obj):
    """`obj` (nested dicts and lists) with every DTensor replaced by this rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def torch_builder(args, base_world: int):
    """`build()` for the current group: the model (DDP, or FSDP2 over a 1-D CPU mesh) and its
    optimizer at this world size's learning rate. The adapter calls it again after a resize."""
    def build():
        from torch.nn.parallel import DistributedDataParallel as DDP

        _rank, world_size = current_world()
        model = build_model(args.seed)
        if args.framework == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif world_size > 1:
            model = DDP(model)
        return model, torch.optim.AdamW(model.parameters(), lr=Batching(args, world_size, base_world).lr)
    return build


def build_ddp(args, rank, world_size, batching, guarded: bool, data: ElasticSampler):
    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

    build = torch_builder(args, args.base_world)
    model, optimizer = build()
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=args.checkpoint_dir, build=build, data=data)
    return model, optimizer, adapter


def make_data(args) -> tuple[ElasticSampler, DataLoader]:
    """The dataset dealt out by an ElasticSampler: the global batch kept (keep-global) or each
    rank's (scale-lr), micro-batches of --micro-batch; its position lives in the checkpoint."""
    dataset = Samples(args.seed, args.samples)
    per_step = ({"global_batch": args.global_batch} if args.batch_policy == "keep-global"
                else {"batch_size": args.global_batch // args.base_world})
    sampler = ElasticSampler(dataset, micro_batch=args.micro_batch, seed=args.seed, **per_step)
    return sampler, DataLoader(dataset, batch_sampler=sampler, num_workers=args.data_workers)


def ds_config(args, world_size, batching) -> dict:
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            config = json.load(f)
    else:
        config = {"zero_optimization": {"stage": args.zero_stage}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    config.pop("elasticity", None)  # the sidecar already sized the hostfile with it
    config["train_micro_batch_size_per_gpu"] = batching.micro
    config["gradient_accumulation_steps"] = batching.accumulation
    config["train_batch_size"] = batching.micro * batching.accumulation * world_size
    return config


def build_deepspeed(args, rank, world_size, batching, guarded: bool, data: ElasticSampler):
    import deepspeed

    from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=batching.lr)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=ds_config(args, world_size, batching))
    if not guarded:
        return engine, None, None
    # In place (ZeRO-1/2): the engine is made again for each new group with that world's batching.
    adapter = DeepSpeedAdapter(engine, checkpoint_dir=args.checkpoint_dir, data=data, in_place=True,
                               config_for=lambda world: ds_config(args, world, Batching(args, world, args.base_world)))
    return engine, None, adapter


def set_lr(optimizer, lr: float) -> None:
    """This world size's learning rate (a loaded optimizer state carries the saving run's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step_ddp(model, optimizer, chunks) -> float:
    """One optimizer step over this rank's micro-batches (inputs, targets, ids) of the step."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    samples = sum(xm.shape[0] for xm, _ym, _ids in chunks)
    for i, (xm, ym, _ids) in enumerate(chunks):
        sync = i == len(chunks) - 1 or not hasattr(model, "no_sync")
        ctx = model.no_sync() if not sync else _nullcontext()
        with ctx:
            loss = F.mse_loss(model(xm), ym) * (xm.shape[0] / samples)
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def train_step_deepspeed(engine, chunks, batching) -> float:
    total = 0.0
    for xm, ym, _ids in chunks:
        loss = F.mse_loss(engine(xm), ym)
        engine.backward(loss)
        engine.step()
        total += loss.item() / batching.accumulation
    return total


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def joined_running_group() -> bool:
    """This process joined a group that was already training (in place), so its peers are not at
    their first step with it."""
    process = elastic_process()
    return os.environ.get("SPOTGUARD_JOIN") == "1" or (process is not None and process.joined is not None)


def log_resize(events: Any, guard: Guard, resize: Any) -> None:
    """An in-place change this rank made: the `resized` event (a shrink logs its agreement and
    checkpoint first, as a drain does)."""
    if resize.old_world_size > resize.new_world_size and guard.last_drain is not None:
        log_checkpoint(events, guard.last_drain)  # a shrink: this rank agreed and checkpointed too
    events.write("resized", step=resize.step + 1, path=resize.outcome.value, reason=resize.reason,
                 from_world=resize.old_world_size, to_world=resize.new_world_size, new_rank=resize.new_rank,
                 pause=round(resize.pause_seconds, 4), phases={k: round(v, 4) for k, v in resize.phases.items()},
                 pid=os.getpid())
    events.common.update(rank=guard.rank, world_size=guard.world_size)


def log_checkpoint(events: Any, record: Any, drain: bool = False, digest: str | None = None) -> None:
    """A Guard drain record as the `agreed` and `durable` events (trainer.events); a drain's
    `agreed` carries the notice's deadline, its `durable` the state digest and only a save that
    succeeded; a shrink's (the rank re-formed after its checkpoint) always has both."""
    notice = record.notice
    extra = {"deadline": notice.deadline.timestamp() if notice.deadline else None} if drain else {}
    events.write("agreed", t=record.hooks_started_at, step=record.step + 1, notice_id=notice.id,
                 kind=notice.kind.value, detected_at_unix=notice.detected_at.timestamp(), **extra)
    if drain and not record.ok:
        return
    events.write("durable", t=record.hooks_started_at + record.checkpoint_seconds, step=record.saved_step + 1,
                 seconds=round(record.checkpoint_seconds, 4), snapshot=record.used_snapshot,
                 **({"digest": digest} if drain else {}))


def log_drained(events: Any, record: Any, framework: str, model: Any, optimizer: Any) -> None:
    """This rank drained: its `agreed` / `durable` (with the saved state's digest unless the save
    was a snapshot or FSDP2's shards) and `drained` events; the log is closed."""
    digest = None if record.used_snapshot or framework == "fsdp2" else digest_of(model, optimizer)
    log_checkpoint(events, record, drain=True, digest=digest)
    events.write("drained", step=record.step + 1, exit_code=record.exit_code)
    events.close()


def log_snapshot(events: Any, adapter: Any, step: int, framework: str, model: Any, optimizer: Any) -> None:
    """The Guard snapshotted `step` in memory: the `snapshot` event with the state's digest (what a
    save of that snapshot, the deadline watchdog's, resumes to; not for FSDP2's shards)."""
    if getattr(adapter, "snapshot_step", None) == step and framework != "fsdp2":
        events.write("snapshot", step=step + 1, digest=digest_of(model, optimizer))


def step_guard(guard: Guard, step: int, events: Any, framework: str, model: Any, optimizer: Any) -> Any:
    """`guard.step(step)`. With --exit-on-drain the Guard ends the process on this step's drain
    (SystemExit): the drain's events are written on the way out."""
    try:
        return guard.step(step)
    except SystemExit:
        record = guard.last_drain
        if record is not None and record.step == step and record.notice is not None:
            log_drained(events, record, framework, model, optimizer)
        raise


def leave_drained(events: Any, guard: Guard, framework: str, model: Any, optimizer: Any) -> None:
    """This rank drained (the Guard returned it): its events, then the process ends with the
    drain's exit code."""
    record = guard.last_drain
    log_drained(events, record, framework, model, optimizer)
    guard.close()
    _shutdown()
    _leave(record.exit_code)


def after_resize(args: argparse.Namespace, adapter: Any, batching: Batching) -> tuple[Any, Any]:
    """(model, optimizer) the loop trains after an in-place change: the rebuilt ones, with this
    world's lr; DeepSpeed's engine made again (the optimizer inside it, its lr carried along)."""
    if args.framework == "deepspeed":
        return adapter.engine, None
    set_lr(adapter.optimizer, batching.lr)
    return adapter.model, adapter.optimizer


def make_guard(args: argparse.Namespace, adapter: Any) -> Guard | None:
    """The Guard (None with --no-guard), made after the model and adapter: the order a joiner
    repeats in place."""
    if args.no_guard:
        return None
    from spotguard.hooks.guard import Guard

    return Guard.from_env(adapter=adapter, snapshot_every=args.snapshot_every, exit_on_drain=args.exit_on_drain)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not args.no_guard:  # before anything is built: its import answers a notice meanwhile (hooks/early_exit.py)
        import spotguard.hooks.guard  # noqa: F401
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rank, world_size = setup_distributed(args.framework)
    events = EventLog(args.event_log if rank == 0 or args.event_log is None else
                      args.event_log.replace(".jsonl", f"-rank{rank}.jsonl"),
                      rank=rank, world_size=world_size, **process_fields())
    base_world = args.base_world_size or int(os.environ.get("SPOTGUARD_BASE_WORLD_SIZE", world_size))
    args.base_world = base_world
    batching = Batching(args, world_size, base_world)
    events = ConsoleEcho(events, args.steps, args.checkpoint_dir)  # rank 0's start, progress, changes, end

    sampler, loader = make_data(args)
    ledger = open(os.path.join(args.ledger, f"ledger-{os.getpid()}.jsonl"), "a", buffering=1) if args.ledger else None
    build = build_deepspeed if args.framework == "deepspeed" else build_ddp
    model, optimizer, adapter = build(args, rank, world_size, batching, guarded=not args.no_guard, data=sampler)
    guard = make_guard(args, adapter)
    if guard is None:
        start = (adapter.resume() or 0) if adapter is not None else 0
    else:
        start = guard.resume()
        rank, world_size = guard.rank, guard.world_size
        events.common.update(rank=rank, world_size=world_size)
        batching = Batching(args, world_size, base_world)
    if optimizer is not None:
        set_lr(optimizer, batching.lr)
    joined = joined_running_group()  # by --join or by the join rule (hooks/elastic/join.py)
    events.write("start", step=start, digest=digest_of(model, optimizer), resumed=start > 0,
                 global_batch=batching.global_size, accumulation=batching.accumulation, lr=batching.lr,
                 joined=joined, pid=os.getpid())

    tick, tick_step = time.monotonic(), start
    step = start
    last_step_at, max_gap = time.time(), 0.0
    for step, chunks in sampler.steps(loader, start, args.steps):
        if args.framework != "deepspeed":
            loss = train_step_ddp(model, optimizer, chunks)
        else:
            loss = train_step_deepspeed(model, chunks, batching)
        if ledger is not None:
            ledger.write(json.dumps({"step": step, "rank": rank, "world": world_size,
                                     "ids": [int(i) for _x, _y, ids in chunks for i in ids]}) + "\n")
        if compute_seconds(args, step):
            time.sleep(compute_seconds(args, step))
        now_wall = time.time()
        max_gap, last_step_at = max(max_gap, now_wall - last_step_at), now_wall
        done = step + 1
        if done % args.log_every == 0:
            now = time.monotonic()
            rate = (done - tick_step) * batching.global_size / max(now - tick, 1e-9)
            events.write("step", step=done, loss=round(loss, 6), samples_per_s=round(rate, 1))
            tick, tick_step = now, done
        if adapter is not None and args.checkpoint_every and done % args.checkpoint_every == 0:
            adapter.save(step, reason="periodic")
        elif adapter is not None and args.checkpoint_first and step == start and not joined_running_group():
            adapter.save(step, reason="first")
        result = step_guard(guard, step, events, args.framework, model, optimizer) if guard is not None else CONTINUED
        drained = result.drained
        if guard is not None and not drained and result.resize is None:
            log_snapshot(events, adapter, step, args.framework, model, optimizer)
        if result.resize is not None and not drained:
            log_resize(events, guard, result.resize)
            rank, world_size = guard.rank, guard.world_size
            batching = Batching(args, world_size, base_world)
            model, optimizer = after_resize(args, adapter, batching)
        if drained:
            leave_drained(events, guard, args.framework, model, optimizer)
    events.write("finished", step=args.steps if step + 1 >= args.steps else step + 1, max_step_gap=round(max_gap, 4),
                 pid=os.getpid())
    events.close()
    if ledger is not None:
        ledger.close()
    if guard is not None:
        guard.close()
    _shutdown()
    return 0


def _leave(code: int) -> None:
    """Ends the process with `code` after a drain or a finish, skipping torch's C++ teardown, which
    can abort (SIGABRT) in gloo/store destructors and would turn a clean 83 or 0 into a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # peers may already be gone
            pass


if __name__ == "__main__":
    # main() closed everything it opened (events, ledger, Guard and adapter, the group): the exit
    # skips torch's C++ teardown, as a drain's does (`_leave`); a finished joiner was seen to abort there
    _leave(main())
