"""The integrations as the README shows them, one process each (the reference scripts' tiny model):

- Trainer: on a first run `resume_from_checkpoint=True` raises transformers' "No valid checkpoint
  found", so the README resumes from `last_checkpoint(trainer)`, which is None then (no folder, an
  empty one, only a save in progress) and the newest `checkpoint-N` after a save; with
  `exit_on_drain=False` a SIGTERM stops the Trainer after the drain (the callback's comment), the
  checkpoint committed as `checkpoint-N`; a new Trainer resumes from it at step N.
- Lightning: a spotguard save logs nothing about `weights_only` (Lightning's own save without it
  does: "`weights_only` was not set"); with `exit_on_drain=False` a SIGTERM stops the fit after the
  drain, the checkpoint committed as `step-<N, 9 digits>-notice/last.ckpt`.
- The folder names the README and the integrations' docstrings give are the names the store makes.
- Under `spotguard launch` a drained integration run (2 ranks) exits 83 (torchrun would exit 1),
  and the Trainer's next launch (1 rank) resumes where it drained.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spotguard.hooks.adapters.base import tag_for
from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.trainer.framework_refs import GLOBAL_BATCH, Samples, TinyRegression
from tests.workers.launch import base_env, wait_for_progress

ROOT = Path(__file__).resolve().parent.parent
SIGNAL_AT = 3  # the step after which the test signals itself


def hf_trainer(output_dir: Path, steps: int = 12):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=GLOBAL_BATCH, max_steps=steps,
                             learning_rate=1e-2, save_strategy="no", logging_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False, seed=7,
                             disable_tqdm=True)
    return Trainer(model=TinyRegression(), args=args, train_dataset=Samples())


class Clock:
    """Records where a run started and sends this process SIGTERM once, after step SIGNAL_AT."""

    def __init__(self) -> None:
        self.started_at: int | None = None
        self.signalled = False

    def started(self, step: int) -> None:
        if self.started_at is None:
            self.started_at = step

    def after_step(self, step: int) -> None:
        if step == SIGNAL_AT and not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)  # the Guard's trap is installed: a notice, not a death


def test_trainer_first_run_resume_and_a_drain_without_exiting(tmp_path):
    from transformers import TrainerCallback

    from spotguard.integrations.hf import SpotguardCallback, last_checkpoint

    class Steps(TrainerCallback):
        def __init__(self, clock: Clock):
            self.clock = clock

        def on_train_begin(self, args, state, control, **kwargs):
            self.clock.started(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.after_step(state.global_step)

    out = tmp_path / "out"
    trainer = hf_trainer(out)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)  # what the README said before: fails on a first run
    assert last_checkpoint(trainer) is None  # the folder exists now, empty
    (out / ".pending-checkpoint-9").mkdir()
    assert last_checkpoint(trainer) is None  # a save in progress is not a checkpoint
    assert last_checkpoint(hf_trainer(tmp_path / "none")) is None  # no folder at all

    first, clock = hf_trainer(out), Clock()
    SpotguardCallback.attach(first, exit_on_drain=False)
    first.add_callback(Steps(clock))
    first.train(resume_from_checkpoint=last_checkpoint(first))
    assert clock.started_at == 0 and clock.signalled
    drained_at = first.state.global_step
    assert SIGNAL_AT <= drained_at < 12  # stopped after the drain, the process still here
    assert last_checkpoint(first) == str(out / f"checkpoint-{drained_at}")
    assert CheckpointStore(out).resolve(verify=True).metadata["reason"] == "notice"

    second, clock = hf_trainer(out), Clock()
    clock.signalled = True  # no second notice
    SpotguardCallback.attach(second)
    second.add_callback(Steps(clock))
    second.train(resume_from_checkpoint=last_checkpoint(second))
    assert clock.started_at == drained_at and second.state.global_step == 12


class LightningLogs(logging.Handler):
    """The messages Lightning logs (its loggers do not all reach the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.logger = logging.getLogger("lightning.pytorch")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LightningLogs:
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def lightning_fit(ckpt: Path, clock: Clock, **spotguard_options):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from spotguard.integrations.lightning import SpotguardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyRegression()

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def on_train_start(self):
            clock.started(self.trainer.global_step)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            clock.after_step(self.trainer.global_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=str(ckpt), save_last=True),
                                    SpotguardCallback(**spotguard_options)])
    trainer.fit(Module(), torch.utils.data.DataLoader(Samples(), batch_size=GLOBAL_BATCH), ckpt_path="last")
    return trainer


def test_lightning_saves_say_nothing_about_weights_only_and_a_drain_without_exiting(tmp_path):
    ckpt, clock = tmp_path / "ckpt", Clock()
    with LightningLogs() as logs:
        trainer = lightning_fit(ckpt, clock, exit_on_drain=False)
        spotguard_messages = list(logs.messages)
        trainer.save_checkpoint(str(tmp_path / "own.ckpt"))  # Lightning's own save, as the control
    assert "`weights_only` was not set, defaulting to `False`." in logs.messages[len(spotguard_messages):]
    assert [m for m in spotguard_messages if "weights_only" in m] == []

    drained_at = trainer.global_step
    assert clock.signalled and SIGNAL_AT <= drained_at < 12  # stopped after the drain, the process still here
    info = CheckpointStore(ckpt).resolve(verify=True)
    assert info.dir.name == f"step-{drained_at:09d}-notice" and (info.dir / "last.ckpt").is_file()
    assert os.path.samefile(ckpt / "last.ckpt", info.dir / "last.ckpt")


def documented_folder_names() -> dict[str, list[str]]:
    """Every `step-...-notice` / `checkpoint-...` folder name the README's integrations section,
    docs/integrations.md and the integrations' docstrings give, by file."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("one line in the training code you already run", 1)[1].split("\n### ", 1)[0]
    texts = {"README.md": section, "docs/integrations.md": (ROOT / "docs" / "integrations.md").read_text()}
    texts.update({f"integrations/{p.name}": p.read_text(encoding="utf-8")
                  for p in sorted((ROOT / "integrations").glob("*.py"))})
    return {name: re.findall(r"step-[^\s`/]*-notice", text) for name, text in texts.items()}


def test_the_documented_folder_names_are_the_ones_the_store_makes():
    named = documented_folder_names()
    assert named["README.md"] and named["docs/integrations.md"] and named["integrations/lightning.py"]
    example = tag_for(112, "notice")
    assert example == "step-000000112-notice"
    for where, names in named.items():
        for name in names:
            assert name in (example, "step-<N, 9 digits>-notice"), f"{where}: {name}"


def launch(module: str, ckpt: Path, out: Path, steps: int, ranks: int = 2) -> subprocess.Popen:
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "spotguard", "launch", "--standalone", "--nproc-per-node",
                             str(ranks), "-m", module, "--ckpt", str(ckpt), "--out", str(out), "--steps", str(steps),
                             "--step-sleep", "0.05"], stdout=log, stderr=subprocess.STDOUT, env=base_env(),
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_drained_trainer_run_under_spotguard_launch_exits_83_and_resumes(tmp_path):
    ckpt, first_out, second_out = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    first = launch("spotguard.trainer.train_hf", ckpt, first_out, 10_000)
    try:
        wait_for_progress(first_out, 0, 2, timeout=600, procs=[first])
        first.send_signal(signal.SIGTERM)  # what a pod's termination sends its PID 1
        assert first.wait(timeout=300) == 83, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    drained = int(CheckpointStore(ckpt).resolve(verify=True).metadata["step"])

    # the resume on one rank: what is checked is that the launch resumes where the drain left off, which
    # does not depend on the world (a resume at another one is tests/test_integrations_deadline.py's)
    second = launch("spotguard.trainer.train_hf", ckpt, second_out, drained + 4, ranks=1)
    try:
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    assert json.loads((second_out / "resumed-0.json").read_text())["start"] == drained
