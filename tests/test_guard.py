"""The Guard in one process: the sidecar stream (real socket), signals, reports, config, snapshots.

The sidecar here is `tests/workers/sidecar_stub.py`: a real aiohttp server speaking the
sidecar's protocol (docs/protocols.md), so the Guard's listener reads real HTTP/SSE.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from spotguard.config import ConfigError
from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.hooks.guard import Guard
from spotguard.hooks.step_result import Happened
from spotguard.supervisor.progress import steps_lost_of
from spotguard.wire import names
from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED, describe_exit
from spotguard.wire.notice import Kind, Notice, now_utc
from tests.workers.sidecar_stub import SidecarStub


def notice(kind: str = "reclaim", seconds: float | None = 120.0, nid: str = "aws.spot:abc") -> Notice:
    now = now_utc()
    return Notice(id=nid, kind=kind, source="aws.spot", node="n1", detected_at=now,
                  deadline=None if seconds is None else now + timedelta(seconds=seconds))


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def sidecar(tmp_path):
    with SidecarStub() as stub:
        token_file = tmp_path / "token"
        token_file.write_text(stub.token + "\n")
        stub.token_file = str(token_file)
        yield stub


def make_guard(sidecar, **kwargs) -> Guard:
    kwargs.setdefault("install_signals", False)
    kwargs.setdefault("exit_on_drain", False)
    guard = Guard(sidecar_url=sidecar.url, token_file=sidecar.token_file, **kwargs)
    wait_until(guard.listener.connected.is_set)
    return guard


def test_notice_from_stream_runs_hooks_reports_and_dedupes(sidecar):
    guard = make_guard(sidecar)
    calls = []
    guard.on_reclaim(lambda step, n: calls.append(("reclaim", step, n.id)))
    guard.on_drain(lambda step, n: calls.append(("drain", step, n.id)))
    sent = notice()
    try:
        assert guard.step(0).continued
        sidecar.push("notice", sent.to_wire())
        wait_until(lambda: guard.listener.stats["notices"] == 1)
        assert guard.step(1).drained
        assert calls == [("reclaim", 1, "aws.spot:abc"), ("drain", 1, "aws.spot:abc")]
        assert guard.last_drain.exit_code == EXIT_PREEMPTED and guard.last_drain.steps_lost == 0
        phases = [(r["phase"], r["step"], r["rank"], r["world_size"]) for r in sidecar.reports]
        assert phases == [("checkpoint-durable", 1, 0, 1), ("drained", 1, 0, 1)]
        assert all(r["notice_id"] == "aws.spot:abc" and r["seconds"] >= 0 for r in sidecar.reports)
        # the same notice again (a re-sent event): deduped; a changed one: already answered
        sidecar.push("notice", sent.to_wire())
        sidecar.push("notice", notice().to_wire())
        sidecar.push("notice", {"v": 1, "withdrawn": "x"})  # a malformed one as a marker that both arrived
        wait_until(lambda: guard.listener.stats["malformed"] == 1)
        assert guard.step(2).continued
    finally:
        guard.close()


def test_malformed_messages_are_logged_and_change_nothing(sidecar, caplog):
    guard = make_guard(sidecar)
    calls = []
    guard.on_reclaim(lambda step, n: calls.append(step))
    bad = [
        ("notice", "{not json"),
        ("notice", {"v": 2, **{k: v for k, v in notice().to_wire().items() if k != "v"}}),
        ("notice", {**notice().to_wire(), "kind": "meteor"}),
        ("notice", {**notice().to_wire(), "deadline": "tomorrow"}),
        ("notice", {k: v for k, v in notice().to_wire().items() if k != "node"}),
        ("withdrawn", {"v": 1}),
        ("snapshot", {"v": 1, "notices": "none"}),
        ("snapshot", {"v": 1, "node": "n1", "notices": [{"v": 1, "id": "x"}]}),
        ("surprise", {"v": 1}),
    ]
    caplog.set_level(logging.WARNING, logger="spotguard.hooks.listener")
    try:
        for event, data in bad:
            sidecar.push(event, data)
        sidecar.push("membership", {"v": 1, "generation": 2, "hosts": ["h1"], "world_size": 1})
        wait_until(lambda: guard.listener.stats["malformed"] == len(bad))
        for step in range(3):
            assert guard.step(step).continued
        assert calls == [] and sidecar.reports == []
        messages = [r.getMessage() for r in caplog.records]
        assert sum("ignored malformed" in m for m in messages) == len(bad)
        assert any("unknown event type 'surprise'" in m for m in messages)
        assert any("kind: unknown kind 'meteor'" in m for m in messages)
        assert any("v: unsupported wire version 2" in m for m in messages)
        # the stream is still alive: a good notice afterwards works
        sidecar.push("notice", notice().to_wire())
        wait_until(lambda: guard.listener.stats["notices"] == 1)
        assert guard.step(3).drained and calls == [3]
        assert sidecar.connections == 1
    finally:
        guard.close()


def test_broken_byte_stream_reconnects_and_snapshot_redelivers(sidecar):
    guard = make_guard(sidecar)
    try:
        sidecar.push_raw(b"data: \xff\xfe\n\n")  # not UTF-8: the connection is dropped
        wait_until(lambda: sidecar.connections == 2)
        assert guard.step(0).continued
        # a notice that went live while disconnected arrives in the next snapshot
        sidecar.snapshot = [notice(nid="gcp.preempt:1").to_wire()]
        sidecar.drop_connections()
        wait_until(lambda: guard.listener.stats["notices"] == 1, timeout=10)
        assert guard.step(1).drained
        assert guard.last_drain.notice.id == "gcp.preempt:1"
    finally:
        guard.close()


def test_listener_withdraws_a_notice_only_when_a_complete_snapshot_lacks_it(sidecar):
    """The Guard's listener applies the consumers' shared snapshot rule (agent/snapshot.py)."""
    from spotguard.hooks.notice_listener import NoticeListener

    delivered, withdrawn = [], []
    listener = NoticeListener(sidecar.url, lambda n: delivered.append(n.id), withdrawn.append)
    listener.start()
    try:
        wait_until(listener.connected.is_set)
        x, y = notice(nid="aws.spot:x"), notice(nid="aws.spot:y")
        sidecar.push("notice", x.to_wire())
        wait_until(lambda: delivered == [x.id])
        # not authoritative (a producer that has not read since it restarted): x stays
        sidecar.push("snapshot", {"v": 1, "node": "n1", "notices": [y.to_wire()], "complete": False})
        wait_until(lambda: delivered == [x.id, y.id])
        assert withdrawn == []
        # authoritative, and x is not in it: x is withdrawn, y (held, unchanged) is not redelivered
        sidecar.push("snapshot", {"v": 1, "node": "n1", "notices": [y.to_wire()], "complete": True})
        wait_until(lambda: withdrawn == [x.id])
        assert delivered == [x.id, y.id]
    finally:
        listener.stop()


def test_withdrawn_before_agreement_and_rebalance_are_not_acted_on(sidecar):
    guard = make_guard(sidecar)
    try:
        sidecar.push("notice", notice(kind="rebalance", nid="aws.rebalance:1").to_wire())
        sidecar.push("notice", notice(nid="azure.preempt:1").to_wire())
        sidecar.push(
            "withdrawn", {"v": 1, "withdrawn": "azure.preempt:1", "source": "azure", "node": "n1", "reason": "canceled"}
        )
        wait_until(lambda: guard.listener.stats["notices"] == 2 and guard.gate.pending is None)
        assert guard.step(0).continued
    finally:
        guard.close()


def test_reports_need_the_token(sidecar, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    sidecar.token_file = str(wrong)
    guard = make_guard(sidecar)
    try:
        sidecar.push("notice", notice().to_wire())
        wait_until(lambda: guard.gate.pending is not None)
        assert guard.step(0).drained  # the drain does not depend on the report
        assert sidecar.reports == [] and sidecar.rejected == ["Bearer nope", "Bearer nope"]
    finally:
        guard.close()


def test_sigterm_and_extra_signal_become_drain_notices():
    before = signal.getsignal(signal.SIGTERM)
    guard = Guard(extra_signals=(signal.SIGUSR1,), grace_seconds=7, exit_on_drain=False)
    seen = []
    guard.on_reclaim(lambda step, n: seen.append(n))
    try:
        assert guard.step(0).continued
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.step(1).drained
        n = seen[0]
        assert n.kind is Kind.DRAIN and n.source == "signal" and n.detail["signal"] == "SIGUSR1"
        assert 6 < n.seconds_left() <= 7
        os.kill(os.getpid(), signal.SIGTERM)  # still trapped: the process is not terminated
        assert guard.step(2).drained and seen[1].detail["signal"] == "SIGTERM"
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGTERM) == before  # close() put the previous handler back


def test_failed_checkpoint_hook_exits_84(tmp_path):
    guard = Guard(exit_on_drain=True, install_signals=True, hard_exit=False)  # pytest must keep its own exit code

    @guard.on_reclaim
    def broken(step, n):
        raise OSError("disk full")

    drained = []
    guard.on_drain(lambda step, n: drained.append(step))
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        guard.step(5)
    assert exc.value.code == EXIT_CHECKPOINT_FAILED and drained == []
    assert describe_exit(83).startswith("preempted") and describe_exit(84).endswith("failed")
    assert "crash" in describe_exit(1)


def test_config_errors_name_the_field(monkeypatch):
    monkeypatch.setenv("SPOTGUARD_AGREE_EVERY", "0")
    with pytest.raises(ConfigError) as exc:
        Guard.from_env(install_signals=False)
    assert exc.value.field == "SPOTGUARD_AGREE_EVERY"
    monkeypatch.setenv("SPOTGUARD_AGREE_EVERY", "2")
    monkeypatch.setenv("SPOTGUARD_GRACE_SECONDS", "soon")
    with pytest.raises(ConfigError) as exc:
        Guard.from_env(install_signals=False)
    assert exc.value.field == "SPOTGUARD_GRACE_SECONDS"
    monkeypatch.setenv("SPOTGUARD_GRACE_SECONDS", "5")
    monkeypatch.setenv("SPOTGUARD_SIDECAR_URL", "ftp://x")
    with pytest.raises(ConfigError) as exc:
        Guard.from_env(install_signals=False)
    assert exc.value.field == "SPOTGUARD_SIDECAR_URL"


def tiny_job():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
    opt.step()


def test_plain_torch_resume_is_exact_and_answered_notice_is_ignored(tmp_path, sidecar):
    n = notice(nid="aws.spot:resume")
    model, opt = tiny_job()
    guard = make_guard(sidecar, adapter=PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ck",
                                                          extra_state=lambda: {"data_pos": 40}))
    try:
        assert guard.resume() == 0
        for step in range(4):
            train(model, opt, step)
            if step == 2:
                sidecar.push("notice", n.to_wire())
                wait_until(lambda: guard.gate.pending is not None)
            if guard.step(step):
                break
        assert guard.last_drain.saved_step == 2
    finally:
        guard.close()
    reference_model, reference_opt = tiny_job()
    for step in range(3):
        train(reference_model, reference_opt, step)

    sidecar.snapshot = [n.to_wire()]  # the notice is still live when the job comes back
    model2, opt2 = tiny_job()
    adapter2 = PlainTorchAdapter(model2, opt2, checkpoint_dir=tmp_path / "ck")
    guard2 = make_guard(sidecar)
    guard2.attach(adapter2)  # the other way to hand the Guard its adapter
    try:
        wait_until(lambda: guard2.listener.stats["notices"] == 1)
        assert guard2.resume() == 3 and adapter2.extra == {"data_pos": 40}
        assert guard2.step(3).continued  # the notice this checkpoint answered does not drain again
        assert all(
            torch.equal(a, b) for a, b in zip(model2.state_dict().values(), reference_model.state_dict().values()))
        assert str(opt2.state_dict()) == str(reference_opt.state_dict())
    finally:
        guard2.close()


def test_deadline_too_short_persists_last_snapshot(tmp_path, sidecar, monkeypatch):
    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv(names.ENV_TERMINATION_LOG, str(termination_log))
    model, opt = tiny_job()
    guard = make_guard(sidecar, adapter=PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ck"), snapshot_every=4,
                       save_margin_seconds=1.0)
    try:
        for step in range(7):
            train(model, opt, step)
            if step == 6:
                sidecar.push("notice", notice(seconds=0.3).to_wire())
                wait_until(lambda: guard.gate.pending is not None)
            if guard.step(step):
                break
        record = guard.last_drain
        assert (record.step, record.saved_step, record.used_snapshot, record.steps_lost) == (6, 4, True, 2)
        info = CheckpointStore(tmp_path / "ck").resolve()
        assert info.step == 4 and info.metadata["snapshot"] is True and info.metadata["reason"] == "notice"
        durable = [r for r in sidecar.reports if r["phase"] == "checkpoint-durable"]
        assert durable[0]["step"] == 4 and durable[0]["steps_lost"] == 2
        # the container's termination message tells the supervisor the same (supervisor/progress.py)
        message = termination_log.read_text()
        assert json.loads(message)["saved_step"] == 4
        assert steps_lost_of({"message": message}) == 2
    finally:
        guard.close()
    # a notice with time to spare saves fresh
    guard = make_guard(
        sidecar, adapter=PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ck2"), snapshot_every=4)
    try:
        sidecar.push("notice", notice(seconds=60, nid="aws.spot:later").to_wire())
        wait_until(lambda: guard.gate.pending is not None)
        assert guard.step(8).drained and guard.last_drain.used_snapshot is False
    finally:
        guard.close()


def test_far_deadline_is_held_until_the_horizon_and_a_withdrawal_cancels_it(sidecar):
    guard = make_guard(sidecar, horizon_seconds=2.0)
    try:
        sidecar.push("notice", notice(kind="maintenance", seconds=3.5, nid="aws.maintenance:far").to_wire())
        wait_until(lambda: guard.listener.stats["notices"] == 1)
        assert guard.step(0).continued  # 3.5 s away, horizon 2 s: held
        wait_until(lambda: guard.step(1), timeout=5.0)  # acted on once within 2 s of its deadline
        assert guard.last_drain.notice.id == "aws.maintenance:far"

        sidecar.push("notice", notice(kind="maintenance", seconds=3.0, nid="aws.maintenance:canceled").to_wire())
        wait_until(lambda: guard.listener.stats["notices"] == 2)
        sidecar.push("withdrawn", {"v": 1, "withdrawn": "aws.maintenance:canceled", "source": "aws.maintenance",
                                   "node": "n1", "reason": "canceled"})
        wait_until(lambda: "aws.maintenance:canceled" not in guard.gate.held_ids())
        time.sleep(1.2)  # past the moment it would have come within the horizon
        assert guard.step(2).continued
    finally:
        guard.close()


def test_step_tells_what_happened_and_last_resize_still_answers_with_a_warning(tmp_path):
    """`step()` returns a StepResult whose truth value is "drained" (the boolean it replaced);
    `last_resize` is deprecated but answers (None before any change)."""
    guard = Guard(install_signals=False, exit_on_drain=False, in_place=False)
    try:
        result = guard.step(0)
        assert (result.happened, bool(result), result.resize, result.drain) == (Happened.CONTINUED, False, None, None)
        guard.offer(notice())
        drained = guard.step(1)
        assert drained.drained and bool(drained) and drained.drain is guard.last_drain
        with pytest.warns(DeprecationWarning, match="guard.step"):
            assert guard.last_resize is None
        with pytest.warns(DeprecationWarning, match="result.drained"):
            assert drained == True  # noqa: E712  (the comparison users wrote against the boolean step())
        with pytest.warns(DeprecationWarning, match="result.drained"):
            assert result == False  # noqa: E712
    finally:
        guard.close()


def test_the_first_boundary_allocates_the_buffers_and_a_notice_save_reuses_them(tmp_path):
    """Without prepare(): the Guard's first step boundary allocates the snapshot buffers, sized to
    the state; the notice's save allocates nothing more. A copy taken before the first boundary
    (a save_async of step 0) already fits: the boundary keeps its held snapshot and copies nothing."""
    model, opt = tiny_job()
    adapter = PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ck")
    guard = Guard(adapter=adapter, install_signals=False, exit_on_drain=False, in_place=False)
    buffers = adapter.snapshot_engine.buffers
    try:
        train(model, opt, 0)
        assert (buffers.allocations, adapter.prepared) == (0, False)
        assert guard.step(0).continued
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert buffers.allocations == 1 and buffers.nbytes >= state_bytes and adapter.prepared
        adapter.prepare()  # public, a no-op now
        train(model, opt, 1)
        guard.offer(notice())
        assert guard.step(1).drained and guard.last_drain.ok
        assert buffers.allocations == 1
    finally:
        guard.close()
    assert not adapter.prepared  # closed: the buffers are freed

    model, opt = tiny_job()
    adapter = PlainTorchAdapter(model, opt, checkpoint_dir=tmp_path / "ck2")
    guard = Guard(adapter=adapter, install_signals=False, exit_on_drain=False, in_place=False)
    try:
        train(model, opt, 0)
        adapter.save_async(0)
        assert guard.step(0).continued
        assert (adapter.snapshot_step, adapter.snapshot_engine.buffers.allocations) == (0, 1)
    finally:
        guard.close()
