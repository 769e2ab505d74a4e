"""The ElasticSampler through each framework integration, one process each (the reference scripts'
tiny model and 64 samples): the position survives the framework's OWN checkpoints too (the
Trainer's periodic `checkpoint-N`, Lightning's `ModelCheckpoint`, Accelerate's `save_state`), a
resume continues the uninterrupted order, and bad input is refused at start with what to change.
The multi-rank runs through a shrink and a grow are tests/test_integrations_multirank.py."""
from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch

from spotguard.config import ConfigError
from spotguard.data import DataPositionError, ElasticSampler
from spotguard.trainer.framework_refs import ORDER_SEED, SAMPLES, Samples, TinyRegression
from tests.ledger import uninterrupted

BATCH = 8


def sampler() -> ElasticSampler:
    return ElasticSampler(Samples(), global_batch=BATCH, seed=ORDER_SEED)


# ---- the Trainer ------------------------------------------------------------------------------
def hf_run(out, steps: int, data: ElasticSampler, *, per_device: int = BATCH, skip: bool = True, save_steps: int = 0):
    """A Trainer with spotguard's callback and `data`; {global step: ids} of the steps it trained."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spotguard.integrations.hf import SpotguardCallback, last_checkpoint

    model, trained = TinyRegression(), {}

    class Ids(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained[state.global_step] = model.take_ids()

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=per_device, max_steps=steps,
                             learning_rate=1e-2, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, logging_strategy="no", report_to=[], use_cpu=True,
                             remove_unused_columns=False, seed=7, disable_tqdm=True, ignore_data_skip=skip)
    trainer = Trainer(model=model, args=args, train_dataset=Samples())
    trainer.add_callback(Ids())
    SpotguardCallback.attach(trainer, sampler=data)
    trainer.train(resume_from_checkpoint=last_checkpoint(trainer))
    return trained


def by_step(trained: dict[int, list[int]], first: int = 1) -> dict[int, list[int]]:
    """{global step (1-based): ids} -> {0-based step: sorted ids}, as tests/ledger.py numbers them."""
    return {s - first: sorted(ids) for s, ids in trained.items()}


def test_trainer_resumes_the_order_from_its_own_periodic_checkpoint(tmp_path):
    first = hf_run(tmp_path, 12, sampler(), save_steps=5)  # checkpoint-5, -10, -12: the Trainer's, not spotguard's
    assert (tmp_path / "checkpoint-10" / "spotguard-data.json").is_file()
    shutil.rmtree(tmp_path / "checkpoint-12")  # the final one: resume from -10, saved while the run went on
    later = hf_run(tmp_path, 20, sampler())
    assert sorted(later) == list(range(11, 21))
    expected = uninterrupted(SAMPLES, ORDER_SEED, BATCH, 20)
    assert by_step({**{s: first[s] for s in range(1, 11)}, **later}) == expected


def test_trainer_refuses_a_checkpoint_without_the_position(tmp_path):
    hf_run(tmp_path, 5, sampler(), save_steps=5)
    (tmp_path / "checkpoint-5" / "spotguard-data.json").unlink()
    with pytest.raises(DataPositionError, match=re.escape("checkpoint-5/spotguard-data.json holds no data position")):
        hf_run(tmp_path, 8, sampler())


def test_trainer_needs_ignore_data_skip_and_the_sampler_s_global_batch(tmp_path):
    with pytest.raises(ConfigError) as caught:
        hf_run(tmp_path / "skip", 4, sampler(), skip=False)
    assert caught.value.field == "ignore_data_skip"
    with pytest.raises(ConfigError, match="4 x 1 ranks x 1 accumulation = 4 samples per step, but the sampler's "
                                          "step takes 8") as caught:
        hf_run(tmp_path / "size", 4, sampler(), per_device=4)
    assert caught.value.field == "per_device_train_batch_size"


# ---- Accelerate -------------------------------------------------------------------------------
def accelerate_run(ckpt, steps: int, data: ElasticSampler | None, loader_kwargs: dict | None = None,
                   save_at: int | None = None) -> dict[int, list[int]]:
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AccelerateGuard

    accelerator = Accelerator(cpu=True)
    model = TinyRegression()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = loader_kwargs or {"batch_size": BATCH, "sampler": data.global_order()}
    loader = torch.utils.data.DataLoader(Samples(), **kwargs)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = AccelerateGuard(accelerator, ckpt, model=model, sampler=data)
    trained = {}
    try:
        start = guard.resume()
        for step, batch in guard.batches(loader, start, steps):
            accelerator.backward(model(**batch)["loss"])
            optimizer.step()
            optimizer.zero_grad()
            trained[step] = sorted(int(i) for i in batch["idx"])
            if step == save_at:
                guard.adapter.save(step, reason="periodic")
            guard.step(step)
    finally:
        guard.close()
    return trained


def test_accelerate_resumes_the_order_from_save_state(tmp_path):
    first = accelerate_run(tmp_path, 9, sampler(), save_at=5)  # save_state of step 5 (the 6th), then 3 more
    later = accelerate_run(tmp_path, 14, sampler())
    assert sorted(later) == list(range(6, 14))
    assert {**{s: first[s] for s in range(6)}, **later} == uninterrupted(SAMPLES, ORDER_SEED, BATCH, 14)


def test_accelerate_refuses_a_loader_that_does_not_draw_from_the_sampler_or_deals_another_batch(tmp_path):
    with pytest.raises(ConfigError, match="does not draw from the sampler given to AccelerateGuard"):
        accelerate_run(tmp_path / "a", 3, sampler(), {"batch_size": BATCH})
    data = sampler()
    with pytest.raises(ConfigError, match=r"deals 4 samples per step .* takes 8 at this world size"):
        accelerate_run(tmp_path / "b", 3, data, {"batch_size": 4, "sampler": data.global_order()})


def test_accelerate_without_a_sampler_warns_at_a_resume(tmp_path, caplog):
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AccelerateGuard

    guard = AccelerateGuard(Accelerator(cpu=True), tmp_path)
    try:
        loader = torch.utils.data.DataLoader(Samples(), batch_size=BATCH)
        with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):
            assert next(guard.batches(loader, 0, 2))[0] == 0
            assert not caplog.records
            assert next(guard.batches(loader, 3, 5))[0] == 3
        assert "exact only when the global batch and the loader's order are the same at every world size" in \
            caplog.records[0].getMessage()
    finally:
        guard.close()


# ---- Lightning --------------------------------------------------------------------------------
def lightning_run(ckpt, steps: int, data: ElasticSampler | None, *, loader=None,
                  accumulate: int = 1) -> dict[int, list[int]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from spotguard.integrations.lightning import SpotguardCallback

    trained: dict[int, list[int]] = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyRegression()

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            trained[self.trainer.global_step] = self.model.take_ids()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, accumulate_grad_batches=accumulate,
                         callbacks=[ModelCheckpoint(dirpath=str(ckpt), save_last=True, every_n_train_steps=5,
                                                    save_top_k=0),
                                    SpotguardCallback(sampler=data)])
    loader = loader if loader is not None else torch.utils.data.DataLoader(Samples(), batch_sampler=data)
    trainer.fit(Module(), loader, ckpt_path="last" if (ckpt / "last.ckpt").exists() else None)
    return trained


def test_lightning_resumes_the_order_from_its_own_checkpoint(tmp_path):
    first = lightning_run(tmp_path, 12, sampler())  # Lightning's last.ckpt at steps 5 and 10
    later = lightning_run(tmp_path, 20, sampler())
    assert sorted(later) == list(range(11, 21))
    assert by_step({**{s: first[s] for s in range(1, 11)}, **later}) == uninterrupted(SAMPLES, ORDER_SEED, BATCH, 20)


def test_lightning_refuses_a_loader_that_does_not_draw_from_the_sampler_and_another_accumulation(tmp_path):
    with pytest.raises(ConfigError, match="the train loader does not draw from it"):
        lightning_run(tmp_path / "a", 3, sampler(), loader=torch.utils.data.DataLoader(Samples(), batch_size=BATCH))
    with pytest.raises(ConfigError) as caught:
        lightning_run(tmp_path / "b", 3, sampler(), accumulate=2)
    assert caught.value.field == "accumulate_grad_batches"


class Unsized(torch.utils.data.IterableDataset):
    """A stream of the samples with no state_dict (nothing can save its position) and no length."""

    def __iter__(self):
        return iter(Samples()[i] for i in range(SAMPLES))


class Stream(Unsized):
    """`Unsized` with a length."""

    def __len__(self) -> int:
        return SAMPLES


def test_accelerate_refuses_or_warns_at_start_of_a_stream_and_in_place_needs_spotguard_s_group(tmp_path, caplog):
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AccelerateGuard

    guard = AccelerateGuard(Accelerator(cpu=True), tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):
            guard.batches(torch.utils.data.DataLoader(Samples(), batch_size=BATCH), 0, 2)
            assert not caplog.records  # map-style: nothing to say at a first start
            guard.batches(torch.utils.data.DataLoader(Stream(), batch_size=BATCH), 0, 2)
        assert "streams an IterableDataset (Stream) without a state_dict" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):  # prepared: the same
            guard.batches(guard.accelerator.prepare(torch.utils.data.DataLoader(Stream(), batch_size=BATCH)), 0, 2)
        assert "streams an IterableDataset (Stream) without a state_dict" in caplog.text
        assert "ElasticSampler" in caplog.text
        with pytest.raises(ConfigError, match="has no length"):
            guard.batches(torch.utils.data.DataLoader(Unsized(), batch_size=BATCH), 0, 2)
    finally:
        guard.close()
    with pytest.raises(ConfigError, match=r"init_process_group\(\) before Accelerator\(\)"):
        AccelerateGuard(Accelerator(cpu=True), tmp_path / "in-place", sampler=sampler(), in_place=True)


def test_trainer_warns_at_start_of_a_stream_without_state(tmp_path, caplog):
    from transformers import Trainer, TrainingArguments

    from spotguard.integrations.hf import SpotguardCallback

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=1,
                             save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=TinyRegression(), args=args, train_dataset=Stream())
    SpotguardCallback.attach(trainer)
    with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):
        trainer.train()
    assert "the Trainer SpotguardCallback: the train loader streams an IterableDataset (Stream)" in caplog.text


def test_lightning_warns_at_start_of_a_stream_without_state(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="spotguard.integrations"):
        lightning_run(tmp_path, 1, None, loader=torch.utils.data.DataLoader(Stream(), batch_size=BATCH))
    assert "the Lightning SpotguardCallback: the train loader streams an IterableDataset (Stream)" in caplog.text
