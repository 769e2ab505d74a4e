"""The object-store checkpoint store against a real S3-compatible server (SeaweedFS, tests/s3_server.py).

Complete or invisible without rename (manifest last), the local first tier and the background
upload, retention, the cleanup of a crashed writer's leftovers, and what stops a job at start:
an unreachable endpoint, refused credentials, a missing bucket.
"""
from __future__ import annotations

import os
import time

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.checkpoint import TieredStore, open_store
from spotguard.hooks.checkpoint.objectstore.remote import RemoteCheckpoints
from spotguard.hooks.checkpoint.objectstore.store import ObjectCheckpointStore
from spotguard.hooks.checkpoint.objectstore.url import ObjectStoreURL
from tests.s3_server import BUCKET


def save(store, tag: str, files: dict[str, bytes], step: int, reason: str = "periodic", rank: int = 0):
    pending = store.begin(tag)
    for name, data in files.items():
        pending.write_bytes(name, data)
    pending.finish_rank(rank)
    return store.commit(tag, world_size=1, metadata={"step": step, "reason": reason})


def keys(server, url: str) -> list[str]:
    parsed = ObjectStoreURL.parse(url)
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=parsed.root_key)
    return sorted(o["Key"][len(parsed.root_key):] for page in pages for o in page.get("Contents", []))


def test_commit_is_local_first_then_in_the_object_store_and_loads_on_another_node(s3_env, s3_server, tmp_path):
    store = open_store(s3_env, local_dir=tmp_path / "node-a")
    assert isinstance(store, ObjectCheckpointStore) and isinstance(store, TieredStore)
    data = {"w0": os.urandom(1000), "sub/w1": os.urandom(300_000)}
    info = save(store, "step-1", data, 1)
    assert info.tag == "step-1" and store.durable_tier("step-1") in ("local", "object")
    assert (store.root / "step-1" / "w0").read_bytes() == data["w0"]  # durable on local disk at return
    assert store.wait_uploaded(60)
    assert store.durable_tier("step-1") == "object"
    assert "step-1/spotguard-manifest.json" in keys(s3_server, s3_env) and "latest" in keys(s3_server, s3_env)
    other = open_store(s3_env, local_dir=tmp_path / "node-b")  # a new node: nothing local
    resolved = other.resolve(verify=True)
    assert resolved is not None and resolved.tag == "step-1" and resolved.step == 1
    assert {name: (resolved.dir / name).read_bytes() for name in data} == data
    store.close(10)
    other.close(10)


def test_retention_keeps_the_newest_and_notice_checkpoints(s3_env, tmp_path):
    store = open_store(s3_env, keep_last=2, local_dir=tmp_path / "local", max_queued_uploads=5)  # none dropped
    for step in range(1, 6):
        save(store, f"step-{step}", {"w": os.urandom(100)}, step, reason="notice" if step == 2 else "periodic")
    assert store.wait_uploaded(60)
    assert [i.tag for i in store.list()] == ["step-2", "step-4", "step-5"]
    assert store.latest().tag == "step-5"
    store.close(10)


def test_a_crashed_writers_upload_is_invisible_and_cleaned_once_its_lease_ran_out(s3_env, s3_server, tmp_path):
    store = open_store(s3_env, local_dir=tmp_path / "local")
    save(store, "step-1", {"w": b"complete"}, 1)
    assert store.wait_uploaded(60)
    remote: RemoteCheckpoints = store.remote
    # what a writer killed mid-upload leaves: files and a part without a manifest, an open multipart upload
    remote.put_lease("dead-writer", ["step-2"])
    remote.begin_part("step-2", 0)
    (tmp_path / "f").write_bytes(b"x" * 1000)
    remote.upload_files("step-2", {"w": tmp_path / "f"})
    remote.put_part("step-2", 0, b'{"files": {"w": {"size": 1000, "crc32": "00000000"}}}')
    client = s3_server.client()
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=remote.key("step-2", "big"))
    client.upload_part(Bucket=BUCKET, Key=remote.key("step-2", "big"), UploadId=upload["UploadId"], PartNumber=1,
                       Body=b"y" * (5 << 20))
    assert [i.tag for i in store.list()] == ["step-1"]  # listing never sees a partial one
    assert store.resolve().tag == "step-1"
    reopened = open_store(s3_env, local_dir=tmp_path / "local", lease_seconds=600)
    assert any(k.startswith("step-2/") for k in keys(s3_server, s3_env)), "a live lease must protect its tag"
    deadline = time.monotonic() + 30
    while any(k.startswith("step-2/") for k in keys(s3_server, s3_env)):
        assert time.monotonic() < deadline, keys(s3_server, s3_env)
        time.sleep(0.2)
        reopened = open_store(s3_env, local_dir=tmp_path / "local", lease_seconds=1)
    prefix = ObjectStoreURL.parse(s3_env).root_key
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
    assert [i.tag for i in reopened.list()] == ["step-1"]
    store.close(10)


def test_a_recommit_hides_the_old_copy_until_the_new_one_is_complete(s3_env, tmp_path):
    store = open_store(s3_env, local_dir=tmp_path / "local")
    save(store, "rolling", {"w": b"old"}, 1)
    assert store.wait_uploaded(60)
    save(store, "rolling", {"w": b"new!"}, 2)
    assert store.wait_uploaded(60)
    info = open_store(s3_env, local_dir=tmp_path / "other").resolve()
    assert info.step == 2 and (info.dir / "w").read_bytes() == b"new!"
    store.close(10)


@pytest.mark.parametrize("fault", ["unreachable", "credentials", "bucket", "read-only-url"])
def test_bad_object_store_settings_stop_the_job_at_start_naming_url_and_cause(fault, s3_env, monkeypatch, tmp_path):
    url = s3_env
    if fault == "unreachable":
        monkeypatch.setenv("SPOTGUARD_S3_ENDPOINT", "http://127.0.0.1:9")
        expected = "endpoint unreachable"
    elif fault == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expected = "credentials refused"
    elif fault == "bucket":
        url = "s3://no-such-bucket/job"
        expected = "the bucket does not exist"
    else:
        url = "s3://Bad_Bucket/job"
        expected = "bucket name"
    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as caught:
        PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=url,
                          keep_last=2)
    assert caught.value.field == "checkpoint_dir"
    assert url in str(caught.value) and expected in str(caught.value), str(caught.value)


class _Reports:
    """The drain's hook reports, as the sidecar would receive them."""

    def __init__(self):
        self.sent: list[dict] = []

    def report(self, notice_id: str, step: int, phase: str, seconds: float, **extra) -> bool:
        self.sent.append({"phase": phase, "step": step, **extra})
        return True


def test_an_upload_stuck_past_the_deadline_drains_with_the_local_tier_and_counts_its_steps_lost(
        s3_env, s3_server, monkeypatch, tmp_path):
    """The server stops answering (a paused proxy, released by the test) before the notice's save:
    the drain waits for the upload until the deadline less its margin, then exits 83 reporting tier
    `local`, and the steps since the last object-store commit count as lost."""
    import json
    from datetime import timedelta

    import torch

    from spotguard.hooks.adapters.base import tag_for
    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
    from spotguard.supervisor.progress import steps_lost_of
    from spotguard.wire.names import EXIT_PREEMPTED
    from spotguard.wire.notice import Notice, now_utc
    from tests.helpers import drain_once
    from tests.s3_server import SlowProxy

    proxy = SlowProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), bytes_per_second=1 << 30)
    monkeypatch.setenv("SPOTGUARD_S3_ENDPOINT", proxy.endpoint)
    monkeypatch.setenv("SPOTGUARD_LOCAL_CHECKPOINT_DIR", str(tmp_path / "node"))
    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(termination_log))
    model = torch.nn.Linear(4, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=s3_env)
    try:
        adapter.save(3)
        assert adapter.store.wait_uploaded(60) and adapter.store.object_step == 3
        proxy.pause()
        now = now_utc()
        notice = Notice(id="aws.spot:stuck", kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                        deadline=now + timedelta(seconds=2.5))
        reports = _Reports()
        record = drain_once(adapter, notice, 7, reporter=reports, save_margin_seconds=1.0)
        assert notice.seconds_left() > 0, "the drain must end before the deadline"
        assert record.ok and record.exit_code == EXIT_PREEMPTED and record.saved_step == 7
        durable, drained = reports.sent
        assert durable["phase"] == "checkpoint-durable" and durable["durable_tier"] == "local"
        assert drained["phase"] == "drained" and drained["durable_tier"] == "local"
        assert drained["steps_lost"] == 4 and drained["object_step"] == 3
        message = json.loads(termination_log.read_text())
        assert message["durable_tier"] == "local" and message["checkpoint"] == "durable"
        assert steps_lost_of({"message": termination_log.read_text()}) == 4
        tag = tag_for(7, "notice")
        assert adapter.store.local.latest().tag == tag and adapter.store.durable_tier(tag) == "local"
        proxy.resume()  # the server answers again: the upload completes after all
        assert adapter.store.wait_uploaded(60) and adapter.store.durable_tier(tag) == "object"
    finally:
        proxy.resume()
        adapter.close()
        adapter.store.close(30)
        proxy.close()


def test_a_recommit_never_mixes_a_slow_ranks_parts_of_the_first_attempt_into_the_second(s3_env, s3_server, tmp_path):
    """Two nodes re-commit one tag; rank 1's upload of the second attempt is held (paused proxy)
    while rank 0 commits: rank 1's part of the first attempt is still in the bucket, and the commit
    must wait for the second one instead of taking it."""
    from tests.s3_server import SlowProxy

    proxy = SlowProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), bytes_per_second=1 << 30)
    node0 = open_store(s3_env, local_dir=tmp_path / "node0")
    node1 = open_store(s3_env, local_dir=tmp_path / "node1", endpoint_url=proxy.endpoint)
    first = {0: {"w0": b"first-0"}, 1: {"w1": b"first-1"}}
    second = {0: {"w0": b"second-0!"}, 1: {"w1": b"second-1!"}}

    def write(store, rank: int, files: dict[str, bytes], attempt: str) -> None:
        pending = store.begin("rolling", attempt=attempt)
        for name, data in files.items():
            pending.write_bytes(name, data)
        pending.finish_rank(rank)

    try:
        for rank, store in ((1, node1), (0, node0)):
            write(store, rank, first[rank], attempt="a1")
        node0.commit("rolling", world_size=2, metadata={"step": 1})
        assert node1.wait_uploaded(60) and node0.wait_uploaded(60)
        proxy.pause()  # rank 1's second attempt stays on its node for now
        for rank, store in ((1, node1), (0, node0)):
            write(store, rank, second[rank], attempt="a2")
        node0.commit("rolling", world_size=2, metadata={"step": 1})
        assert not node0.wait_uploaded(0.5), "the commit must wait for rank 1's part of this attempt"
        assert "rolling" not in [i.tag for i in node0.list()]
        proxy.resume()
        assert node1.wait_uploaded(60) and node0.wait_uploaded(60)
        assert node0.durable_tier("rolling") == "object"
        info = node0.resolve(verify=True)  # downloaded from the object store, checksums verified
        assert info is not None and info.tag == "rolling"
        assert {n: (info.dir / n).read_bytes() for n in ("w0", "w1")} == {**second[0], **second[1]}
        objects = {entry["object"] for entry in node0.read("rolling").files.values()}
        assert len(objects) == 2 and all(o.startswith(".u-") for o in objects)
        assert [k for k in keys(s3_server, s3_env) if k.startswith("rolling/")] == sorted(
            ["rolling/.spotguard-part-0.json", "rolling/.spotguard-part-1.json", "rolling/spotguard-manifest.json",
             *(f"rolling/{o}" for o in objects)]), "the first attempt's objects are deleted"
    finally:
        proxy.resume()
        node0.close(30)
        node1.close(30)
        proxy.close()
