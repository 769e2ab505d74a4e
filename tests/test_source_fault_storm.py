"""Detection right after a metadata fault storm, for every polled source and GCP's hanging GET.

A storm is a run of consecutive failed reads (HTTP 503 from the emulator). What it must not
cost is detection once it is over: the read after the last failure comes within the interval
plus a second (asserted with slack for a loaded machine: interval + 3 s; the figure itself is
measured by bench/detection_recovery.py). A 429 is the one failure that waits longer, as long
as the server's Retry-After asks and never past a bound.
"""
from __future__ import annotations

import random
import time
from datetime import datetime, timedelta, UTC

import pytest

from spotguard.agent.sources.alibaba import TERMINATION_PATH, alibaba_sources
from spotguard.agent.sources.aws import SPOT_PATH, ImdsClient, SpotInterruptionSource
from spotguard.agent.sources.azure import EVENTS_PATH, azure_sources
from spotguard.agent.sources.gcp import PREEMPTED_PATH, gcp_sources
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Withdrawal
from tests.source_harness import SourceRunner

STORM = 8  # failed reads in a row: enough for any exponential backoff to reach its cap
STORMS = 3
SLACK = 3.0


def reclaim_source(cloud: str, url: str):
    """(source, path it reads, interval) for `cloud`'s reclaim signal, polling fast."""
    if cloud == "aws":
        return SpotInterruptionSource(ImdsClient(url, timeout=1.0), "n1", 0.2, owns_client=True), SPOT_PATH, 0.2
    if cloud == "azure":
        return azure_sources("n1", base_url=url, interval=0.25, timeout=1.0)[0], EVENTS_PATH, 0.25
    if cloud == "alibaba":
        return alibaba_sources("n1", base_url=url, interval=0.2, timeout=1.0)[0], TERMINATION_PATH, 0.2
    return gcp_sources("n1", base_url=url, timeout=1.0, wait_seconds=1)[0], PREEMPTED_PATH, 0.0


def errors(source) -> int:
    return sum(source.stats.errors.values())


@pytest.mark.parametrize("cloud", ["aws", "azure", "alibaba", "gcp"])
async def test_detection_right_after_a_fault_storm_costs_at_most_an_interval_more(make_emulator, cloud):
    emu, control = await make_emulator(cloud)
    source, path, interval = reclaim_source(cloud, emu.url)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 1, what="a first clean read")
        for storm in range(STORMS):
            before, seen = errors(source), len(run.updates)
            await control.fault("status", path=path, status=503, count=STORM)
            # A hanging GET already waiting when the storm began would return a change at once:
            # the notice goes live once the storm has caught the source, behind it.
            await run.wait_until(lambda: errors(source) > before, timeout=30, what="the storm's first error")
            await control.schedule("reclaim", lead=120)
            await run.wait_until(lambda: errors(source) >= before + STORM, timeout=120, what="the storm")
            ended = time.monotonic()
            notice = await run.wait_for(lambda u: isinstance(u, Notice), timeout=30, start=seen)
            detected_after = time.monotonic() - ended
            assert errors(source) == before + STORM
            assert detected_after <= interval + SLACK, f"storm {storm}: detected {detected_after:.2f}s after it"
            await control.reset()
            await run.wait_for(lambda u: isinstance(u, Withdrawal) and u.notice_id == notice.id, timeout=30,
                               start=seen)


async def test_a_429_waits_as_long_as_retry_after_asks(make_emulator):
    emu, control = await make_emulator("aws")
    source = SpotInterruptionSource(ImdsClient(emu.url, timeout=1.0), "n1", 0.2, owns_client=True)
    async with SourceRunner(source) as run:
        await run.wait_until(lambda: source.stats.successes >= 1, what="a first clean read")
        await control.fault("status", path=SPOT_PATH, status=429, retry_after=2)
        await control.schedule("reclaim", lead=120)
        await run.wait_until(lambda: source.stats.errors["http_429"] == 1, what="the 429")
        throttled = time.monotonic()
        await run.wait_for(lambda u: isinstance(u, Notice), timeout=30)
        waited = time.monotonic() - throttled
        assert 1.8 <= waited <= 2.0 + 0.2 + SLACK, waited


def test_retry_policy_bounds():
    from spotguard.agent.sources.http import retry_after_seconds
    from spotguard.agent.sources.retry import THROTTLE_CAP, RetryPolicy

    rng = random.Random(7)
    for interval in (0.0, 0.2, 0.25, 1.0, 5.0):
        policy = RetryPolicy(interval, rng=rng)
        waits = [policy.after_failure(reason) for reason in ["http_5xx", "timeout", "connect", "malformed"] * 10]
        assert all(interval <= w <= interval + 1.0 for w in waits), (interval, max(waits))
        throttled = [policy.after_failure("http_429") for _ in range(20)]
        assert all(interval <= w <= max(THROTTLE_CAP, interval) for w in throttled)
        assert policy.after_failure("http_429", retry_after=1e9) == max(THROTTLE_CAP, interval)
        assert policy.after_failure("http_429", retry_after=0.0) == interval
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    later = (now + timedelta(seconds=12)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert retry_after_seconds(later, now=now) == 12.0
    assert retry_after_seconds("7") == 7.0
    for bad in (None, "", "soon", "-3", "1.5", "9" * 100, "Tue, 99 Foo 2026 99:99:99 GMT"):
        assert retry_after_seconds(bad) is None, bad
