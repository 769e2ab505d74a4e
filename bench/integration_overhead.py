"""Per-step cost of the framework integrations with no notice: the Trainer, Accelerate and
Lightning loops with and without spotguard, in one run.

    .venv/bin/python bench/integration_overhead.py                  # 2 ranks, 50 ms steps, all three
    .venv/bin/python bench/integration_overhead.py --frameworks hf --steps 240

For each framework, 2 DDP ranks on gloo train the reference scripts' tiny model (its forward
sleeps `--step-ms`, the synthetic compute); the arm without spotguard and the arm with it
alternate in blocks inside the same processes, in ABBA order (so drift hits both). The arm with
spotguard is the one line users add (`SpotguardCallback.attach(trainer)`, `AccelerateGuard(...)` +
`guard.step(step)`, `SpotguardCallback()`), with the agreement piggybacked on DDP's gradient
all_reduce. Printed per framework (goal: <= 1% of a 50 ms step):
- direct: the median time per step inside the integration's step hook plus the median of the
  synchronous part of the piggyback's DDP communication hook, less the same for the arm without
  (its DDP runs the default mean all_reduce as a Python hook, timed the same way): the extra
  time per step; the means follow, which on a loaded machine include the preemptions any code
  suffers;
- the step ratio: for each adjacent pair of blocks, median step interval with / without - 1; the
  median over the pairs and their range (on a loaded machine the range shows the noise, which
  can exceed the cost).
(bench/guard_overhead.py measures the Guard itself in a hand-written loop the same way.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FRAMEWORKS = ("hf", "accelerate", "lightning")
# A worker's rank and world size, read once: Lightning's teardown deletes WORLD_SIZE from the environment.
RANK, SIZE = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=240, help="steps per arm")
    p.add_argument("--blocks", type=int, default=8, help="alternating blocks per arm")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


GRADIENT_HOOK: list[float] = []  # seconds of each call of the piggyback's DDP communication hook (synchronous part)


def time_gradient_hook() -> None:
    """Times the synchronous part of the piggyback's DDP communication hook (the flag appended to
    the last bucket, the all_reduce launched): wrapped on the class before any Guard exists."""
    from spotguard.hooks.agreement.piggyback import PiggybackAgreement

    real = PiggybackAgreement._gradient_hook

    def _gradient_hook(self, group, bucket):  # no annotations, like the real one (DDP checks them)
        t0 = time.perf_counter()
        try:
            return real(self, group, bucket)
        finally:
            GRADIENT_HOOK.append(time.perf_counter() - t0)

    PiggybackAgreement._gradient_hook = _gradient_hook  # type: ignore[method-assign]


REFERENCE_HOOK: list[float] = []  # the same, for DDP's mean all_reduce as a Python hook (the arm without)


def reference_hook(group, bucket):
    """The arm without spotguard: DDP's default mean all_reduce as a Python communication hook,
    timed like the piggyback's, so both arms' gradient hooks are measured the same way."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    REFERENCE_HOOK.append(time.perf_counter() - t0)
    return future.then(lambda done: done.value()[0])


class Timing:
    """Step-end times of one block, and the seconds spent inside the integration's step hook."""

    def __init__(self):
        self.ends: list[float] = []
        self.inside: list[float] = []  # seconds of each call
        self.agreement = ""  # how the ranks agree: PiggybackAgreement (inside DDP's all_reduce) or the Guard's own

    def end(self) -> None:
        self.ends.append(time.perf_counter())

    def timed(self, fn, owner):
        """`fn` timed; `owner.guard` is the integration's Guard (its agreement is recorded)."""
        def wrapper(*args, **kwargs):
            if owner.guard is not None:
                self.agreement = type(owner.guard.agreement).__name__
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside.append(time.perf_counter() - t0)
        return wrapper

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def sleepy_model(step_seconds: float):
    from spotguard.trainer.framework_refs import TinyRegression

    class Sleepy(TinyRegression):
        def forward(self, x, labels, idx=None):
            time.sleep(step_seconds)
            return super().forward(x, labels)
    return Sleepy()


def endless(rank: int, size: int):
    """Batches of this rank's share, forever (a bench needs no epochs)."""
    import torch

    from spotguard.trainer.framework_refs import GLOBAL_BATCH, Samples

    data, per_rank = Samples(), GLOBAL_BATCH // size
    while True:
        yield torch.utils.data.default_collate([data[i] for i in range(rank * per_rank, (rank + 1) * per_rank)])


def hf_block(with_guard: bool, steps: int, args, tmp: str) -> Timing:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spotguard.integrations.hf import SpotguardCallback
    from spotguard.trainer.framework_refs import GLOBAL_BATCH, Samples

    timing, size = Timing(), SIZE

    class End(TrainerCallback):
        def on_step_end(self, *a, **k):
            timing.end()

    training = TrainingArguments(output_dir=tmp, per_device_train_batch_size=GLOBAL_BATCH // size, max_steps=steps,
                                 save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
                                 remove_unused_columns=False, ddp_backend="gloo", disable_tqdm=True)
    trainer = Trainer(model=sleepy_model(args.step_ms / 1000), args=training, train_dataset=Samples())
    if with_guard:
        callback = SpotguardCallback.attach(trainer)
        callback.on_step_end = timing.timed(callback.on_step_end, callback)
    else:
        class Reference(TrainerCallback):
            def on_train_begin(self, *a, **k):
                trainer.model_wrapped.register_comm_hook(None, reference_hook)
        trainer.add_callback(Reference())
    trainer.add_callback(End())
    trainer.train()
    return timing


def lightning_block(with_guard: bool, steps: int, args, tmp: str) -> Timing:
    import lightning.pytorch as pl
    import torch

    from spotguard.integrations.lightning import SpotguardCallback

    timing, rank, size = Timing(), RANK, SIZE

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = sleepy_model(args.step_ms / 1000)

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def on_train_batch_end(self, *a):
            timing.end()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callbacks = []
    if with_guard:
        callback = SpotguardCallback(dirpath=tmp)
        callback.on_train_batch_end = timing.timed(callback.on_train_batch_end, callback)
        callbacks.append(callback)
    else:
        class Reference(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                trainer.strategy.model.register_comm_hook(None, reference_hook)
        callbacks.append(Reference())
    trainer = pl.Trainer(accelerator="cpu", devices=size, strategy="ddp", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(Module(), endless(rank, size))
    return timing


class AccelerateArms:
    """Two prepared DDP models in one Accelerator; the second one's steps go through the helper."""

    def __init__(self, args, tmp: str):
        import torch
        from accelerate import Accelerator

        from spotguard.integrations.accelerate import AccelerateGuard

        self.accelerator = Accelerator(cpu=True)
        self.arms = {}
        for with_guard in (False, True):
            model = sleepy_model(args.step_ms / 1000)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, optimizer = self.accelerator.prepare(model, optimizer)
            guard = AccelerateGuard(self.accelerator, tmp, model=model) if with_guard else None
            if not with_guard:
                model.register_comm_hook(None, reference_hook)
            self.arms[with_guard] = (model, optimizer, guard)
        self.batches = endless(RANK, SIZE)
        self.step = 0

    def block(self, with_guard: bool, steps: int) -> Timing:
        model, optimizer, guard = self.arms[with_guard]
        timing = Timing()
        step_hook = timing.timed(guard.step, guard) if guard is not None else None
        timing.end()
        for _ in range(steps):
            loss = model(**next(self.batches))["loss"]
            self.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step_hook is not None:
                step_hook(self.step)
            self.step += 1
            timing.end()
        return timing


def worker(args) -> None:
    import torch.distributed as dist

    tmp = tempfile.mkdtemp(prefix=f"spotguard-bench-{args.worker}-")
    per_block = max(2, args.steps // args.blocks)
    blocks: dict[str, list[float]] = {"without": [], "with": []}  # the median step interval of each block
    intervals: dict[str, list[float]] = {"without": [], "with": []}
    inside: list[float] = []
    agreement = ""
    time_gradient_hook()
    accelerate = AccelerateArms(args, tmp) if args.worker == "accelerate" else None
    run = {"hf": lambda g, n: hf_block(g, n, args, tmp), "lightning": lambda g, n: lightning_block(g, n, args, tmp),
           "accelerate": lambda g, n: accelerate.block(g, n)}[args.worker]
    run(False, 3), run(True, 3)  # warm-up of both paths
    GRADIENT_HOOK.clear()
    REFERENCE_HOOK.clear()
    for block in range(2 * args.blocks):
        with_guard = block % 2 == (block // 2) % 2  # pairs alternate which arm runs first: ABBA...
        arm = "with" if with_guard else "without"
        timing = run(with_guard, per_block + 1)
        steps = timing.intervals()[1:]  # the first follows set-up
        intervals[arm] += steps
        blocks[arm].append(statistics.median(steps))
        inside += timing.inside
        agreement = timing.agreement or agreement
    if RANK == 0:
        mean = {arm: sum(v) / len(v) for arm, v in intervals.items()}
        pairs = [w / o - 1 for w, o in zip(blocks["with"], blocks["without"])]
        Path(args.result).write_text(json.dumps({
            "mean": mean, "median": {arm: statistics.median(v) for arm, v in intervals.items()},
            "pairs": pairs, "steps": {a: len(v) for a, v in intervals.items()},
            "inside": [statistics.median(inside), statistics.mean(inside)],
            "gradient_hook": [statistics.median(GRADIENT_HOOK), sum(GRADIENT_HOOK) / len(inside)] if GRADIENT_HOOK
            else [0.0, 0.0],
            "reference_hook": statistics.median(REFERENCE_HOOK) if REFERENCE_HOOK else 0.0,
            "agreement": agreement}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_framework(framework: str, args) -> dict:
    from spotguard.processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port, procs = str(free_port()), []
        try:
            for rank in range(args.ranks):
                env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
                env.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
                procs.append(subprocess.Popen([sys.executable, __file__, "--worker", framework, "--result", str(result),
                                               "--steps", str(args.steps), "--blocks", str(args.blocks),
                                               "--step-ms", str(args.step_ms)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            codes = [p.wait(600) for p in procs]
            if any(codes):
                raise SystemExit(f"{framework}: workers failed {codes}: {procs[0].stderr.read().decode()[-2000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        return json.loads(result.read_text())


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    print(f"integration_overhead: {args.ranks} ranks, gloo, {args.step_ms:.0f} ms step, ~{args.steps} steps per arm "
          f"(arms interleaved in {args.blocks} blocks each)")
    for framework in args.frameworks:
        r = run_framework(framework, args)
        step_s = args.step_ms / 1000
        (step_med, step_mean), (grad_med, grad_mean) = r["inside"], r["gradient_hook"]
        extra = step_med + grad_med - r["reference_hook"]
        pairs = sorted(r["pairs"])
        print(f"  {framework:<10} direct, medians per step: step hook {step_med * 1000:.3f} ms + gradient hook "
              f"{grad_med * 1000:.3f} ms (without: {r['reference_hook'] * 1000:.3f} ms) -> extra {extra * 1000:.3f} ms "
              f"= {100 * extra / step_s:.2f}% of a {args.step_ms:.0f} ms step (means {step_mean * 1000:.3f} + "
              f"{grad_mean * 1000:.3f} ms, preemptions included; {r['agreement']}) | step ratio, median of "
              f"{len(pairs)} paired blocks {100 * statistics.median(pairs):+6.2f}% (range {100 * pairs[0]:+.1f}.."
              f"{100 * pairs[-1]:+.1f}%), medians {r['median']['without'] * 1000:.2f} / "
              f"{r['median']['with'] * 1000:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
