"""A DDP job checkpoints to the object store at a notice with 2 ranks and resumes with 1 rank on
another node (a fresh local dir): the state loaded equals, bit for bit, the state saved.

Real multi-process gloo runs (tests/workers/trainer.py), a real S3-compatible server
(tests/s3_server.py). The ranks exit 83 after the drain; the upload finishes before they exit.
"""
from __future__ import annotations

import pytest

import json

from spotguard.hooks.checkpoint import open_store
from spotguard.wire.names import ENV_TERMINATION_LOG
from tests.workers.launch import assert_same_state, exits, load_state, run_ranks, saved

pytestmark = pytest.mark.slow


def leg(tmp_path, s3_server, url: str, name: str, world: int, signal_at: int, signal_rank: int):
    out = tmp_path / name
    node = tmp_path / f"node-{name}"
    env = {**s3_server.env(), "SPOTGUARD_LOCAL_CHECKPOINT_DIR": str(node)}
    rank_env = {r: {**env, ENV_TERMINATION_LOG: str(tmp_path / f"{name}-termination-{r}")} for r in range(world)}
    args = ["--mode", "ddp", "--ckpt", url, "--out", str(out), "--steps", "1000", "--signal-at", str(signal_at),
            "--signal-rank", str(signal_rank)]
    codes, tail = run_ranks(world, args, out / "logs", rank_env=rank_env)
    assert codes == [83] * world, tail
    assert exits(out, world) == [83] * world
    records = saved(out, world)
    assert len({r["step"] for r in records}) == 1, records
    # the drain waited for the upload: every rank reports the object store as the durable tier
    messages = [json.loads((tmp_path / f"{name}-termination-{r}").read_text()) for r in range(world)]
    assert all(m.get("durable_tier") == "object" and m.get("steps_lost") == 0 for m in messages), messages
    return out, records[0]["step"]


def test_ddp_saves_to_s3_with_2_ranks_and_resumes_with_1_on_another_node(tmp_path, s3_server, s3_env):
    first, step1 = leg(tmp_path, s3_server, s3_env, "w2", 2, signal_at=3, signal_rank=1)
    store = open_store(s3_env, local_dir=tmp_path / "reader")
    newest = store.latest()
    assert newest is not None and newest.step == step1 and newest.world_size == 2  # in the object store
    second, step2 = leg(tmp_path, s3_server, s3_env, "w1", 1, signal_at=step1 + 3, signal_rank=0)
    assert step2 == step1 + 3
    assert_same_state(load_state(first / "state-save.pt"), load_state(second / "state-resume.pt"))
    assert store.latest().step == step2
    store.close(10)
