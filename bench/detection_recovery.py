"""Detection right after a metadata fault storm ends, per cloud: p50 / p99 / max over many storms.

For each cloud, its reclaim source runs at its default interval (and request timeout) against
an emulator in this process (GCP's hanging GETs wait 2 s instead of 30, so that a storm has
caught the source within seconds). Each storm makes every read of the reclaim path fail (one
kind per storm, in turn: HTTP 503, a corrupt body, a dropped connection); once it has failed a
read, a reclaim notice is scheduled behind it, and 3-5 s (random) later the storm is cleared.
Latency is from the moment the clear is sent to the moment the source yields the notice. The notice
is withdrawn (emulator reset) before the next storm. A source that backs off for long after a few
errors shows here.

Goal: p99 <= interval + 1 s (GCP's hanging GET: interval 0, so 1 s). Percentiles are
nearest-rank. Exit status 1 when a measured row misses the goal or a storm was not detected.

    .venv/bin/python bench/detection_recovery.py                  # 50 storms per cloud, concurrently
    .venv/bin/python bench/detection_recovery.py --storms 10 --clouds aws,gcp
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field

from detection_latency import CLOUDS, missing_reason  # bench/detection_latency.py

STORM_KINDS = {"status-503": {"kind": "status", "status": 503}, "malformed": {"kind": "malformed"},
               "drop": {"kind": "drop"}}
RECLAIM_SOURCE = {"aws": "aws.spot", "azure": "azure.events", "alibaba": "alibaba.spot", "gcp": "gcp.preempted"}


def reclaim_path(cloud: str) -> str:
    from spotguard.agent.sources import alibaba, aws, azure, gcp

    return {"aws": aws.SPOT_PATH, "azure": azure.EVENTS_PATH, "alibaba": alibaba.TERMINATION_PATH,
            "gcp": gcp.PREEMPTED_PATH}[cloud]


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Row:
    cloud: str
    interval: float | None = None
    latencies_s: list[float] = field(default_factory=list)
    errors_per_storm: list[int] = field(default_factory=list)
    misses: int = 0
    problem: str | None = None

    @property
    def goal(self) -> float:
        return (self.interval or 0.0) + 1.0

    def passed(self) -> bool:
        return (not self.problem and not self.misses and bool(self.latencies_s)
                and nearest_rank(self.latencies_s, 0.99) <= self.goal)


async def measure(cloud: str, storms: int, span: tuple[float, float], rng: random.Random, log) -> Row:
    from spotguard.wire.notice import Notice
    from spotguard.wire.withdrawal import Withdrawal
    from spotguard.agent.sources.registry import build_sources
    from spotguard.emulator.control import EmulatorControl
    from spotguard.emulator.server import Emulator

    row = Row(cloud)
    path = reclaim_path(cloud)
    async with Emulator(cloud) as emu, EmulatorControl(emu.url, emu.control_token) as control:
        if cloud == "gcp":
            from spotguard.agent.sources.gcp import gcp_sources
            sources = gcp_sources("bench-node", base_url=emu.url, wait_seconds=2)
        else:
            sources = build_sources(cloud, node="bench-node", base_url=emu.url)
        source = next(s for s in sources if s.name == RECLAIM_SOURCE[cloud])
        row.interval = source.interval
        updates: asyncio.Queue = asyncio.Queue()
        timeout = 3 * row.goal + 10

        async def pump() -> None:
            async for update in source.run():
                updates.put_nowait(update)

        async def wait_for(predicate) -> None:
            end = time.monotonic() + timeout
            while not predicate(await asyncio.wait_for(updates.get(), max(0.001, end - time.monotonic()))):
                pass

        pumping = asyncio.create_task(pump())
        try:
            while source.stats.successes == 0:  # the first clean read
                await asyncio.sleep(0.01)
            kinds = list(STORM_KINDS)
            for i in range(storms):
                kind = kinds[i % len(kinds)]
                errors_before = sum(source.stats.errors.values())
                await control.fault(path=path, count=0, **STORM_KINDS[kind])
                while sum(source.stats.errors.values()) == errors_before:
                    await asyncio.sleep(0.01)
                await control.schedule("reclaim", lead=120)
                await asyncio.sleep(rng.uniform(*span))
                cleared = time.monotonic()
                await control.clear_faults()
                try:
                    await wait_for(lambda u: isinstance(u, Notice))
                except TimeoutError:
                    row.misses += 1
                    log(f"{cloud}: storm {i} ({kind}) not detected within {timeout:.0f}s")
                    await control.reset()
                    continue
                row.latencies_s.append(time.monotonic() - cleared)
                row.errors_per_storm.append(sum(source.stats.errors.values()) - errors_before)
                await control.reset()
                await wait_for(lambda u: isinstance(u, Withdrawal))
        except TimeoutError:
            row.problem = "a withdrawal never arrived"
        finally:
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)
    return row


def render(rows: list[Row], storms: int, span: tuple[float, float]) -> str:
    header = (f"{'cloud':<8} {'interval':>9} {'n':>4} {'errors/storm':>12} {'p50 s':>7} {'p99 s':>7} "
              f"{'max s':>7}  {'goal':<12} result")
    lines = [f"detection after a fault storm: {storms} storms per cloud ({span[0]:g}-{span[1]:g} s each; "
             f"kinds {', '.join(STORM_KINDS)}), storm cleared -> source yields", header, "-" * len(header)]
    for row in rows:
        if row.problem and not row.latencies_s:
            lines.append(f"{row.cloud:<8} {row.problem}")
            continue
        interval = "hanging" if not row.interval else f"{row.interval:.2f} s"
        mean_errors = sum(row.errors_per_storm) / max(1, len(row.errors_per_storm))
        goal = f"p99<={row.goal:.2f}" + (f" ({row.misses} missed)" if row.misses else "")
        lines.append(f"{row.cloud:<8} {interval:>9} {len(row.latencies_s):>4} {mean_errors:>12.1f} "
                     f"{nearest_rank(row.latencies_s, 0.5):>7.3f} {nearest_rank(row.latencies_s, 0.99):>7.3f} "
                     f"{max(row.latencies_s):>7.3f}  {goal:<12} {'PASS' if row.passed() else 'FAIL'}")
    return "\n".join(lines)


async def run(clouds: list[str], storms: int, span: tuple[float, float], seed: int | None) -> list[Row]:
    rng = random.Random(seed)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    rows: dict[str, Row] = {}

    async def one(cloud: str) -> None:
        reason = missing_reason(cloud)
        if reason:
            rows[cloud] = Row(cloud, problem=reason)
            return
        try:
            rows[cloud] = await measure(cloud, storms, span, random.Random(rng.random()), log)
        except Exception as exc:  # report it in the table, measure the rest
            rows[cloud] = Row(cloud, problem=f"failed: {exc!r}")

    await asyncio.gather(*(one(cloud) for cloud in clouds))
    return [rows[c] for c in clouds]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storms", type=int, default=50, help="storms per cloud (default 50)")
    p.add_argument("--clouds", default=",".join(CLOUDS), help="comma-separated clouds (default: all four)")
    p.add_argument("--min-storm", type=float, default=3.0, help="shortest storm, seconds (default 3)")
    p.add_argument("--max-storm", type=float, default=5.0, help="longest storm, seconds (default 5)")
    p.add_argument("--seed", type=int, default=None, help="random seed for the storm lengths")
    args = p.parse_args(argv)
    clouds = [c.strip() for c in args.clouds.split(",") if c.strip()]
    if not clouds or any(c not in CLOUDS for c in clouds):
        p.error(f"--clouds: expected some of {', '.join(CLOUDS)}, got {args.clouds!r}")
    if args.storms < 1:
        p.error(f"--storms: must be >= 1, got {args.storms}")
    if not 0 < args.min_storm <= args.max_storm:
        p.error("--min-storm/--max-storm: need 0 < min <= max")
    args.cloud_list = clouds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # every failed read of a storm logs a warning
    span = (args.min_storm, args.max_storm)
    started = time.monotonic()
    rows = asyncio.run(run(args.cloud_list, args.storms, span, args.seed))
    print(render(rows, args.storms, span))
    print(f"({time.monotonic() - started:.0f} s wall, clouds concurrently)")
    measured = [r for r in rows if not (r.problem or "").startswith("missing")]
    return 0 if all(r.passed() for r in measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
