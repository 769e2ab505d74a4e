"""Azure: the emulated Scheduled Events service and its source, over real HTTP."""
from __future__ import annotations

import asyncio
from datetime import datetime, UTC

import aiohttp
import pytest

from spotguard.agent.sources.azure import (EVENTS_PATH, NAME_PATH, AzureImdsClient, RateLimiter,
                                           ScheduledEventsSource, azure_sources)
from spotguard.agent.sources.registry import build_sources
from spotguard.wire.notice import Kind, Notice, notice_id
from spotguard.wire.withdrawal import Withdrawal
from tests.source_harness import FAULTS, SourceRunner, fault_then_detect

NODE = "aks-node-1"
API = {"api-version": "2020-07-01"}
MD = {"Metadata": "true"}


def events_source(url: str, vm_name: str | None = None, interval: float = 0.25) -> ScheduledEventsSource:
    return ScheduledEventsSource(AzureImdsClient(url, timeout=0.5), NODE, interval, vm_name=vm_name)


def deadline_of(scheduled: dict) -> datetime:
    return datetime.fromtimestamp(int(scheduled["deadline"]), UTC)


# -- the emulated service --------------------------------------------------------------------

async def test_emulator_checks_headers_and_serves_the_document(make_emulator):
    emu, control = await make_emulator("azure", rate_limit=0)
    async with aiohttp.ClientSession() as http:
        async def get(path=EVENTS_PATH, headers=MD, params=API):
            async with http.get(emu.url + path, headers=headers, params=params) as resp:
                return resp.status, await resp.json(content_type=None)
        assert (await get(headers={}))[0] == 400
        assert (await get(headers={**MD, "X-Forwarded-For": "10.0.0.1"}))[0] == 400
        assert (await get(params={}))[0] == 400
        status, doc = await get()
        assert status == 200 and doc["Events"] == [] and isinstance(doc["DocumentIncarnation"], int)
        scheduled = await control.schedule("event", event_type="Reboot", lead=900)
        status, doc2 = await get()
        assert doc2["DocumentIncarnation"] == doc["DocumentIncarnation"] + 1
        [event] = doc2["Events"]
        assert event["EventType"] == "Reboot" and event["EventStatus"] == "Scheduled"
        assert event["Resources"] == [emu.handler.vm_name] and event["EventId"] == scheduled["params"]["event_id"]
        assert event["NotBefore"].endswith(" GMT")
        assert (await get())[1]["DocumentIncarnation"] == doc2["DocumentIncarnation"]  # unchanged: same n
        async with http.get(emu.url + NAME_PATH, headers=MD,
                            params={"api-version": "2021-02-01", "format": "text"}) as resp:
            assert (resp.status, await resp.text()) == (200, emu.handler.vm_name)


async def test_emulator_throttles_beyond_five_per_second(make_emulator):
    emu, _control = await make_emulator("azure")
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(8):
            async with http.get(emu.url + EVENTS_PATH, headers=MD, params=API) as resp:
                statuses.append(resp.status)
    assert statuses[:5] == [200] * 5 and 429 in statuses[5:]
    assert emu.handler.throttled == statuses.count(429)


# -- the source ------------------------------------------------------------------------------

async def test_preempt_detected_with_notbefore_deadline_and_event_id(make_emulator):
    emu, control = await make_emulator("azure")
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        scheduled = await control.schedule("event", event_type="Preempt", lead=30)
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
    event_id = scheduled["params"]["event_id"]
    assert notice.kind is Kind.RECLAIM and notice.source == "azure.events"
    assert notice.deadline == deadline_of(scheduled)
    assert notice.id == notice_id("azure.events", NODE, emu.handler.instance_id, event_id)
    assert notice.detail["EventId"] == event_id and notice.detail["EventStatus"] == "Scheduled"
    assert source.vm_name == emu.handler.vm_name and source.incarnation is not None


async def test_event_types_map_to_kinds(make_emulator):
    emu, control = await make_emulator("azure")
    expected = {"Preempt": Kind.RECLAIM, "Terminate": Kind.RECLAIM, "Reboot": Kind.MAINTENANCE,
                "Redeploy": Kind.MAINTENANCE, "Freeze": Kind.MAINTENANCE}
    for event_type in expected:
        await control.schedule("event", event_type=event_type, lead=600)
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: len(run.notices) == 5)
    assert {n.detail["EventType"]: n.kind for n in run.notices} == expected


async def test_other_vms_events_ignored(make_emulator):
    emu, control = await make_emulator("azure")
    await control.schedule("event", event_type="Preempt", resources=["vmss_vm_7", "vmss_vm_9"])
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 3)
        assert run.updates == []
        mine = await control.schedule("event", event_type="Preempt", resources=["vmss_vm_7", emu.handler.vm_name])
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
        await run.wait_until(lambda: source.stats.successes >= 6)
    assert notice.detail["EventId"] == mine["params"]["event_id"] and len(run.notices) == 1
    assert notice.detail["Resources"] == [emu.handler.vm_name]


async def test_vm_name_override_sees_that_vms_events(make_emulator):
    emu, control = await make_emulator("azure")
    await control.schedule("event", event_type="Redeploy", resources=["other-vm"])
    source = events_source(emu.url, vm_name="other-vm")
    async with SourceRunner(source) as run:
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
    assert notice.kind is Kind.MAINTENANCE
    assert (await control.request_counts())["by_path"].get(NAME_PATH) is None


async def test_vm_name_read_is_retried(make_emulator):
    emu, control = await make_emulator("azure")
    await control.fault("status", path=NAME_PATH, status=503, count=2)
    await control.schedule("event", event_type="Preempt")
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_for(lambda u: isinstance(u, Notice))
    assert source.stats.errors["vm_name"] == 2


async def test_id_stable_across_restarts_and_withdrawn_when_removed(make_emulator):
    emu, control = await make_emulator("azure")
    scheduled = await control.schedule("event", event_type="Terminate", lead=600)
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        first = await run.wait_for(lambda u: isinstance(u, Notice))
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        again = await run.wait_for(lambda u: isinstance(u, Notice))
        assert again.id == first.id and again.deadline == first.deadline
        await control.cancel(scheduled["id"])
        gone = await run.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == first.id


async def test_started_event_deadline_is_first_sight_and_stable(make_emulator):
    emu, control = await make_emulator("azure")
    await control.schedule("event", event_type="Freeze", status="Started")
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
        await run.wait_until(lambda: source.stats.successes >= 4)
    assert notice.detail["EventStatus"] == "Started" and notice.detail["NotBefore"] == ""
    assert abs((notice.deadline - notice.detected_at).total_seconds()) < 1
    assert run.updates == [notice]  # later reads do not move the deadline


async def test_approve_starts_the_event_then_it_goes(make_emulator):
    emu, control = await make_emulator("azure", started_seconds=0.5)
    scheduled = await control.schedule("event", event_type="Preempt", lead=300)
    source = events_source(emu.url)
    async with SourceRunner(source) as run:
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
        await source.approve(notice.id)  # the notice id maps back to the EventId
        assert emu.handler.approvals == [scheduled["params"]["event_id"]]
        started = await run.wait_for(lambda u: isinstance(u, Notice) and u.detail["EventStatus"] == "Started")
        assert started.id == notice.id and started.deadline < notice.deadline
        gone = await run.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == notice.id


async def test_approvals_and_polls_share_the_rate_limit(make_emulator):
    emu, control = await make_emulator("azure", started_seconds=60)
    event_ids = [(await control.schedule("event", event_type="Preempt", lead=300))["params"]["event_id"]
                 for _ in range(10)]
    source = events_source(emu.url)
    limiter = source.client.limiter
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: len(run.notices) == 10)
        await asyncio.wait_for(asyncio.gather(*(source.approve(e) for e in event_ids)), 20)
    assert sorted(emu.handler.approvals) == sorted(event_ids)
    sent = list(limiter.sent)
    assert len(sent) >= 12  # the name, at least one poll, ten approvals
    assert all(later - earlier >= 1.0 for earlier, later in zip(sent, sent[5:])), "more than 5 requests in 1 s"
    assert emu.handler.throttled <= 1  # the emulator's own view agrees (one allowed for scheduling jitter)


async def test_rate_limiter_alone():
    limiter = RateLimiter(rate=3, per=0.3, margin=0.0)
    await asyncio.wait_for(asyncio.gather(*(limiter.acquire() for _ in range(7))), 5)
    sent = list(limiter.sent)
    assert all(b - a >= 0.3 for a, b in zip(sent, sent[3:]))
    assert sent[2] - sent[0] < 0.3  # a burst up to the rate goes through at once


async def test_registry_and_interval_floor(make_emulator):
    emu, _control = await make_emulator("azure")
    [built] = build_sources("azure", node=NODE, base_url=emu.url, interval=0.0, timeout=0.5)
    assert built.name == "azure.events" and built.interval >= 0.2
    assert azure_sources(NODE)[0].interval == 1.0
    await built.close()


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_fault_counted_then_later_notice_detected(make_emulator, fault):
    emu, control = await make_emulator("azure")
    source = events_source(emu.url)
    scheduled = {}

    async def schedule():
        scheduled.update(await control.schedule("event", event_type="Preempt"))

    async with SourceRunner(source) as run:
        notice = await fault_then_detect(run, control, fault, EVENTS_PATH, schedule,
                                         lambda n: n.kind is Kind.RECLAIM)
    assert notice.detail["EventId"] == scheduled["params"]["event_id"]
    assert notice.deadline == deadline_of(scheduled)
