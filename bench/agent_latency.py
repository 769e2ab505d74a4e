"""End-to-end latency: emulator flip -> `notice` event received by an SSE subscriber of the agent.

For each cloud (default AWS polling at 1 s, GCP hanging GET) this starts the metadata emulator
in-process, `spotguard agent` as a subprocess against it, a subscriber on the agent's
/v1/stream, and, in the same run, the cloud's sources alone (in this process) against the same
emulator. Each flip schedules a reclaim at a random moment, waits until both the subscriber and
the lone sources saw it, then withdraws it and waits for both to see that too.

Printed per cloud (milliseconds, p50 / p99 / max over the flips):
- `agent`: flip (the emulator's `served_at`) -> event parsed by the subscriber;
- `source alone`: flip -> update yielded by the sources without the agent;
- `agent overhead`: the notice's `detected_at` (stamped by the agent's source when it parsed the
  read) -> event parsed by the subscriber: what the agent adds (table, SSE, loopback HTTP).
  For AWS the `agent` and `source alone` figures differ mostly by poll phase (two independent
  1 s pollers); the overhead line isolates the agent's own share.

Run: `.venv/bin/python bench/agent_latency.py` (20 flips per cloud) or `--flips 50` (the issue's size).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from datetime import datetime

import aiohttp

from spotguard.agent.sources.merge import merged_updates
from spotguard.agent.sources.registry import build_sources
from spotguard.emulator.control import EmulatorControl
from spotguard.emulator.server import Emulator
from spotguard.wire.notice import Notice
from spotguard.wire.sse import SSEDecoder
from spotguard.wire.withdrawal import Withdrawal

from _agent_process import start_agent, stop_agent  # bench/_agent_process.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"p50 {pct(ms, 50):8.1f}  p99 {pct(ms, 99):8.1f}  max {max(ms):8.1f} ms"


class Inbox:
    """Arrival times of reclaim notices (new ones only) and withdrawals, from any producer."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[str, float, dict]] = []
        self.withdrawn: dict[str, float] = {}
        self._live: set[str] = set()
        self.changed = asyncio.Event()

    def notice(self, wire: dict, at: float) -> None:
        if wire.get("kind") == "reclaim" and wire["id"] not in self._live:
            self._live.add(wire["id"])
            self.withdrawn.pop(wire["id"], None)
            self.arrivals.append((wire["id"], at, wire))
            self.changed.set()

    def withdrawal(self, notice_id: str, at: float) -> None:
        self._live.discard(notice_id)
        self.withdrawn[notice_id] = at
        self.changed.set()

    async def wait(self, predicate, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.001, end - time.monotonic()))


async def subscribe(address: str, inbox: Inbox, ready: asyncio.Event) -> None:
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(f"http://{address}/v1/stream", timeout=aiohttp.ClientTimeout(total=None)) as resp:
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                now = time.time()
                for event in decoder.feed(chunk):
                    if event.event == "snapshot":
                        ready.set()
                    elif event.event == "notice":
                        inbox.notice(event.json(), now)
                    elif event.event == "withdrawn":
                        inbox.withdrawal(event.json()["withdrawn"], now)


async def run_alone(sources, inbox: Inbox) -> None:
    updates = merged_updates(sources)
    try:
        async for _source, update in updates:
            now = time.time()
            if isinstance(update, Notice):
                inbox.notice(update.to_wire(), now)
            elif isinstance(update, Withdrawal):
                inbox.withdrawal(update.notice_id, now)
    finally:
        await updates.aclose()


async def bench_cloud(cloud: str, flips: int) -> dict:
    async with Emulator(cloud, rate_limit=0) if cloud == "azure" else Emulator(cloud) as emu, \
            EmulatorControl(emu.url, emu.control_token) as control:
        proc, address = await asyncio.to_thread(start_agent, cloud, emu.url)
        agent_inbox, alone_inbox = Inbox(), Inbox()
        ready = asyncio.Event()
        tasks = [
            asyncio.create_task(subscribe(address, agent_inbox, ready)),
            asyncio.create_task(run_alone(build_sources(cloud, node="bench-alone", base_url=emu.url), alone_inbox)),
        ]
        agent_lat, alone_lat, overhead = [], [], []
        try:
            await asyncio.wait_for(ready.wait(), 10)
            await asyncio.sleep(1.0)  # let both sets of sources settle into their polling
            for _ in range(flips):
                a0, s0 = len(agent_inbox.arrivals), len(alone_inbox.arrivals)
                await control.schedule("reclaim", in_=random.uniform(0.05, 0.5), lead=120)
                await agent_inbox.wait(lambda: len(agent_inbox.arrivals) > a0, 15)
                await alone_inbox.wait(lambda: len(alone_inbox.arrivals) > s0, 15)
                served = (await control.notices())[0]["served_at"]
                agent_id, at, wire = agent_inbox.arrivals[a0]
                alone_id, alone_at, _ = alone_inbox.arrivals[s0]
                agent_lat.append(at - served)
                alone_lat.append(alone_at - served)
                detected = datetime.fromisoformat(wire["detected_at"].replace("Z", "+00:00")).timestamp()
                overhead.append(at - detected)
                await control.reset()
                await agent_inbox.wait(lambda: agent_id in agent_inbox.withdrawn, 15)
                await alone_inbox.wait(lambda: alone_id in alone_inbox.withdrawn, 15)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(stop_agent, proc)
        return {"agent": agent_lat, "alone": alone_lat, "overhead": overhead}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clouds", default="aws,gcp", help="comma-separated clouds (default aws,gcp)")
    p.add_argument("--flips", type=int, default=20, help="flips per cloud (default 20; the issue asks >= 50)")
    args = p.parse_args(argv)
    print(f"agent end-to-end latency: emulator flip -> SSE subscriber, {args.flips} flips per cloud")
    for cloud in args.clouds.split(","):
        result = asyncio.run(bench_cloud(cloud.strip(), args.flips))
        extra = [a - s for a, s in zip(result["agent"], result["alone"])]
        print(f"[{cloud}] agent          {summary(result['agent'])}")
        print(f"[{cloud}] source alone   {summary(result['alone'])}")
        print(f"[{cloud}] agent overhead {summary(result['overhead'])}  (detected_at -> subscriber)")
        print(f"[{cloud}] agent - alone  mean {sum(extra) / len(extra) * 1000:8.1f} ms (includes poll phase noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
