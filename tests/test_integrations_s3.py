"""The Trainer with an `s3://` output_dir against a real S3-compatible server (tests/s3_server.py):
a SIGTERM drains into the object store as `checkpoint-N`, and a new Trainer resumes from it
through `last_checkpoint` (downloaded, verified). One small run, the README's usage."""
from __future__ import annotations

import json

from tests.test_integrations_usage import Clock, hf_trainer


def counting(clock: Clock):
    """A Trainer callback that tells `clock` where the run started and each step's end."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.started(state.global_step - 1)  # at the first step's end: the run started one step before
            clock.after_step(state.global_step)

    return Steps()


def test_the_trainer_saves_to_and_resumes_from_an_s3_output_dir(s3_env, tmp_path, monkeypatch):
    from spotguard.hooks.checkpoint import open_store
    from spotguard.integrations.hf import SpotguardCallback, last_checkpoint

    monkeypatch.chdir(tmp_path)  # whatever the Trainer itself writes stays in the test's folder
    monkeypatch.setenv("SPOTGUARD_LOCAL_CHECKPOINT_DIR", str(tmp_path / "node-a"))
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    first, clock = hf_trainer(s3_env), Clock()
    assert last_checkpoint(first) is None  # an empty prefix: a first run
    callback = SpotguardCallback.attach(first, exit_on_drain=False)
    first.add_callback(counting(clock))
    first.train(resume_from_checkpoint=last_checkpoint(first))
    drained_at = first.state.global_step
    assert clock.signalled and 3 <= drained_at < 12
    assert callback.adapter is not None and callback.adapter.store.wait_uploaded(60)
    newest = open_store(s3_env, local_dir=tmp_path / "reader").latest()
    assert newest is not None and newest.tag == f"checkpoint-{drained_at}", newest
    assert newest.metadata["reason"] == "notice"
    message = json.loads((tmp_path / "termination-log").read_text())  # the job's tier of `checkpoint-N`
    assert message["durable_tier"] == "object" and message["saved_step"] == drained_at, message
    made_by_the_trainer = tmp_path / "s3:"  # the Trainer makes its output_dir (empty: save_strategy "no")
    assert not [p for p in made_by_the_trainer.rglob("*") if p.is_file()], "nothing in a folder named after the URL"

    monkeypatch.setenv("SPOTGUARD_LOCAL_CHECKPOINT_DIR", str(tmp_path / "node-b"))  # another node
    second, clock = hf_trainer(s3_env), Clock()
    clock.signalled = True  # no second notice
    SpotguardCallback.attach(second)
    second.add_callback(counting(clock))
    resume_from = last_checkpoint(second)
    assert resume_from is not None and resume_from.endswith(f"checkpoint-{drained_at}")
    second.train(resume_from_checkpoint=resume_from)
    assert clock.started_at == drained_at and second.state.global_step == 12


def test_the_lightning_integration_refuses_an_s3_dirpath_naming_the_field():
    import pytest

    from spotguard.config import ConfigError
    from spotguard.integrations.lightning import LightningSave

    with pytest.raises(ConfigError, match="needs a local dirpath") as caught:
        LightningSave(object(), "s3://ckpt/job")
    assert caught.value.field == "dirpath"
