"""How a departing rank's checkpoint was made, on its way to the sidecar (issue 36, item 6):
`saved_by`, `margin_seconds` and `snapshot_steps` in the hook report (optional: an older Guard's
report still reads; a bad value is refused naming the field), kept per rank by the sidecar and
listed as `departures` in its answers; the termination message says the same, with the rank's
exit code (a launcher such as torchrun exits with its own). One drain of the agreed-step machine reports them through
a real HookReporter to a real sidecar over sockets."""
from __future__ import annotations

import asyncio
import json
import aiohttp
import pytest

from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.sidecar.prestop import HookBook
from spotguard.wire.hook_report import HookFormatError, HookReport
from spotguard.wire.notice import Notice, now_utc
from tests.sidecar_helpers import Publisher, hook, live_notice, post_hook, prestop, running_sidecar


def test_the_fields_read_and_an_older_guards_report_reads_without_them():
    report = HookReport.from_wire(hook("n", 0, phase="drained", saved_by="watchdog", margin_seconds=4.25,
                                       snapshot_steps=2, why="ignored", async_save="committed"))
    assert (report.saved_by, report.margin_seconds, report.snapshot_steps) == ("watchdog", 4.25, 2)
    late = HookReport.from_wire(hook("n", 0, saved_by="boundary", margin_seconds=-1, snapshot_steps=0))
    assert (late.saved_by, late.margin_seconds, late.snapshot_steps) == ("boundary", -1.0, 0)  # left late: said so
    old = HookReport.from_wire(hook("n", 0))
    assert (old.saved_by, old.margin_seconds, old.snapshot_steps) == (None, None, None)


@pytest.mark.parametrize("extra, message", [
    ({"saved_by": "sidecar"}, "saved_by: expected one of boundary, watchdog, nothing-new, none"),
    ({"saved_by": 1}, "saved_by"),
    ({"margin_seconds": float("inf")}, "margin_seconds: expected a finite number"),
    ({"margin_seconds": "4"}, "margin_seconds"),
    ({"margin_seconds": True}, "margin_seconds"),
    ({"snapshot_steps": -1}, "snapshot_steps: expected a whole number >= 0"),
    ({"snapshot_steps": 1.5}, "snapshot_steps"),
])
def test_a_bad_value_is_refused_naming_the_field(extra, message):
    with pytest.raises(HookFormatError, match=message):
        HookReport.from_wire(hook("n", 0, **extra))


def test_the_book_keeps_each_ranks_account_and_a_resend_without_it_keeps_it():
    book = HookBook(local_world_size=2)
    book.record(HookReport.from_wire(hook("n", 1, saved_by="watchdog", margin_seconds=4.5, snapshot_steps=2)))
    book.record(HookReport.from_wire(hook("n", 0)))  # an older Guard: says nothing
    book.record(HookReport.from_wire(hook("n", 1, phase="drained")))  # the extra-less resend after a 400
    assert book.progress("n").to_wire()["departures"] == [
        {"rank": 1, "step": 120, "saved_by": "watchdog", "margin_seconds": 4.5, "snapshot_steps": 2}]
    assert "departures" not in HookBook(1).record(HookReport.from_wire(hook("m", 0, world_size=1))).to_wire()


async def test_the_boundarys_drain_reports_how_it_saved_and_the_sidecar_lists_it(tmp_path, monkeypatch):
    import torch

    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
    from tests.helpers import drain_once

    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    model = torch.nn.Linear(4, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=str(tmp_path / "c"))
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=2) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc, deadline_in=60)
        try:
            reporter = HookReporter(sc.url, sc.config.token_file, 0, 2)
            record = await asyncio.to_thread(drain_once, adapter, notice, 7, reporter=reporter)
        finally:
            adapter.close()
        assert record.ok and record.saved_step == 7
        message = json.loads((tmp_path / "termination-log").read_text())  # the same account, and the exit code
        assert (message["saved_by"], message["snapshot_steps"], message["exit_code"]) == ("boundary", 0, 83)
        drained = next(body for body in reporter.sent if body["phase"] == "drained")
        assert drained["saved_by"] == "boundary" and drained["snapshot_steps"] == 0
        assert 0 < drained["margin_seconds"] <= 60
        # a peer's watchdog leaves the same notice, and an older Guard sends a bad margin: refused
        watchdog = hook(notice.id, 1, phase="drained", step=5, saved_by="watchdog", margin_seconds=3.9,
                        snapshot_steps=2)
        status, answer = await post_hook(http, sc, watchdog)
        assert status == 200, answer
        assert [(d["rank"], d["saved_by"], d["snapshot_steps"]) for d in answer["departures"]] == \
            [(0, "boundary", 0), (1, "watchdog", 2)]
        status, answer = await post_hook(http, sc, {**watchdog, "margin_seconds": "soon"})
        assert status == 400 and "margin_seconds" in answer["error"]
        result = await prestop(http, sc, 5)
        assert result["outcome"] == "done", result
        assert [(d["rank"], d["step"], d["saved_by"], d["margin_seconds"]) for d in result["departures"]] == \
            [(0, 7, "boundary", drained["margin_seconds"]), (1, 5, "watchdog", 3.9)]


def test_a_notice_without_a_deadline_reports_no_margin(tmp_path, monkeypatch):
    import torch

    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
    from tests.helpers import drain_once

    class Sent:
        def __init__(self):
            self.bodies: list[dict] = []

        def report(self, notice_id, step, phase, seconds, **extra):
            self.bodies.append({"phase": phase, **extra})
            return True

    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    model = torch.nn.Linear(4, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=str(tmp_path / "c"))
    notice = Notice(id="supervisor.drain:r1", kind="drain", source="supervisor.drain", node="n1", detected_at=now_utc())
    sent = Sent()
    try:
        assert drain_once(adapter, notice, 3, reporter=sent).ok
    finally:
        adapter.close()
    drained = next(b for b in sent.bodies if b["phase"] == "drained")
    assert drained["saved_by"] == "boundary" and "margin_seconds" not in drained
    HookReport.from_wire(hook("n", 0, **{k: v for k, v in drained.items() if k != "phase"}))  # reads back
