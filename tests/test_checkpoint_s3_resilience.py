"""The object-store tier against a real S3-compatible server (tests/s3_server.py) behind a proxy the
test controls: an outage during a notice (the upload retried within the grace), a slow link with
many saves (the local tier within its bound), an object missing from a committed checkpoint (the
resume falls back), an upload that fails for good (`async_error`, the metrics).

One server for the session; each test its own prefix and proxy; small tensors, short backoffs.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
from spotguard.hooks.checkpoint import open_store
from spotguard.hooks.checkpoint.manifest import MANIFEST
from spotguard.hooks.checkpoint.objectstore.client import make_client
from spotguard.hooks.checkpoint.objectstore.uploader import RetryPolicy
from spotguard.hooks.checkpoint.objectstore.url import ObjectStoreURL
from spotguard.wire.notice import Notice, now_utc
from tests.s3_server import BUCKET, SlowProxy
from tests.test_checkpoint_s3 import _Reports

FAST_RETRY = RetryPolicy(seconds=60, base=0.05, cap=0.3)


@pytest.fixture
def proxy(s3_server):
    link = SlowProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), bytes_per_second=1 << 30)
    try:
        yield link
    finally:
        link.accept()
        link.resume()
        link.close()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


def failed_tries(store) -> float:
    failures = store.uploader.metrics.failures
    return failures.value(kind="part") + failures.value(kind="commit")


def test_an_outage_shorter_than_the_grace_during_a_notice_is_retried_and_durable_before_the_deadline(
        s3_env, proxy, tmp_path, monkeypatch):
    from tests.helpers import drain_once

    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(termination_log))
    store = open_store(s3_env, local_dir=tmp_path / "node", client=make_client(proxy.endpoint, max_attempts=1),
                       retry=FAST_RETRY)
    model = torch.nn.Linear(4, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), store=store)
    try:
        adapter.save(3)
        assert store.wait_uploaded(30) and store.object_step == 3
        proxy.refuse()  # the outage starts before the notice's save
        now = now_utc()
        notice = Notice(id="aws.spot:outage", kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                        deadline=now + timedelta(seconds=8))
        before = failed_tries(store)

        def server_back_after_a_failed_try() -> None:
            wait_for(lambda: failed_tries(store) > before, 20, "a failed upload try during the outage")
            proxy.accept()

        ends = threading.Thread(target=server_back_after_a_failed_try, daemon=True)
        ends.start()
        reports = _Reports()
        record = drain_once(adapter, notice, 7, reporter=reports, save_margin_seconds=1.0)
        ends.join(20)
        assert notice.seconds_left() > 0, "the drain must end before the deadline"
        assert failed_tries(store) > before, "the outage must have failed a try"
        assert record.ok and record.saved_step == 7
        drained = reports.sent[-1]
        assert drained["phase"] == "drained" and drained["durable_tier"] == "object", reports.sent
        assert drained["steps_lost"] == 0
        message = json.loads(termination_log.read_text())
        assert message["durable_tier"] == "object" and message["steps_lost"] == 0, message
        assert store.is_durable(7) and not store.is_durable(5) and store.durable_step() == 7
    finally:
        proxy.accept()
        adapter.close()
        store.close(30)


def local_bytes(root: Path) -> int:
    """Bytes on local disk under `root`, each file counted once however many hard links it has (a
    file the store removes meanwhile, retention's trash, no longer counts)."""
    seen: dict[tuple[int, int], int] = {}
    for folder, _, names in os.walk(root):  # os.walk skips a folder removed under it
        for name in names:
            try:
                st = os.stat(os.path.join(folder, name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_a_slow_link_and_many_saves_keep_the_local_tier_within_its_bound(s3_env, s3_server, tmp_path, caplog):
    slow = SlowProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), bytes_per_second=2 << 20)
    size, saves, keep = 1 << 20, 12, 2
    store = open_store(s3_env, keep_last=keep, local_dir=tmp_path / "node", endpoint_url=slow.endpoint)
    try:
        peak_parts, peak_bytes = 0, 0
        with caplog.at_level(logging.WARNING, "spotguard.hooks.checkpoint.objectstore.uploader"):
            for step in range(1, saves + 1):
                pending = store.begin(f"step-{step}")
                pending.write_bytes("w", os.urandom(size))
                pending.finish_rank(0)
                store.commit(f"step-{step}", world_size=1, metadata={"step": step, "reason": "periodic"})
                peak_parts = max(peak_parts, store.uploader.queued_parts(), len(list(store.staging.glob("step-*"))))
                peak_bytes = max(peak_bytes, local_bytes(store.base))
        # the bound: at most `keep_last` parts queued; on disk the `keep_last` checkpoints and those parts
        assert peak_parts <= keep, peak_parts
        assert peak_bytes <= (2 * keep + 1) * size, f"{peak_bytes / size:.1f} checkpoints on local disk"
        dropped = store.uploader.metrics.dropped.value()
        assert dropped > 0 and "dropped the queued upload" in caplog.text
        assert "spotguard_checkpoint_uploads_dropped_total" in store.metrics.render()
        assert store.wait_uploaded(60)
        assert store.durable_tier(f"step-{saves}") == "object", "the newest checkpoint is never dropped"
        committed = [info.step for info in store.list()]
        assert committed[-1] == saves and len(committed) <= saves - dropped, committed
        assert not list(store.staging.glob("step-*")), "staging is empty once the uploads ended"
    finally:
        store.close(30)
        slow.close()


def test_an_object_missing_from_the_newest_checkpoint_falls_back_with_a_warning(s3_env, s3_server, tmp_path,
                                                                                caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    writer = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               store=open_store(s3_env, local_dir=tmp_path / "writer"))
    writer.save(1)
    saved_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    writer.save(2)
    assert writer.store.wait_uploaded(30)
    newest = writer.store.latest()
    assert newest is not None and newest.step == 2
    url = ObjectStoreURL.parse(s3_env)
    name, entry = sorted(newest.files.items())[0]
    s3_server.client().delete_object(Bucket=BUCKET, Key=url.key(newest.tag, entry.get("object") or name))
    assert url.key(newest.tag, MANIFEST)  # the manifest stays: the checkpoint still lists as complete

    fresh = torch.nn.Linear(4, 4)
    reader = PlainTorchAdapter(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1),
                               store=open_store(s3_env, local_dir=tmp_path / "reader"))
    with caplog.at_level(logging.WARNING):
        start = reader.resume()
    assert start == 2, "resumed from the intact checkpoint of step 1"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved_at_1.items())
    assert f"checkpoint {newest.tag} failed verification" in caplog.text and "missing" in caplog.text
    writer.store.close(10)
    reader.store.close(10)


def test_an_upload_that_fails_for_good_sets_async_error_and_counts_in_the_metrics(s3_env, proxy, tmp_path):
    store = open_store(s3_env, local_dir=tmp_path / "node", client=make_client(proxy.endpoint, max_attempts=1),
                       retry=RetryPolicy(seconds=0.5, base=0.05, cap=0.1))
    model = torch.nn.Linear(4, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), store=store)
    try:
        proxy.refuse()
        adapter.save_async(1)
        adapter.wait()  # durable on local disk: the background save itself succeeded
        wait_for(lambda: adapter.async_error is not None, 30, "the upload failure in async_error")
        assert store.wait_uploaded(30) and store.durable_tier("step-000000001-periodic") == "local"
        assert failed_tries(store) >= 2, "retried before giving up"
        assert 'spotguard_checkpoint_upload_failures_total{kind="part"}' in store.metrics.render()
    finally:
        proxy.accept()
        adapter.close()
        store.close(30)
