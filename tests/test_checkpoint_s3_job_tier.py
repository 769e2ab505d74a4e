"""The durable tier a rank reports is the job's, never its own part's (a real S3-compatible server,
tests/s3_server.py; real gloo ranks, tests/workers/trainer.py).

2 DDP ranks drain at a notice into `s3://`; rank 0 (the committer) reaches the bucket through a
proxy the test holds, so its part and its commit never get there; once rank 1 uploaded its part
and left, rank 0's node is lost (SIGKILL). Rank 1's part alone is no checkpoint: its termination
message must not say `object`, and the steps it counts lost must be those since the last commit
in the object store (none here), as docs/protocols.md says.
"""
from __future__ import annotations

import json

from spotguard.hooks.checkpoint.manifest import MANIFEST, PART_PREFIX
from spotguard.hooks.checkpoint.objectstore.url import ObjectStoreURL
from spotguard.supervisor.progress import steps_lost_of
from spotguard.wire.names import ENV_TERMINATION_LOG
from tests.s3_server import BUCKET, SlowProxy
from tests.workers.launch import Run, wait_for_progress


def bucket_keys(s3_server, url: str) -> list[str]:
    prefix = ObjectStoreURL.parse(url).root_key
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])]


def test_a_ranks_uploaded_part_is_not_the_jobs_checkpoint_when_the_committer_is_lost(tmp_path, s3_server, s3_env):
    proxy = SlowProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), bytes_per_second=1 << 30)
    out = tmp_path / "out"
    logs = {r: tmp_path / f"termination-{r}" for r in (0, 1)}
    rank_env = {r: {**s3_server.env(), "SPOTGUARD_LOCAL_CHECKPOINT_DIR": str(tmp_path / f"node-{r}"),
                    ENV_TERMINATION_LOG: str(logs[r])} for r in (0, 1)}
    rank_env[0]["SPOTGUARD_S3_ENDPOINT"] = proxy.endpoint
    args = ["--mode", "ddp", "--ckpt", s3_env, "--out", str(out), "--steps", "100000", "--step-sleep", "0.02",
            "--signal-at", "60", "--signal-rank", "1", "--grace", "6", "--no-compare"]
    try:
        with Run(2, args, out / "logs", rank_env=rank_env) as run:
            wait_for_progress(out, 0, 2, timeout=120, procs=run.procs)
            proxy.pause()  # from now on nothing of rank 0 reaches the bucket: not its part, not its commit
            assert run.procs[1].wait(120) == 83, run.tail()  # rank 1 drained, its part uploaded
            run.procs[0].kill()  # then rank 0's node is lost, its upload never through
            run.procs[0].wait(10)
            tail = run.tail()
    finally:
        proxy.resume()
        proxy.close()
    keys = bucket_keys(s3_server, s3_env)
    assert any(k.endswith(f"{PART_PREFIX}1.json") for k in keys), ("rank 1's part is in the bucket", keys, tail)
    assert not any(k.endswith(MANIFEST) for k in keys), "no commit reached the bucket"
    message = json.loads(logs[1].read_text())
    assert message["checkpoint"] == "durable" and message["durable_tier"] == "local", (message, tail)
    assert steps_lost_of({"message": logs[1].read_text()}) == message["step"], message  # nothing survives the node
    if logs[0].exists():  # rank 0 was killed waiting for its upload; had it written, never `object`
        assert json.loads(logs[0].read_text()).get("durable_tier") != "object"
