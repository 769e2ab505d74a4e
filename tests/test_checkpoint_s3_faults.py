"""The object-store tier under faults of a real S3-compatible server (tests/s3_server.py): the server
restarted in the middle of an upload, and a slow server against a notice's deadline.
"""
from __future__ import annotations

import os
import time

import pytest

from spotguard.hooks.checkpoint import open_store
from spotguard.hooks.checkpoint.objectstore.uploader import RetryPolicy
from tests.s3_server import BUCKET, S3Server, SlowProxy


@pytest.fixture
def server(tmp_path, monkeypatch):
    srv = S3Server(tmp_path / "s3").start()
    for name, value in srv.env().items():
        monkeypatch.setenv(name, value)
    try:
        yield srv
    finally:
        srv.stop(kill=True)  # thrown away: no ~2.3 s graceful shutdown


def save(store, tag: str, files: dict[str, bytes], step: int):
    pending = store.begin(tag)
    for name, data in files.items():
        pending.write_bytes(name, data)
    pending.finish_rank(0)
    return store.commit(tag, world_size=1, metadata={"step": step, "reason": "notice"})


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["restart", "outage"])
def test_server_restarted_mid_upload_leaves_the_checkpoint_complete_or_invisible(fault, server, tmp_path):
    """`restart`: killed and started again at once (boto3's retries may carry the upload over);
    `outage`: down until the upload failed a try, then started again: the interrupted upload is
    retried (no new save needed) and the checkpoint reaches the bucket."""
    url = f"s3://{BUCKET}/restart"
    store = open_store(url, local_dir=tmp_path / "node", multipart_threshold=5 << 20, lease_seconds=2,
                       retry=RetryPolicy(seconds=120, base=0.1, cap=1.0))
    save(store, "step-1", {"w": os.urandom(1000)}, 1)
    assert store.wait_uploaded(60) and store.durable_tier("step-1") == "object"
    big = {"w": os.urandom(60 << 20), "v": os.urandom(1000)}
    client = server.client()
    save(store, "step-2", big, 2)
    # restart the server while a multipart upload of step-2 is open
    wait_for(lambda: bool(client.list_multipart_uploads(Bucket=BUCKET, Prefix="restart/").get("Uploads"))
             or store.wait_uploaded(0), 60, "a multipart upload in progress")
    if fault == "restart":
        server.restart(kill=True)
        assert store.wait_uploaded(180)
    else:
        server.stop(kill=True)
        failures = store.uploader.metrics.failures
        wait_for(lambda: failures.value(kind="part") + failures.value(kind="commit") > 0, 120, "a failed try")
        assert store.durable_tier("step-2") == "local" and not store.wait_uploaded(0)  # retrying, on local disk
        server.start()
        assert store.wait_uploaded(120)
        assert store.durable_tier("step-2") == "object", "the interrupted upload is retried once the server is back"
        assert "spotguard_checkpoint_upload_failures_total" in store.metrics.render()
    tier = store.durable_tier("step-2")
    reader = open_store(url, local_dir=tmp_path / "reader")
    tags = [i.tag for i in reader.list()]
    if tier == "object":  # boto3's retries carried the upload over the restart
        assert tags == ["step-1", "step-2"]
        info = reader.resolve()
        assert {n: (info.dir / n).read_bytes() for n in big} == big
    else:  # the upload failed: nothing partial is visible, the previous checkpoint still loads
        assert tier == "local" and tags == ["step-1"]
        assert reader.resolve().tag == "step-1"
    save(store, "step-3", {"w": b"after"}, 3)  # the store goes on after the restart
    assert store.wait_uploaded(60) and store.durable_tier("step-3") == "object"
    assert open_store(url, local_dir=tmp_path / "reader2").resolve().tag == "step-3"
    store.close(10)


def test_a_slow_server_does_not_hold_up_local_durability(server, tmp_path, monkeypatch):
    """At 1 MB/s the upload of 12 MB takes >= 12 s; the save is durable on local disk at once,
    reported as the local tier until the upload ends, then as the object tier."""
    proxy = SlowProxy(int(server.endpoint.rsplit(":", 1)[1]), bytes_per_second=1 << 20)
    monkeypatch.setenv("SPOTGUARD_S3_ENDPOINT", proxy.endpoint)
    try:
        store = open_store(f"s3://{BUCKET}/slow", local_dir=tmp_path / "node")
        data = {"w": os.urandom(12 << 20)}
        t0 = time.monotonic()
        info = save(store, "step-1", data, 1)
        local_seconds = time.monotonic() - t0
        assert store.durable_tier("step-1") == "local" and not store.wait_uploaded(0)
        assert (info.dir / "w").read_bytes() == data["w"]  # complete on local disk already
        t1 = time.monotonic()
        assert store.wait_uploaded(180)
        upload_seconds = time.monotonic() - t1
        assert store.durable_tier("step-1") == "object"
        print(f"\nlocal durable in {local_seconds:.2f}s; object store {upload_seconds:.1f}s later (1 MB/s)")
        store.close(10)
    finally:
        proxy.close()
