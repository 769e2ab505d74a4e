"""Alibaba: the emulated ECS metadata (plain and hardened) and its source, over real HTTP."""
from __future__ import annotations

from datetime import datetime, UTC

import aiohttp
import pytest

from spotguard.agent.sources.alibaba import (TERMINATION_PATH, TOKEN_HEADER, TOKEN_PATH, TTL_HEADER,
                                             EcsMetadataClient, TerminationTimeSource, alibaba_sources)
from spotguard.agent.sources.registry import build_sources
from spotguard.wire.notice import Kind, Notice, format_time, notice_id
from spotguard.wire.withdrawal import Withdrawal
from tests.source_harness import FAULTS, SourceRunner, fault_then_detect

NODE = "ack-node-1"


def spot_source(url: str) -> TerminationTimeSource:
    return TerminationTimeSource(EcsMetadataClient(url, timeout=0.5), NODE, 0.05, owns_client=True)


def deadline_of(scheduled: dict) -> datetime:
    return datetime.fromtimestamp(int(scheduled["deadline"]), UTC)


async def test_emulator_paths_and_hardened_mode(make_emulator):
    emu, control = await make_emulator("alibaba", hardened=True)
    async with aiohttp.ClientSession() as http:
        async with http.get(emu.url + TERMINATION_PATH) as resp:
            assert resp.status == 401  # hardened: no token, no answer
        async with http.put(emu.url + TOKEN_PATH, headers={TTL_HEADER: "0"}) as resp:
            assert resp.status == 400
        async with http.put(emu.url + TOKEN_PATH, headers={TTL_HEADER: "60"}) as resp:
            token = await resp.text()
        async with http.get(emu.url + TERMINATION_PATH, headers={TOKEN_HEADER: token}) as resp:
            assert resp.status == 404
        scheduled = await control.schedule("reclaim", lead=120)
        async with http.get(emu.url + TERMINATION_PATH, headers={TOKEN_HEADER: token}) as resp:
            assert resp.status == 200
            assert await resp.text() == deadline_of(scheduled).strftime("%Y-%m-%dT%H:%M:%SZ")
        async with http.get(emu.url + TERMINATION_PATH, headers={TOKEN_HEADER: "forged"}) as resp:
            assert resp.status == 401


async def test_reclaim_detected_id_stable_and_withdrawn(make_emulator):
    emu, control = await make_emulator("alibaba")
    scheduled = await control.schedule("reclaim", lead=300)
    ids = []
    for _ in range(2):  # two independent sources: an agent restart
        source = spot_source(emu.url)
        async with SourceRunner(source) as run:
            notice = await run.wait_for(lambda u: isinstance(u, Notice))
            ids.append(notice.id)
    assert notice.kind is Kind.RECLAIM and notice.source == "alibaba.spot"
    assert notice.deadline == deadline_of(scheduled)
    assert ids[0] == ids[1] == notice_id("alibaba.spot", NODE, emu.handler.instance_id,
                                         format_time(deadline_of(scheduled)))
    source = spot_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_for(lambda u: isinstance(u, Notice))
        await control.cancel(scheduled["id"])
        gone = await run.wait_for(lambda u: isinstance(u, Withdrawal))
        reads = source.stats.successes
        await run.wait_until(lambda: source.stats.successes >= reads + 3)  # 404 stays: nothing new
    assert gone.notice_id == notice.id and len(run.notices) == 1


async def test_hardened_token_refreshed_after_expiry(make_emulator):
    emu, control = await make_emulator("alibaba", hardened=True)
    source = spot_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 2)
        assert emu.handler.session.issued == 1  # one token serves every read
        await control.fault("expired-token", path=TERMINATION_PATH)
        await run.wait_until(lambda: source.client.token_refreshes >= 1)
        scheduled = await control.schedule("reclaim")
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
    assert notice.deadline == deadline_of(scheduled)
    assert emu.handler.session.issued == 2 and not source.stats.errors
    assert run.updates == [notice]


async def test_plain_mode_works_without_a_token(make_emulator):
    emu, control = await make_emulator("alibaba")
    await control.fault("status", path=TOKEN_PATH, status=403, count=0)  # token service refused
    await control.schedule("reclaim")
    source = spot_source(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_for(lambda u: isinstance(u, Notice))
    assert emu.handler.session.issued == 0 and not source.stats.errors


async def test_registry_default_interval(make_emulator):
    emu, _control = await make_emulator("alibaba")
    [built] = build_sources("alibaba", node=NODE, base_url=emu.url)
    assert built.name == "alibaba.spot" and built.interval == 1.0
    assert alibaba_sources(NODE)[0].client.http.base_url == "http://100.100.100.200"
    await built.close()


@pytest.mark.parametrize("hardened", [False, True], ids=["plain", "hardened"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_fault_counted_then_later_notice_detected(make_emulator, fault, hardened):
    emu, control = await make_emulator("alibaba", hardened=hardened)
    source = spot_source(emu.url)
    scheduled = {}

    async def schedule():
        scheduled.update(await control.schedule("reclaim", lead=200))

    async with SourceRunner(source) as run:
        notice = await fault_then_detect(run, control, fault, TERMINATION_PATH, schedule,
                                         lambda n: n.kind is Kind.RECLAIM)
    assert notice.deadline == deadline_of(scheduled)
