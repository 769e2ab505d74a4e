"""What the framework reference scripts (train_hf, train_accelerate, train_lightning) share: a
tiny model and data made in code (nothing downloaded), the command line, and the records the
tests and the dry-run read from `--out`:
- `progress-<rank>`: the last completed global step;
- `saved-<rank>.json`: {"step", "notice", "at", "started", "detected"} written by an @on_reclaim
  hook at the agreed step (`started`: when the integration's save began; `detected`: the agreed
  notice's detection time, for a signal when the handler ran on the rank that got it);
- `resumed-<rank>.json`: {"start", "optimizer_steps"} where the run resumed;
- `optimizer-saved.pt` / `optimizer-resumed.pt` (rank 0): the optimizer state at the agreed step
  and right after the resume (the tests compare them exactly);
- `ids-<rank>.jsonl`: one line per global step, {"step", "ids", "t"}: the sample ids this rank trained
  on, and when the step ended;
- `params-final.pt` (rank 0): the final parameters.
- `optimizer-step-<N>.pt` (rank 0, with `--integration-snapshot-every`): the optimizer state at each
  step the integration snapshots (a resume from a persisted snapshot is compared with it);
- `evaluating-<rank>`: written when this rank's slow evaluation pass began (`--eval-seconds`).
`--fail-save` makes rank 0's checkpoint write raise (the failing-save tests): `fail_rank0_saves`.
`--integration-snapshot-every N` is the integration's `snapshot_every` (the dry-run's own
`--snapshot-every` is accepted and not passed on); `--eval-every N` evaluates every N steps on
`SlowEval`, whose first sample takes `--eval-seconds` to load (an evaluation pass longer than a grace).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

SAMPLES = 64
FEATURES = 8
GLOBAL_BATCH = 8  # samples per step at every world size (--keep-batch global)
PER_RANK_BATCH = 4  # samples per rank per step (--keep-batch rank: the global batch follows the world)
ORDER_SEED = 7  # the ElasticSampler's seed: the data order of every script


class TinyRegression(torch.nn.Module):
    """A two-layer MLP whose forward takes a batch dict and returns {"loss": ...}; it records the
    ids of the samples it trained on since the last `take_ids()`. `step_sleep`: seconds of
    synthetic compute in each training forward (where a real model spends its step)."""

    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self._ids: list[int] = []

    def forward(self, x, labels, idx=None):
        if idx is not None and self.training:
            self._ids.extend(int(i) for i in idx)
            if self.step_sleep:
                time.sleep(self.step_sleep)
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}

    def take_ids(self) -> list[int]:
        ids, self._ids = sorted(self._ids), []
        return ids


class Samples(torch.utils.data.Dataset):
    """SAMPLES fixed samples, each a dict {x, labels, idx}."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = self.x.sum(dim=1).sin()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "idx": i}


class SlowEval(Samples):
    """The evaluation set: `Samples`, whose first sample loaded in this process takes `seconds` (a slow
    evaluation pass: a metric, a remote data set); `<out>/evaluating-<rank>` says it began."""

    def __init__(self, out: str, rank: int, seconds: float) -> None:
        super().__init__()
        self.marker, self.seconds = Path(out) / f"evaluating-{rank}", seconds

    def __getitem__(self, i: int) -> dict:
        if self.seconds and not self.marker.exists():
            self.marker.write_text(str(time.time()))
            time.sleep(self.seconds)
        return super().__getitem__(i)


def parse_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    """The scripts' command line; also takes the flags the dry-run gives `spotguard.trainer.train`
    (`--checkpoint-dir`, `--step-seconds`, `--log-every`; the others are accepted and unused)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--ckpt", "--checkpoint-dir", dest="ckpt", required=True, help="checkpoint directory")
    p.add_argument("--out", default=None, help="where the records go (default: <ckpt>/../framework-records)")
    p.add_argument("--steps", type=int, default=24, help="total optimizer steps")
    p.add_argument("--step-sleep", "--step-seconds", dest="step_sleep", type=float, default=0.0,
                   help="seconds of synthetic compute per step")
    p.add_argument("--fail-save", action="store_true", help="rank 0's checkpoint write raises")
    p.add_argument("--deepspeed-stage", type=int, default=0,
                   help="train_hf only: run through the Trainer's DeepSpeed integration at this ZeRO stage")
    p.add_argument("--log-every", type=int, default=5, help="a `step` event every N steps (the dry-run's log)")
    p.add_argument("--event-log", default=os.environ.get("SPOTGUARD_EVENT_LOG"))
    p.add_argument("--keep-batch", choices=("global", "rank"), default="global",
                   help=f"global: {GLOBAL_BATCH} samples per step at every world size; rank: {PER_RANK_BATCH} per rank")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per forward/backward (a step is then several: gradient accumulation)")
    p.add_argument("--ledger", default=None, help="directory: each process appends {step, rank, world, ids} of every "
                                                  "step it trains to ledger-<pid>.jsonl")
    p.add_argument("--integration-snapshot-every", type=int, default=0,
                   help="the integration's snapshot_every: an in-memory snapshot every N steps (0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="train_hf, train_lightning: evaluate every N steps")
    p.add_argument("--eval-seconds", type=float, default=0.0,
                   help="the evaluation pass's first sample takes this long to load (evaluating-<rank> written)")
    for unused in ("--framework", "--snapshot-every", "--checkpoint-every", "--batch-policy", "--base-world-size"):
        p.add_argument(unused, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(Path(args.ckpt).absolute().parent / "framework-records")
    return args


class DryRunEvents:
    """The events the dry-run report reads (`trainer.events`), from a framework script: `start`,
    `step` every `log_every` steps, `agreed` + `durable` (an @on_reclaim hook: the save succeeded),
    `drained` (an @on_drain hook: exit 83 follows), `finished`. Steps are global steps done."""

    def __init__(self, opts: argparse.Namespace, rank: int, size: int):
        from spotguard.trainer.events import EventLog, process_fields

        path = opts.event_log
        if path is not None and rank != 0:
            path = path.replace(".jsonl", f"-rank{rank}.jsonl")
        self.log = EventLog(path, rank=rank, world_size=size, **process_fields())
        self.log_every, self.size = max(1, opts.log_every), size
        self._tick: tuple[float, int] | None = None
        self._last_step_at: float | None = None
        self.max_step_gap = 0.0  # the longest gap between two completed steps (the report's survivors line)
        self.model: torch.nn.Module | None = None  # set by the script: the state the digests cover
        self.optimizer = None

    def _digest(self) -> str | None:
        """A digest of the parameters and optimizer state (the report compares saved and resumed)."""
        if self.model is None or self.optimizer is None:
            return None
        from spotguard.trainer.model import state_digest

        return state_digest(self.model.state_dict(), self.optimizer.state_dict()["state"])

    def start(self, step: int, model: torch.nn.Module | None = None, optimizer=None, joined: bool = False) -> None:
        """`joined`: this process joined a group already training (in place)."""
        self.model, self.optimizer = model, optimizer
        self.log.write("start", step=step, resumed=step > 0, global_batch=GLOBAL_BATCH, pid=os.getpid(),
                       digest=self._digest(), joined=joined)
        self._tick = (time.monotonic(), step)

    def step(self, done: int, loss: float | None = None) -> None:
        now = time.monotonic()
        if self._last_step_at is not None:
            self.max_step_gap = max(self.max_step_gap, now - self._last_step_at)
        self._last_step_at = now
        if done % self.log_every or self._tick is None:
            return
        then, first = self._tick
        rate = (done - first) * GLOBAL_BATCH / max(now - then, 1e-9)
        self.log.write("step", step=done, loss=None if loss is None else round(float(loss), 6),
                       samples_per_s=round(rate, 1))
        self._tick = (now, done)

    def attach(self, guard, adapter, offset: int = 0) -> None:
        """Registers the hooks on the integration's Guard; `offset` turns its step into steps done."""
        def reclaimed(step, notice):
            seconds = round(adapter.save_seconds[-1], 4) if adapter.save_seconds else None
            done = step + offset
            self.log.write("agreed", step=done, notice_id=notice.id, kind=notice.kind.value,
                           deadline=notice.deadline.timestamp() if notice.deadline else None,
                           detected_at_unix=notice.detected_at.timestamp())
            self.log.write("durable", step=done, seconds=seconds, snapshot=False, digest=self._digest())

        def drained(step, notice):
            self.log.write("drained", step=step + offset, exit_code=83)
            self.log.close()

        guard.on_reclaim(reclaimed)
        guard.on_drain(drained)

    def resized(self, record, offset: int = 0) -> None:
        """An in-place change this process came through (an @on_resize hook): the `resized` event as
        `spotguard.trainer.train` writes it; later events carry the new rank and world size."""
        self.log.write("resized", step=record.step + offset, path=record.outcome.value, reason=record.reason,
                       from_world=record.old_world_size, to_world=record.new_world_size, new_rank=record.new_rank,
                       pause=round(record.pause_seconds, 4), phases={k: round(v, 4) for k, v in record.phases.items()},
                       pid=os.getpid())
        self.log.common.update(rank=record.new_rank, world_size=record.new_world_size)
        self.size = record.new_world_size

    def finished(self, step: int) -> None:
        self.log.write("finished", step=step, pid=os.getpid(), max_step_gap=round(self.max_step_gap, 4))
        self.log.close()


def base_optimizer(optimizer):
    """The torch optimizer under the Trainer's wrappers (Accelerate's, DeepSpeed's ZeRO optimizer):
    under DeepSpeed it holds this rank's partition, in the same layout at the save and the resume."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def sampler_for(data: Samples, opts: argparse.Namespace):
    """The scripts' ElasticSampler over `data`: the global batch kept, or each rank's (`--keep-batch`)."""
    from spotguard.data import ElasticSampler

    per_step = {"global_batch": GLOBAL_BATCH} if opts.keep_batch == "global" else {"batch_size": PER_RANK_BATCH}
    return ElasticSampler(data, seed=ORDER_SEED, micro_batch=opts.micro_batch, **per_step)


def expected_ids(step: int) -> list[int]:
    """The global batch of global step `step` (1-based) with the global batch kept: the ElasticSampler's
    order (each epoch `torch.randperm` seeded with ORDER_SEED + epoch, epochs end to end), sorted."""
    first, stream = (step - 1) * GLOBAL_BATCH, []
    for epoch in range(first // SAMPLES, (first + GLOBAL_BATCH - 1) // SAMPLES + 1):
        stream += torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(ORDER_SEED + epoch)).tolist()
    return sorted(stream[first % SAMPLES:first % SAMPLES + GLOBAL_BATCH])


class Records:
    """The files one rank writes under `--out` (see the module docstring). `optimizer`: set by the
    script once it exists."""

    def __init__(self, out: str, rank: int, tag: str | None = None):
        self.out, self.rank = Path(out), rank
        self.tag = str(rank) if tag is None else tag  # the files' suffix (in place: the host, as ranks change)
        self.out.mkdir(parents=True, exist_ok=True)
        self.optimizer: torch.optim.Optimizer | None = None
        self.adapter = None  # the integration's adapter: when its save started (the reaction bench)

    def _optimizer_state(self, name: str, optimizer) -> None:
        if self.rank == 0 and optimizer is not None:
            torch.save(optimizer.state_dict()["state"], self.out / name)

    def _write(self, name: str, text: str) -> None:
        tmp = self.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.out / name)

    def progress(self, step: int, ids: list[int]) -> None:
        with open(self.out / f"ids-{self.tag}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "ids": ids, "t": time.time()}) + "\n")
        self._write(f"progress-{self.tag}", str(step))

    def saved(self, step: int, notice) -> None:
        self._write(f"saved-{self.tag}.json", json.dumps({"step": step, "notice": notice.id, "at": time.time(),
                                                          "started": getattr(self.adapter, "save_started_at", None),
                                                          "detected": notice.detected_at.timestamp()}))
        self._optimizer_state("optimizer-saved.pt", self.optimizer)

    def snapshot_step(self, step: int, every: int) -> None:
        """At each step the integration snapshots (`every` > 0): the optimizer state then (rank 0)."""
        if every and step % every == 0:
            self._optimizer_state(f"optimizer-step-{step}.pt", self.optimizer)

    def resumed(self, start: int, optimizer: torch.optim.Optimizer) -> None:
        steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        self._write(f"resumed-{self.tag}.json", json.dumps({"start": start, "optimizer_steps": sorted(set(steps))}))
        self._optimizer_state("optimizer-resumed.pt", optimizer)

    def final(self, model: torch.nn.Module) -> None:
        """Rank 0 writes the final parameters; then every rank leaves the process group together
        (a process that exits with gloo groups alive can abort in torch's teardown)."""
        if self.rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, self.out / "params-final.pt")
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def fail_rank0_saves(rank: int, checkpoint_dir: str) -> None:
    """`--fail-save`: rank 0's torch.save into `checkpoint_dir` raises, whether it is given a path or
    an open file there (spotguard's engine writes the integrations' files through a stream)."""
    if rank != 0:
        return
    real = torch.save
    root = os.path.abspath(checkpoint_dir)

    def target(f) -> str | None:
        while not isinstance(f, (str, os.PathLike)) and f is not None:
            f = getattr(f, "raw", None) or getattr(f, "name", None)
        return os.path.abspath(f) if f is not None else None

    def failing(obj, f, *args, **kwargs):
        name = target(f)
        if name is not None and name.startswith(root):
            raise OSError(28, "No space left on device (spotguard test)")
        return real(obj, f, *args, **kwargs)

    torch.save = failing
