"""What one in-memory snapshot of a framework integration costs (`snapshot_every=N`): the training
thread's stall at the step boundary, for the Trainer, Accelerate and Lightning, against a plain copy
of the same bytes.

    spotguard bench integration_snapshot                      # ~100 MB of state, all three
    spotguard bench integration_snapshot --state-mb 400 --frameworks hf

One process per framework (CPU, no process group): a stack of 1024-wide linear layers sized so
that its parameters and AdamW's two moments hold `--state-mb`, trained `--steps` steps with
`snapshot_every=1`. A snapshot is the framework's own save (`_save_checkpoint`, `save_state`,
`save_checkpoint`) captured into the snapshot engine's buffers: the engine's measured stall of each
(the first, which allocated the buffers, left out). Printed per framework, one JSON line: the median
and the slowest snapshot, the median copy of the same bytes into a preallocated buffer (memcpy), and
the median step without the snapshot's share. A step then costs `snapshot / N` on average.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

FRAMEWORKS = ("hf", "accelerate", "lightning")
WIDTH = 1024
BATCH = 8


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--state-mb", type=float, default=100.0, help="parameters + AdamW moments, in MB")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model(state_mb: float):
    import torch

    class Net(torch.nn.Module):
        def __init__(self, layers: int):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)],
                                           torch.nn.Linear(WIDTH, 1))

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}

    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # fp32 weights, AdamW's exp_avg and exp_avg_sq
    return Net(max(1, round(state_mb * 1e6 / per_layer)))


def data():
    import torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, WIDTH, generator=g), torch.randn(256, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(256)]


class Probe:
    """The engine's stall of each snapshot and the time between step boundaries, read after spotguard's hook."""

    def __init__(self):
        self.snapshots: list[float] = []
        self.boundaries: list[float] = []

    def after_boundary(self, adapter) -> None:
        self.boundaries.append(time.perf_counter())
        times = adapter.snapshot_engine.snapshot_seconds
        if times:
            self.snapshots.append(times[-1])


def run_hf(state_mb: float, steps: int, probe: Probe) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spotguard.integrations.hf import SpotguardCallback

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=steps,
                             save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=model(state_mb), args=args, train_dataset=data())
    spotguard = SpotguardCallback.attach(trainer, snapshot_every=1)

    class After(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            probe.after_boundary(spotguard.adapter)

    trainer.add_callback(After())
    trainer.train()


def run_accelerate(state_mb: float, steps: int, probe: Probe) -> None:
    import torch
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AccelerateGuard

    accelerator = Accelerator(cpu=True)
    net = model(state_mb)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    guard = AccelerateGuard(accelerator, tempfile.mkdtemp(), model=net, snapshot_every=1)
    for step, batch in guard.batches(loader, guard.resume(), steps):
        accelerator.backward(net(**batch)["loss"])
        optimizer.step()
        optimizer.zero_grad()
        guard.step(step)
        probe.after_boundary(guard.adapter)
    guard.close()


def run_lightning(state_mb: float, steps: int, probe: Probe) -> None:
    import lightning.pytorch as pl
    import torch

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model(state_mb)

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    spotguard = SpotguardCallback(dirpath=tempfile.mkdtemp(), snapshot_every=1)

    class After(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            probe.after_boundary(spotguard.adapter)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[spotguard, After()])
    trainer.fit(Module(), torch.utils.data.DataLoader(data(), batch_size=BATCH))


def memcpy_seconds(state_mb: float) -> float:
    import torch

    source = torch.randn(int(state_mb * 1e6 / 4))
    target = torch.empty_like(source)
    times = []
    for _ in range(7):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def worker(framework: str, state_mb: float, steps: int) -> dict:
    probe = Probe()
    {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning}[framework](state_mb, steps, probe)
    snapshots = probe.snapshots[1:]  # the first allocated the buffers
    gaps = [b - a for a, b in zip(probe.boundaries[1:], probe.boundaries[2:])]
    median = statistics.median(snapshots)
    return {"framework": framework, "state_mb": state_mb, "snapshots": len(snapshots),
            "snapshot_s_median": round(median, 4), "snapshot_s_max": round(max(snapshots), 4),
            "memcpy_s_median": round(memcpy_seconds(state_mb), 4),
            "step_s_median_without_snapshot": round(statistics.median(gaps) - median, 4)}


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.worker:
        print(json.dumps(worker(opts.worker, opts.state_mb, opts.steps)))
        return 0
    for framework in opts.frameworks:
        done = subprocess.run([sys.executable, __file__, "--worker", framework, "--state-mb", str(opts.state_mb),
                               "--steps", str(opts.steps)], capture_output=True, text=True, timeout=1200)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{\"framework\"")]
        if done.returncode or not lines:
            print(f"{framework}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
