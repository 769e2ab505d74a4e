"""A notice's identity includes the instance: every cloud source over real HTTP to the emulator.

The emulated VM is re-created under the same name (`replace_instance`: a new instance id, the
metadata otherwise unchanged, so the same event is served byte for byte, as a managed instance
group's new VM serves `preempted` TRUE with the same ETag): the same event on the new instance
has a new id; on the same instance it keeps its id across polls and restarted sources. An
instance id that cannot be read never costs a notice: it goes out under the fallback id, and
keeps that id while it is live.
"""
from __future__ import annotations

import asyncio

import pytest

from spotguard.wire.notice import Kind
from spotguard.wire.withdrawal import Withdrawal
from tests.cloud_sources import CLOUDS, NODE, is_notice, read_once
from tests.source_harness import SourceRunner

# fault -> (fault fields, the reasons the source may count for the unreadable id)
INSTANCE_FAULTS = {
    "missing": ({"kind": "status", "status": 404}, {"instance_id:http_404"}),
    "error": ({"kind": "status", "status": 503}, {"instance_id:http_5xx"}),
    "garbage": ({"kind": "malformed"}, {"instance_id:malformed"}),
    "hang": ({"kind": "hang", "seconds": 30.0}, {"instance_id:timeout"}),
    "dropped": ({"kind": "drop"}, {"instance_id:connect", "instance_id:malformed"}),
}


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
async def test_the_same_event_on_a_new_instance_is_a_new_notice(make_emulator, cloud):
    emu, control = await make_emulator(cloud, **CLOUDS[cloud].options)
    await control.schedule("reclaim", lead=300)
    first = await read_once(CLOUDS[cloud], emu.url)
    assert (await read_once(CLOUDS[cloud], emu.url)).id == first.id  # a restarted agent: the same id
    await control.replace_instance()  # the VM re-created under its name, showing the very same answer
    recreated = await read_once(CLOUDS[cloud], emu.url)
    assert recreated.id != first.id
    assert (recreated.detail, recreated.node) == (first.detail, first.node)  # the same event, byte for byte
    assert (await read_once(CLOUDS[cloud], emu.url)).id == recreated.id


@pytest.mark.parametrize("cloud, fault", [(c, "missing") for c in sorted(CLOUDS)]
                         + [("gcp", f) for f in sorted(INSTANCE_FAULTS) if f != "missing"]
                         + [("aws", "garbage"), ("aws", "hang"), ("azure", "error"), ("alibaba", "garbage")])
async def test_an_unreadable_instance_id_never_costs_the_notice(make_emulator, cloud, fault):
    emu, control = await make_emulator(cloud, **CLOUDS[cloud].options)
    fields, reasons = INSTANCE_FAULTS[fault]
    await control.fault(path=CLOUDS[cloud].instance_path, count=0, **fields)  # until cleared
    source = CLOUDS[cloud].source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 1, what="a first clean read")
        await control.schedule("reclaim", lead=300)
        fallback = await run.wait_for(is_notice, timeout=10)
        assert set(source.stats.errors) and set(source.stats.errors) <= reasons, source.stats.errors

        await control.clear_faults()
        await run.wait_until(lambda: source.instance.identity.value == emu.handler.instance_id, timeout=30,
                             what="the instance id read once the fault cleared")
        polls = source.stats.polls
        await run.wait_until(lambda: source.stats.polls >= polls + 2, timeout=10, what="two more polls")
        assert run.updates == [fallback]  # still live, under the id it went out with

        served = await read_once(CLOUDS[cloud], emu.url)  # what an agent started now publishes
        assert served.id != fallback.id and served.detail == fallback.detail

        for scheduled in await control.notices():
            await control.cancel(scheduled["id"])
        await run.wait_for(lambda u: isinstance(u, Withdrawal) and u.notice_id == fallback.id, timeout=10)
        mark = len(run.updates)
        await control.schedule("reclaim", lead=300)
        later = await run.wait_for(is_notice, timeout=10, start=mark)
    assert later.id == (await read_once(CLOUDS[cloud], emu.url)).id  # the next notice has the instance's id


async def test_an_agent_restarted_during_an_outage_gives_the_notice_its_old_id(make_emulator):
    """The whole metadata service fails while the agent restarts; once it answers again, the
    restarted agent reads the instance id before it publishes: the live notice keeps its id."""
    emu, control = await make_emulator("gcp")
    await control.schedule("reclaim", lead=300)
    before = await read_once(CLOUDS["gcp"], emu.url)
    await control.fault(kind="status", status=503, count=0)
    source = CLOUDS["gcp"].source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.errors["http_5xx"] >= 2, what="failing reads")
        await control.clear_faults()
        after = await run.wait_for(is_notice, timeout=10)
    assert after.id == before.id


async def test_the_sources_of_one_cloud_read_the_instance_id_once(make_emulator):
    from spotguard.agent.sources.aws import aws_sources

    emu, control = await make_emulator("aws")
    await control.schedule("lifecycle")
    sources = aws_sources(NODE, base_url=emu.url, interval=0.2, maintenance_interval=0.2, timeout=0.5)
    runners = [SourceRunner(s) for s in sources]
    for runner in runners:
        await runner.__aenter__()
    try:
        drain = await next(r for r in runners if r.source.name == "aws.asg").wait_for(is_notice)
        for runner in runners:
            await runner.wait_until(lambda s=runner.source: s.stats.polls >= 3, what="three polls each")
    finally:
        for runner in reversed(runners):
            await runner.__aexit__(None, None, None)
    counts = (await control.request_counts())["by_path"]
    assert counts[CLOUDS["aws"].instance_path] == 1, counts
    assert {s.instance.value for s in sources} == {emu.handler.instance_id}
    assert drain.kind is Kind.DRAIN


async def test_a_hanging_instance_id_never_holds_a_poll_for_long(make_emulator):
    """The first poll sees a notice while the instance id's read hangs (30 s): it returns the
    notice anyway, after at most the grace."""
    emu, control = await make_emulator("aws")
    await control.fault(kind="hang", path=CLOUDS["aws"].instance_path, seconds=30.0, count=0)
    await control.schedule("reclaim", lead=300)
    source = CLOUDS["aws"].source(emu.url)
    try:
        polled = await asyncio.wait_for(source.poll(), 10)
    finally:
        await source.close()
    assert [n.kind for n in polled] == [Kind.RECLAIM]
