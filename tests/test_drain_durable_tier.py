"""The drain's `durable_tier` on its way to the supervisor: the Guard's hook report, the sidecar's
report to its agent, and the steps the supervisor counts as lost (only an object-store commit
survives the node). Unit level, plus one run over real sockets (Guard's reporter -> sidecar ->
an agent-like server)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.sidecar.prestop import HookBook
from spotguard.hooks.sidecar.reporter import ReportPlanner
from spotguard.hooks.termination_message import write_termination_message
from spotguard.supervisor.progress import steps_lost_of
from spotguard.wire.agent_report import Report, ReportFormatError, parse_report
from spotguard.wire.hook_report import HookFormatError, HookReport
from tests.sidecar_helpers import Publisher, eventually, hook, live_notice, post_hook, running_sidecar


def test_hook_report_reads_the_tier_and_an_older_guards_report_without_it():
    assert HookReport.from_wire(hook("n", 0, durable_tier="object")).durable_tier == "object"
    old = HookReport.from_wire(hook("n", 0))
    assert old.durable_tier is None and old.steps_lost == 0
    with pytest.raises(HookFormatError, match="durable_tier: expected one of local, disk, object"):
        HookReport.from_wire(hook("n", 0, durable_tier="cloud"))


def test_agent_report_carries_the_tier_only_when_known():
    body = Report("n", "p", "ns", "checkpointed", step=3, durable_tier="local").to_wire()
    assert parse_report(body).durable_tier == "local"
    older = Report("n", "p", "ns", "checkpointed", step=3).to_wire()
    assert "durable_tier" not in older and parse_report(older).durable_tier is None
    with pytest.raises(ReportFormatError, match="durable_tier"):
        parse_report({**body, "durable_tier": 7})


def test_the_pods_tier_is_its_weakest_ranks_and_a_report_without_one_keeps_it():
    book = HookBook(local_world_size=2)
    book.record(HookReport.from_wire(hook("n", 0, durable_tier="object")))
    assert book.progress("n").durable_tier == "object"
    book.record(HookReport.from_wire(hook("n", 1, durable_tier="local")))
    assert book.progress("n").durable_tier == "local"
    book.record(HookReport.from_wire(hook("n", 1, phase="drained")))  # an extra-less resend keeps the tier
    assert book.progress("n").durable_tier == "local"
    book.record(HookReport.from_wire(hook("n", 1, phase="drained", durable_tier="object")))
    progress = book.progress("n")
    assert progress.durable_tier == "object" and progress.to_wire()["durable_tier"] == "object"
    assert "durable_tier" not in HookBook(1).record(HookReport.from_wire(hook("m", 0, world_size=1))).to_wire()


def test_the_planner_sends_the_tier_and_nothing_new_without_one():
    book = HookBook(local_world_size=1)
    planner = ReportPlanner("p", "ns")
    body = planner.plan(book.record(HookReport.from_wire(hook("n", 0, world_size=1, durable_tier="local"))))
    assert body is not None and body["durable_tier"] == "local"
    plain = ReportPlanner("p", "ns").plan(HookBook(1).record(HookReport.from_wire(hook("m", 0, world_size=1))))
    assert plain is not None and "durable_tier" not in plain


def _message(tmp_path, **kw) -> dict:
    path = tmp_path / "termination-log"
    assert write_termination_message("n", 10, 8, True, str(path), **kw)
    return {"message": path.read_text()}


@pytest.mark.parametrize("kw, lost", [
    ({}, 2),                                                            # a disk store / older Guard: as reported
    ({"durable_tier": "object"}, 2),                                    # in the object store: survives
    ({"durable_tier": "local", "steps_lost": 6, "object_step": 4}, 6),  # the Guard counted it already
    ({"durable_tier": "local", "object_step": 4}, 6),                   # local only: lost back to the object step
    ({"durable_tier": "local"}, 10),                                    # nothing known in the object store
])
def test_the_supervisor_counts_a_local_only_checkpoint_as_lost(tmp_path, kw, lost):
    assert steps_lost_of(_message(tmp_path, **kw)) == lost


def test_a_local_tier_with_a_bogus_object_step_counts_no_less_than_reported(tmp_path):
    term = _message(tmp_path, durable_tier="local", steps_lost=1, object_step=99)
    assert json.loads(term["message"])["object_step"] == 99
    assert steps_lost_of(term) == 1


async def test_the_tier_travels_from_the_guards_reporter_through_the_sidecar_to_the_agent(tmp_path):
    async with Publisher() as pub:
        token_file = tmp_path / "agent-token"
        token_file.write_text(pub.report_token)
        async with running_sidecar(tmp_path, pub.url, agent_token_file=str(token_file), local_world_size=2) as sc, \
                aiohttp.ClientSession() as http:
            notice = await live_notice(pub, sc)
            ranks = [HookReporter(sc.url, sc.config.token_file, rank, 2) for rank in (0, 1)]
            for reporter in ranks:  # the drain's first report: durable on local disk
                assert await asyncio.to_thread(reporter.report, notice.id, 120, "checkpoint-durable", 0.5,
                                               steps_lost=0, saved_step=120, durable_tier="local")
            await eventually(lambda: len(pub.reports) == 1, timeout=10, what="checkpointed report")
            assert pub.reports[0]["durable_tier"] == "local"
            # rank 0's upload got there, rank 1's did not: the pod's checkpoint is lost with the node
            assert await asyncio.to_thread(ranks[0].report, notice.id, 120, "drained", 0.1, durable_tier="object")
            assert await asyncio.to_thread(ranks[1].report, notice.id, 120, "drained", 0.1, steps_lost=120,
                                           durable_tier="local", object_step=0)
            await eventually(lambda: len(pub.reports) == 2, timeout=10, what="drained report")
            assert pub.reports[1]["durable_tier"] == "local" and pub.reports[1]["steps_lost"] == 120
            # an older Guard (no tier) is still accepted; a bad tier names the field
            status, _ = await post_hook(http, sc, hook(notice.id, 0, phase="drained"))
            assert status == 200
            status, answer = await post_hook(http, sc, hook(notice.id, 0, durable_tier="nvme"))
            assert status == 400 and "durable_tier" in answer["error"]
