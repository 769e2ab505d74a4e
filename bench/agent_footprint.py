"""Footprint: RSS and CPU of an idle `spotguard agent` polling the emulator at default intervals.

One agent runs one cloud's sources; this runs the agent (local mode) against the AWS emulator
(4 IMDS monitors at their defaults: 1 s, maintenance 5 s) plus the GPU health source on the
scripted fake backend (2 healthy GPUs, default 5 s reads and the event waiter), with one SSE
subscriber connected, and samples the agent process with psutil after a warm-up.

Printed: RSS (MiB) at the end and its peak, and CPU as % of one core over the window
(user + system time / wall time), against the goals RSS <= 64 MiB, CPU <= 1%.
Run: `.venv/bin/python bench/agent_footprint.py` (60 s window) or `--seconds 600` (the issue's 10 min).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from spotguard.emulator.server import Emulator

from _agent_process import start_agent, stop_agent  # bench/_agent_process.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="measuring window (default 60; the issue: 600)")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--no-gpu", action="store_true", help="run without the fake GPU source")
    args = p.parse_args(argv)
    return asyncio.run(_run(args))


async def _run(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        scenario = os.path.join(tmp, "gpus.yaml")
        await asyncio.to_thread(Path(scenario).write_text, "gpus: 2\n")
        async with Emulator("aws") as emu:
            gpu = ["--gpu", "off"] if args.no_gpu else ["--gpu", f"fake:{scenario}"]
            proc, address = await asyncio.to_thread(start_agent, "aws", emu.url, *gpu)
            try:
                ps = psutil.Process(proc.pid)
                async with aiohttp.ClientSession(trust_env=False) as session, \
                        session.get(f"http://{address}/v1/stream", timeout=aiohttp.ClientTimeout(total=None)) as resp:
                    await resp.content.readuntil(b"\n\n")  # subscribed: the snapshot arrived
                    drain = asyncio.create_task(resp.content.read())
                    await asyncio.sleep(args.warmup)
                    cpu0, t0 = ps.cpu_times(), time.monotonic()
                    peak = 0
                    end = t0 + args.seconds
                    while time.monotonic() < end:
                        await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
                        peak = max(peak, ps.memory_info().rss)
                    cpu1, t1 = ps.cpu_times(), time.monotonic()
                    rss = ps.memory_info().rss
                    drain.cancel()
                requests = sum(emu.requests.values())
            finally:
                stop_agent(proc)
    cpu = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (t1 - t0) * 100
    mib = 1024 * 1024
    print(f"agent footprint (AWS emulator at defaults{'' if args.no_gpu else ' + fake GPU source'}, "
          f"1 subscriber), {args.seconds:.0f} s window after {args.warmup:.0f} s warm-up, "
          f"{requests} metadata requests served")
    print(
        f"RSS {rss / mib:.1f} MiB (peak {peak / mib:.1f})   goal <= 64 MiB: {'met' if peak <= 64 * mib else 'NOT met'}")
    print(f"CPU {cpu:.2f}% of one core               goal <= 1%: {'met' if cpu <= 1.0 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
