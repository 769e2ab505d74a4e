"""Detection latency of each cloud's reclaim source against the in-process metadata emulator.

For every cloud whose emulator and sources exist, the cloud's sources run at their default
intervals against an emulator started in this process. The script then flips a reclaim notice
on `--flips` times, each at a random moment within one poll interval (stratified: the offsets
cover the interval evenly, in random order, so the median measures the source and not the
draw), waits for the source to yield it, and withdraws it again (emulator reset) before the
next flip. Latency is from the emulator's `served_at` (wall clock at the flip) to the moment
the source yields the notice.

Goals: polled clouds p50 <= interval/2 + 10 ms and p99 <= interval + 50 ms; GCP (hanging GET,
interval 0) p99 <= 50 ms. Percentiles are nearest-rank. Exit status 1 when a measured row fails.

    .venv/bin/python bench/detection_latency.py                # 50 flips per cloud, concurrently
    .venv/bin/python bench/detection_latency.py --flips 200 --clouds aws,gcp --sequential
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import random
import sys
import time
from dataclasses import dataclass, field

CLOUDS = ("aws", "gcp", "azure", "alibaba")
HANGING_OFFSET_SPAN = 1.0  # seconds over which flips are spread for a hanging-GET source
GCP_P99_GOAL_MS = 50.0


@dataclass
class Row:
    cloud: str
    source: str = "-"
    interval: float | None = None
    latencies_ms: list[float] = field(default_factory=list)
    misses: int = 0
    problem: str | None = None  # why the cloud was not measured

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def goals(self) -> tuple[float | None, float]:
        """(p50 goal, p99 goal) in ms."""
        if not self.interval:
            return None, GCP_P99_GOAL_MS
        return self.interval * 500 + 10, self.interval * 1000 + 50

    def passed(self) -> bool:
        if self.problem or not self.latencies_ms or self.misses:
            return False
        p50_goal, p99_goal = self.goals()
        return (p50_goal is None or self.percentile(0.5) <= p50_goal) and self.percentile(0.99) <= p99_goal


def missing_reason(cloud: str) -> str | None:
    """Why `cloud` cannot be measured (its emulator or sources are absent or broken), or None."""
    for module in (f"spotguard.emulator.clouds.{cloud}", f"spotguard.agent.sources.{cloud}"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                return f"missing: no {module}"
            return f"broken: {module}: {exc}"
        except Exception as exc:  # a half-written module must not stop the others
            return f"broken: {module}: {exc!r}"
    return None


async def measure(cloud: str, flips: int, rng: random.Random, log) -> Row:
    """Runs `flips` reclaim flips on `cloud` and returns the latencies."""
    from spotguard.wire.notice import Kind, Notice
    from spotguard.wire.withdrawal import Withdrawal
    from spotguard.agent.sources.merge import merged_updates
    from spotguard.agent.sources.registry import build_sources
    from spotguard.emulator.control import EmulatorControl
    from spotguard.emulator.server import Emulator

    row = Row(cloud)
    async with Emulator(cloud) as emu, EmulatorControl(emu.url, emu.control_token) as control:
        sources = build_sources(cloud, node="bench-node", base_url=emu.url)
        reclaim_sources = {s.name: s for s in sources}
        updates = merged_updates(sources)
        pending: list = []

        async def next_update(timeout: float):
            if pending:
                return pending.pop(0)
            return await asyncio.wait_for(updates.__anext__(), timeout)

        async def wait_for(predicate, timeout: float):
            end = time.monotonic() + timeout
            while True:
                _source, update = await next_update(max(0.001, end - time.monotonic()))
                if predicate(update):
                    return update, time.time()

        try:
            # Warm-up flip: finds the reclaim source (and its interval) and sets the poll phase.
            await control.schedule("reclaim")
            first, _ = await wait_for(lambda u: isinstance(u, Notice) and u.kind is Kind.RECLAIM, 15)
            row.source = first.source
            row.interval = reclaim_sources[first.source].interval
            span = row.interval or HANGING_OFFSET_SPAN
            timeout = 3 * span + 5
            await control.reset()
            await wait_for(lambda u: isinstance(u, Withdrawal) and u.notice_id == first.id, timeout)

            offsets = [(k + rng.random()) / flips * span for k in range(flips)]
            rng.shuffle(offsets)
            for i, offset in enumerate(offsets):
                scheduled = await control.schedule("reclaim", in_=offset)
                try:
                    notice, seen = await wait_for(
                        lambda u: isinstance(u, Notice) and u.kind is Kind.RECLAIM, timeout)
                except TimeoutError:
                    row.misses += 1
                    log(f"{cloud}: flip {i} not detected within {timeout:.1f}s")
                    await control.reset()
                    continue
                served = {n["id"]: n for n in await control.notices()}[scheduled["id"]]["served_at"]
                row.latencies_ms.append((seen - served) * 1000)
                await control.reset()
                await wait_for(lambda u: isinstance(u, Withdrawal) and u.notice_id == notice.id, timeout)
        except TimeoutError:
            row.problem = "warm-up notice or a withdrawal never arrived"
        finally:
            await updates.aclose()
    return row


def render(rows: list[Row], flips: int) -> str:
    header = f"{'cloud':<8} {'source':<16} {'interval':>9} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  " \
             f"{'goal':<28} result"
    lines = [f"detection latency: {flips} flips per cloud, emulator served_at -> source yields", header,
             "-" * len(header)]
    for row in rows:
        if row.problem and not row.latencies_ms:
            lines.append(f"{row.cloud:<8} {row.problem}")
            continue
        p50_goal, p99_goal = row.goals()
        interval = "hanging" if not row.interval else f"{row.interval:.3f} s"
        goal = (f"p50<={p50_goal:.0f} " if p50_goal is not None else "") + f"p99<={p99_goal:.0f}"
        if row.misses:
            goal += f" ({row.misses} missed)"
        lines.append(f"{row.cloud:<8} {row.source:<16} {interval:>9} {len(row.latencies_ms):>4} "
                     f"{row.percentile(0.5):>8.1f} {row.percentile(0.99):>8.1f} {max(row.latencies_ms):>8.1f}  "
                     f"{goal:<28} {'PASS' if row.passed() else 'FAIL'}")
    return "\n".join(lines)


async def run(clouds: list[str], flips: int, sequential: bool, seed: int | None) -> list[Row]:
    rng = random.Random(seed)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    rows: dict[str, Row] = {}
    runnable = []
    for cloud in clouds:
        reason = missing_reason(cloud)
        if reason:
            rows[cloud] = Row(cloud, problem=reason)
        else:
            runnable.append(cloud)

    async def one(cloud: str) -> None:
        try:
            rows[cloud] = await measure(cloud, flips, random.Random(rng.random()), log)
        except Exception as exc:  # report it in the table, measure the rest
            rows[cloud] = Row(cloud, problem=f"failed: {exc!r}")

    if sequential:
        for cloud in runnable:
            await one(cloud)
    else:
        await asyncio.gather(*(one(cloud) for cloud in runnable))
    return [rows[c] for c in clouds]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flips", type=int, default=50, help="reclaim flips per cloud (default 50)")
    p.add_argument("--clouds", default=",".join(CLOUDS), help="comma-separated clouds (default: all four)")
    p.add_argument("--sequential", action="store_true",
                   help="measure one cloud at a time (default: all at once, each on its own emulator)")
    p.add_argument("--seed", type=int, default=None, help="random seed for the flip offsets")
    args = p.parse_args(argv)
    clouds = [c.strip() for c in args.clouds.split(",") if c.strip()]
    unknown = [c for c in clouds if c not in CLOUDS]
    if unknown or not clouds:
        p.error(f"--clouds: expected some of {', '.join(CLOUDS)}, got {args.clouds!r}")
    if args.flips < 1:
        p.error(f"--flips: must be >= 1, got {args.flips}")
    args.cloud_list = clouds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    rows = asyncio.run(run(args.cloud_list, args.flips, args.sequential, args.seed))
    print(render(rows, args.flips))
    print(f"({time.monotonic() - started:.0f} s wall, {'sequential' if args.sequential else 'concurrent'})")
    measured = [r for r in rows if r.latencies_ms or not (r.problem or "").startswith("missing")]
    return 0 if all(r.passed() for r in measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
