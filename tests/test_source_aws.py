"""AWS sources against the emulated IMDS over real HTTP: tokens, every notice path, every fault."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, UTC

import pytest

from spotguard.agent.sources.aws import (INSTANCE_ID_PATH, TOKEN_PATH, ImdsClient, LifecycleSource, MaintenanceSource,
                                         RebalanceSource, SpotInterruptionSource, aws_sources,
                                         parse_maintenance_time)
from spotguard.agent.sources.base import SourceError
from spotguard.agent.sources.retry import RetryPolicy
from spotguard.backoff import Backoff
from spotguard.wire.notice import Kind, Notice
from spotguard.wire.withdrawal import Withdrawal
from tests.helpers import next_update, poll_until
from tests.sidecar_helpers import eventually
from tests.source_runner import RunningSource

SPOT_PATH = "/latest/meta-data/spot/instance-action"
MAINT_PATH = "/latest/meta-data/events/maintenance/scheduled"


def wall(iso: str) -> datetime:
    return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def whole_seconds(ts: float) -> datetime:
    return datetime.fromtimestamp(int(ts), UTC)


async def counts(control) -> dict:
    return (await control.request_counts())["by_path"]


@pytest.fixture
async def imds_for():
    """`imds_for(emu, **kw)`: an ImdsClient on the emulator, closed after the test."""
    made = []

    def make(emu, **kwargs) -> ImdsClient:
        imds = ImdsClient(emu.url, **kwargs)
        made.append(imds)
        return imds

    yield make
    for imds in made:
        await imds.close()


# -- IMDSv2 tokens and the v1 fallback ------------------------------------------------------------

async def test_token_put_carries_ttl_and_is_used(make_emulator, imds_for):
    emu, control = await make_emulator("aws", imdsv1=False)
    imds = imds_for(emu, token_ttl=900)
    source = SpotInterruptionSource(imds, "n1")
    before = time.monotonic()
    assert await source.poll() == []
    assert imds.mode == "v2"
    # The emulator accepted the PUT only with a valid TTL header, and stores the expiry it asked for.
    assert len(emu.handler.session.tokens) == 1
    expiry = next(iter(emu.handler.session.tokens.values()))
    assert before + 899 <= expiry <= time.monotonic() + 900
    await eventually(lambda: source.instance.identity.value == emu.handler.instance_id)
    # one token serves the notice path and the instance-id read beside it
    assert (await counts(control)) == {TOKEN_PATH: 1, SPOT_PATH: 1, INSTANCE_ID_PATH: 1}
    assert await source.poll() == []  # the token is reused, not fetched per request
    assert (await counts(control))[TOKEN_PATH] == 1


async def test_token_refreshed_before_it_expires(make_emulator, imds_for):
    emu, control = await make_emulator("aws", imdsv1=False)
    imds = imds_for(emu, token_ttl=4)  # refreshed when less than 0.4 s is left
    source = SpotInterruptionSource(imds, "n1")
    start = time.monotonic()
    await source.poll()
    first_token = set(emu.handler.session.tokens)
    await asyncio.sleep(max(0.0, start + 3.75 - time.monotonic()))
    await source.poll()
    by_path = await counts(control)
    assert by_path[TOKEN_PATH] == 2
    assert by_path[SPOT_PATH] == 2  # no 401 and retry: the old token was replaced while still valid
    assert set(emu.handler.session.tokens) - first_token


async def test_token_refreshed_on_401(make_emulator, imds_for):
    emu, control = await make_emulator("aws", imdsv1=False)
    await control.schedule("reclaim", action="terminate")
    source = SpotInterruptionSource(imds_for(emu), "n1")
    assert len(await source.poll()) == 1
    await control.fault("expired-token", path=SPOT_PATH)
    result = await source.poll()  # 401 -> new token -> retried once, transparently
    assert [n.kind for n in result] == [Kind.RECLAIM]
    by_path = await counts(control)
    assert by_path[TOKEN_PATH] == 2
    assert by_path[SPOT_PATH] == 3


@pytest.mark.parametrize("status", [403, 405])
async def test_falls_back_to_imdsv1_when_put_refused(make_emulator, imds_for, status):
    emu, control = await make_emulator("aws")  # IMDSv1 allowed
    await control.fault("status", path=TOKEN_PATH, status=status, count=0)
    await control.schedule("reclaim", action="stop")
    imds = imds_for(emu, retry_token_after=0.3)
    source = SpotInterruptionSource(imds, "n1")
    result = await source.poll()
    assert [n.detail["action"] for n in result] == ["stop"]
    assert imds.mode == "v1"
    await source.poll()
    assert (await counts(control))[TOKEN_PATH] == 1  # no PUT per poll while on v1
    await control.clear_faults()
    await asyncio.sleep(0.35)
    await source.poll()
    assert imds.mode == "v2"  # tried again after retry_token_after, and got one


async def test_v2_only_instance_without_token_is_an_auth_error(make_emulator, imds_for):
    emu, control = await make_emulator("aws", imdsv1=False)
    await control.fault("status", path=TOKEN_PATH, status=403, count=0)
    await control.schedule("reclaim")
    source = SpotInterruptionSource(imds_for(emu), "n1")
    with pytest.raises(SourceError) as err:
        await source.poll()
    assert err.value.reason == "auth"


# -- notice paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
async def test_spot_action_is_a_reclaim_with_deadline(make_emulator, imds_for, action):
    emu, control = await make_emulator("aws")
    source = SpotInterruptionSource(imds_for(emu), "node-a")
    assert await source.poll() == []
    await control.schedule("reclaim", action=action, lead=120)
    [served] = await control.notices()
    [notice] = await source.poll()
    assert notice.kind is Kind.RECLAIM and notice.source == "aws.spot" and notice.node == "node-a"
    assert notice.deadline == whole_seconds(served["deadline"])
    assert notice.detail["action"] == action
    assert notice.deadline == wall(notice.detail["time"])
    assert 115 <= notice.seconds_left() <= 121


async def test_rebalance_recommendation(make_emulator, imds_for):
    emu, control = await make_emulator("aws")
    source = RebalanceSource(imds_for(emu), "n1")
    assert await source.poll() == []
    await control.schedule("rebalance")
    [served] = await control.notices()
    [notice] = await source.poll()
    assert notice.kind is Kind.REBALANCE and notice.deadline is None
    assert wall(notice.detail["noticeTime"]) == whole_seconds(served["served_at"])


async def test_maintenance_rfc1123_dates_and_cancel_withdraws(make_emulator, imds_for):
    emu, control = await make_emulator("aws")
    source = MaintenanceSource(imds_for(emu), "n1", interval=0.05)
    running = RunningSource(source)
    try:
        scheduled = await control.schedule("maintenance", code="instance-retirement", lead=3600, event_id="ev-1")
        notice = await running.wait_for(lambda u: isinstance(u, Notice))
        assert notice.kind is Kind.MAINTENANCE
        [served] = await control.notices()
        assert notice.deadline == whole_seconds(served["deadline"])
        assert notice.detail["EventId"] == "ev-1" and notice.detail["Code"] == "instance-retirement"
        assert notice.detail["NotBefore"].endswith(" GMT")  # e.g. "21 Jan 2019 09:00:43 GMT"
        await control.cancel(scheduled["id"])  # the emulator now shows State: canceled
        gone = await running.wait_for(lambda u: isinstance(u, Withdrawal))
        assert gone.notice_id == notice.id
    finally:
        await running.stop()


async def test_maintenance_completed_withdraws(make_emulator, imds_for):
    emu, control = await make_emulator("aws")
    source = MaintenanceSource(imds_for(emu), "n1")
    await control.schedule("maintenance", event_id="ev-2")
    [notice] = source.reconcile(await source.poll())
    # The same event (same EventId) is now listed with State completed.
    await control.reset()
    await control.schedule("maintenance", event_id="ev-2", state="completed")
    [entry] = await (await source.imds.http._ensure_session().get(emu.url + MAINT_PATH)).json(content_type=None)
    assert entry["EventId"] == "ev-2" and entry["State"] == "completed"
    assert source.reconcile(await source.poll()) == [Withdrawal(notice.id, "aws.maintenance", "n1")]
    assert await source.poll() == []  # a completed event alone is no notice


def test_parse_maintenance_time_formats():
    expected = datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    assert parse_maintenance_time("21 Jan 2019 09:00:43 GMT", "NotBefore") == expected
    assert parse_maintenance_time("Mon, 21 Jan 2019 09:00:43 GMT", "NotBefore") == expected
    for bad in ("2019-01-21T09:00:43Z", "", 12, None, "x" * 100):
        with pytest.raises(SourceError) as err:
            parse_maintenance_time(bad, "NotBefore")
        assert err.value.reason == "malformed" and "NotBefore" in str(err.value)


async def test_asg_lifecycle_terminated_is_a_drain(make_emulator, imds_for):
    emu, control = await make_emulator("aws")
    source = LifecycleSource(imds_for(emu), "n1")
    assert await source.poll() == []  # InService
    await control.schedule("lifecycle")
    [notice] = await source.poll()
    assert notice.kind is Kind.DRAIN and notice.deadline is None
    assert notice.detail == {"target-lifecycle-state": "Terminated"}


async def test_ids_are_stable_across_instances_and_polls(make_emulator, imds_for):
    emu, control = await make_emulator("aws")
    await control.schedule("reclaim")
    await control.schedule("maintenance", event_id="ev-9")
    first = [SpotInterruptionSource(imds_for(emu), "n1"), MaintenanceSource(imds_for(emu), "n1")]
    second = [SpotInterruptionSource(imds_for(emu), "n1"), MaintenanceSource(imds_for(emu), "n1")]
    for a, b in zip(first, second):
        [na] = await a.poll()
        [nb] = await b.poll()
        [na_again] = await a.poll()
        assert na.id == nb.id == na_again.id
        assert na.id.startswith(a.name + ":")
    other_node = SpotInterruptionSource(imds_for(emu), "n2")
    [nother] = await other_node.poll()
    [nmine] = await first[0].poll()
    assert nother.id != nmine.id


async def test_all_sources_share_one_token(make_emulator):
    emu, control = await make_emulator("aws", imdsv1=False)
    sources = aws_sources("n1", base_url=emu.url)
    try:
        await asyncio.gather(*(s.poll() for s in sources))
        await asyncio.gather(*(s.poll() for s in sources))
        assert (await counts(control))[TOKEN_PATH] == 1
    finally:
        for s in sources:
            await s.close()


# -- faults: counted by reason, no bogus notice, recovery ------------------------------------------

FAULTS = [
    ({"kind": "latency", "seconds": 1.0}, "timeout"),
    ({"kind": "hang"}, "timeout"),
    ({"kind": "status", "status": 503}, "http_5xx"),
    ({"kind": "status", "status": 500}, "http_5xx"),
    ({"kind": "status", "status": 429}, "http_429"),
    ({"kind": "malformed"}, "malformed"),
    ({"kind": "oversized", "bytes": 200_000}, "oversized"),
    ({"kind": "drop"}, "connect"),
]


@pytest.mark.parametrize("fault, reason", FAULTS, ids=[f"{f['kind']}-{r}" for f, r in FAULTS])
async def test_fault_is_counted_and_recovered_from(make_emulator, fault, reason):
    emu, control = await make_emulator("aws")
    imds = ImdsClient(emu.url, timeout=0.3)
    running = RunningSource(SpotInterruptionSource(imds, "n1", interval=0.05, owns_client=True))
    try:
        await control.fault(path=SPOT_PATH, count=2, **fault)
        await running.wait_errors(reason, 1)
        while emu.faults.rules:  # (aiohttp retries a dropped keep-alive request once by itself)
            await asyncio.sleep(0.02)
        assert running.updates == []  # a failed read is never a notice
        await control.schedule("reclaim")
        notice = await running.wait_for(lambda u: isinstance(u, Notice))
        assert notice.kind is Kind.RECLAIM
        assert set(running.source.stats.errors) == {reason}
    finally:
        await running.stop()


async def test_failed_reads_never_withdraw_a_live_notice(make_emulator):
    emu, control = await make_emulator("aws")
    await control.schedule("reclaim")
    imds = ImdsClient(emu.url, timeout=0.3)
    running = RunningSource(SpotInterruptionSource(imds, "n1", interval=0.05, owns_client=True))
    try:
        notice = await running.wait_for(lambda u: isinstance(u, Notice))
        await control.fault("status", path=SPOT_PATH, status=503, count=3)
        await control.fault("malformed", path=SPOT_PATH, count=1)
        await running.wait_errors("malformed", 1)
        await running.wait_errors("http_5xx", 3)
        assert running.updates == [notice]
        assert notice.id in running.source.live
        await control.reset()
        gone = await running.wait_for(lambda u: isinstance(u, Withdrawal))
        assert gone.notice_id == notice.id
    finally:
        await running.stop()


async def test_run_survives_every_fault_in_a_row(make_emulator):
    emu, control = await make_emulator("aws")
    imds = ImdsClient(emu.url, timeout=0.3)
    source = SpotInterruptionSource(imds, "n1", interval=0.02, owns_client=True)
    source.retry = RetryPolicy(source.interval, transient=Backoff(base=0.02, cap=0.1))  # keep the test short
    running = RunningSource(source)
    try:
        for fault, _ in FAULTS:
            await control.fault(path=SPOT_PATH, count=2 if fault["kind"] == "drop" else 1, **fault)
        await control.fault("status", path=SPOT_PATH, status=404)  # a clean "no notice" in between
        await control.fault("expired-token", path=SPOT_PATH)
        for reason in {r for _, r in FAULTS}:
            await running.wait_errors(reason, 1, timeout=15)
        assert running.updates == []
        await control.schedule("reclaim", action="hibernate")
        notice = await running.wait_for(lambda u: isinstance(u, Notice), timeout=10)
        assert notice.detail["action"] == "hibernate"
    finally:
        await running.stop()
    assert running.task.cancelled()


async def test_run_closes_its_client_on_cancel(make_emulator):
    emu, control = await make_emulator("aws")
    imds = ImdsClient(emu.url)
    source = SpotInterruptionSource(imds, "n1", interval=0.05, owns_client=True)
    it = source.run()
    await control.schedule("reclaim")
    assert isinstance(await next_update(it), Notice)
    await it.aclose()
    assert imds.http._session is None
    await poll_until(source, lambda r: isinstance(r, list) and len(r) == 1)  # usable again after close
    await imds.close()
