"""GCP: the emulated metadata server and the hanging-GET sources, over real HTTP."""
from __future__ import annotations

import asyncio
from datetime import timedelta

import aiohttp
import pytest
from aiohttp import web

from spotguard.agent.sources.gcp import (MAINTENANCE_PATH, PREEMPTED_PATH, MaintenanceEventSource,
                                         PreemptedSource, gcp_sources)
from spotguard.agent.sources.http import MetadataClient
from spotguard.agent.sources.registry import build_sources
from spotguard.emulator.clouds.gcp import value_etag
from spotguard.wire.notice import Kind, Notice, notice_id
from spotguard.wire.withdrawal import Withdrawal
from tests.source_harness import FAULTS, SourceRunner, fault_then_detect

NODE = "gke-node-1"
FLAVOR = {"Metadata-Flavor": "Google"}


def sources(url: str, **kw):
    kw.setdefault("wait_seconds", 1)
    kw.setdefault("timeout", 0.5)
    return gcp_sources(NODE, base_url=url, **kw)


def preempted(url: str, **kw) -> PreemptedSource:
    kw.setdefault("wait_seconds", 1)
    kw.setdefault("lead", 30.0)
    return PreemptedSource(MetadataClient(url, timeout=kw.pop("timeout", 0.5)), NODE, 0.0, owns_client=True, **kw)


def maintenance(url: str) -> MaintenanceEventSource:
    return MaintenanceEventSource(MetadataClient(url, timeout=0.5), NODE, 0.0, lead=60.0, wait_seconds=1,
                                  owns_client=True)


# -- the emulated server ---------------------------------------------------------------------

async def test_emulator_requires_flavor_and_answers_with_etag(make_emulator):
    emu, control = await make_emulator("gcp")
    async with aiohttp.ClientSession() as http:
        async with http.get(emu.url + PREEMPTED_PATH) as resp:
            assert resp.status == 403
        async with http.get(emu.url + PREEMPTED_PATH, headers={**FLAVOR, "X-Forwarded-For": "1.2.3.4"}) as resp:
            assert resp.status == 403
        async with http.get(emu.url + PREEMPTED_PATH, headers=FLAVOR) as resp:
            assert resp.status == 200 and await resp.text() == "FALSE"
            assert resp.headers["Metadata-Flavor"] == "Google"
            false_etag = resp.headers["ETag"]
        for path, value in ((MAINTENANCE_PATH, "NONE"), ("/computeMetadata/v1/instance/scheduling/preemptible", "TRUE"),
                            ("/computeMetadata/v1/instance/name", emu.handler.vm_name)):
            async with http.get(emu.url + path, headers=FLAVOR) as resp:
                assert (resp.status, await resp.text()) == (200, value)
        await control.schedule("reclaim")
        async with http.get(emu.url + PREEMPTED_PATH, headers=FLAVOR) as resp:
            assert await resp.text() == "TRUE" and resp.headers["ETag"] not in ("", false_etag)


async def test_emulator_hanging_get(make_emulator):
    emu, control = await make_emulator("gcp")
    url = emu.url + PREEMPTED_PATH
    etag = value_etag(PREEMPTED_PATH, "FALSE")
    async with aiohttp.ClientSession() as http:
        # a stale etag answers at once
        async with http.get(url, headers=FLAVOR, params={"wait_for_change": "true", "last_etag": "stale"}) as resp:
            assert await resp.text() == "FALSE" and resp.headers["ETag"] == etag
        # the current etag hangs until the value changes
        hanging = asyncio.create_task(http.get(url, headers=FLAVOR, params={
            "wait_for_change": "true", "last_etag": etag, "timeout_sec": "20"}))
        await asyncio.sleep(0.3)
        assert not hanging.done()
        await control.schedule("reclaim")
        resp = await asyncio.wait_for(hanging, 5)
        assert await resp.text() == "TRUE" and resp.headers["ETag"] == value_etag(PREEMPTED_PATH, "TRUE")
        resp.release()
        # ... or until timeout_sec, answering the same value
        async with http.get(url, headers=FLAVOR, params={"wait_for_change": "true", "timeout_sec": "1",
                                                         "last_etag": value_etag(PREEMPTED_PATH, "TRUE")}) as resp:
            assert await resp.text() == "TRUE"


# -- the sources -----------------------------------------------------------------------------

async def test_reclaim_detected_with_lead_and_etag_id(make_emulator):
    emu, control = await make_emulator("gcp")
    source = preempted(emu.url, lead=15.0)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.etag is not None, what="a first read")
        await asyncio.sleep(0.2)  # the source is now hanging on the FALSE etag
        await control.schedule("reclaim")
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
    assert notice.kind is Kind.RECLAIM and notice.source == "gcp.preempted" and notice.node == NODE
    assert notice.deadline - notice.detected_at == timedelta(seconds=15)
    served = (await control.notices())[0]["served_at"]
    assert abs(notice.detected_at.timestamp() - served) < 5
    assert notice.id == notice_id("gcp.preempted", NODE, emu.handler.instance_id, value_etag(PREEMPTED_PATH, "TRUE"))


async def test_hanging_get_does_not_poll_and_rereads_keep_the_deadline(make_emulator):
    emu, control = await make_emulator("gcp")
    await control.schedule("reclaim")
    source = preempted(emu.url)
    async with SourceRunner(source) as run:
        first = await run.wait_for(lambda u: isinstance(u, Notice))
        await asyncio.sleep(2.5)  # two hanging-GET timeouts answer the same value again
    assert run.updates == [first]
    assert source.live[first.id].deadline == first.deadline
    counts = (await control.request_counts())["by_path"]
    assert 2 <= counts[PREEMPTED_PATH] <= 6, counts  # about one request per timeout_sec, not a tight loop


async def test_id_stable_across_restarts(make_emulator):
    emu, control = await make_emulator("gcp")
    await control.schedule("reclaim")
    ids = []
    for _ in range(2):
        source = preempted(emu.url)
        async with SourceRunner(source) as run:
            ids.append((await run.wait_for(lambda u: isinstance(u, Notice))).id)
    assert ids[0] == ids[1]


async def test_maintenance_detected_and_withdrawn(make_emulator):
    emu, control = await make_emulator("gcp")
    source = maintenance(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.etag is not None)
        scheduled = await control.schedule("maintenance", event="TERMINATE_ON_HOST_MAINTENANCE")
        notice = await run.wait_for(lambda u: isinstance(u, Notice))
        assert notice.kind is Kind.MAINTENANCE and notice.source == "gcp.maintenance"
        assert notice.detail["maintenance-event"] == "TERMINATE_ON_HOST_MAINTENANCE"
        assert notice.deadline - notice.detected_at == timedelta(seconds=60)
        await control.cancel(scheduled["id"])
        gone = await run.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == notice.id and source.live == {}


async def test_registry_builds_both_monitors(make_emulator):
    emu, _control = await make_emulator("gcp")
    built = build_sources("gcp", node=NODE, base_url=emu.url, timeout=0.5)
    assert sorted(s.name for s in built) == ["gcp.maintenance", "gcp.preempted"]
    assert all(s.interval == 0 for s in built)
    await built[0].close()


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_fault_counted_then_later_notice_detected(make_emulator, fault):
    emu, control = await make_emulator("gcp")
    source = preempted(emu.url)

    async def schedule():
        await control.schedule("reclaim")

    async with SourceRunner(source) as run:
        notice = await fault_then_detect(run, control, fault, PREEMPTED_PATH, schedule,
                                         lambda n: n.kind is Kind.RECLAIM and n.detail["preempted"] == "TRUE")
    assert notice.id == notice_id("gcp.preempted", NODE, emu.handler.instance_id, value_etag(PREEMPTED_PATH, "TRUE"))


async def test_answer_without_flavor_header_is_an_error(make_emulator):
    """A 200 without Metadata-Flavor (here from the emulator's fault path) never counts."""
    emu, control = await make_emulator("gcp")
    source = preempted(emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 1)
        await control.fault("status", path=PREEMPTED_PATH, status=200, count=1)
        await run.wait_until(lambda: source.stats.errors["flavor"] >= 1)
        await control.schedule("reclaim")
        await run.wait_for(lambda u: isinstance(u, Notice))


async def test_rogue_server_saying_true_without_flavor_yields_nothing():
    """Something other than the metadata server answers TRUE: no notice, a 'flavor' error."""
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="TRUE", headers={"ETag": "abc"})

    app = web.Application()
    app.router.add_get(PREEMPTED_PATH, handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]
        source = preempted(f"http://127.0.0.1:{port}")
        async with SourceRunner(source) as run:
            await run.wait_until(lambda: source.stats.errors["flavor"] >= 2)
        assert run.updates == [] and source.stats.successes == 0
    finally:
        await runner.cleanup()


async def test_both_sources_together(make_emulator):
    emu, control = await make_emulator("gcp")
    built = sources(emu.url)
    runners = [SourceRunner(s) for s in built]
    for r in runners:
        await r.__aenter__()
    try:
        await control.schedule("maintenance")
        await control.schedule("reclaim", in_=0.2)
        kinds = {(await r.wait_for(lambda u: isinstance(u, Notice))).kind for r in runners}
        assert kinds == {Kind.RECLAIM, Kind.MAINTENANCE}
    finally:
        for r in reversed(runners):
            await r.__aexit__(None, None, None)
