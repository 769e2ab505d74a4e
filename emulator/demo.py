"""`spotguard demo`: start the metadata emulator, schedule a reclaim, show a source detecting it.

A self-contained first look at spotguard (no cluster, no GPU): it prints each notice the
sources yield, and how long after the emulator started serving it the source saw it.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from spotguard.config import positive_float

CLOUDS = ("aws", "gcp", "azure", "alibaba")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="emulate a cloud, schedule a reclaim, watch it being detected")
    p.add_argument("--cloud", default="all", choices=(*CLOUDS, "all"))
    p.add_argument("--after", default="2", help="seconds until the emulated reclaim notice appears (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    after = positive_float("--after", args.after)
    clouds = CLOUDS if args.cloud == "all" else (args.cloud,)
    for cloud in clouds:
        asyncio.run(_demo(cloud, after))
    return 0


async def _demo(cloud: str, after: float) -> None:
    from spotguard.wire.notice import Notice
    from spotguard.agent.sources.merge import merged_updates
    from spotguard.agent.sources.registry import build_sources
    from spotguard.emulator.control import EmulatorControl
    from spotguard.emulator.server import Emulator

    async with Emulator(cloud) as emu, EmulatorControl(emu.url, emu.control_token) as control:
        sources = build_sources(cloud, node="demo-node", base_url=emu.url)
        polling = f"{len(sources)} source{'s' if len(sources) != 1 else ''} polling"
        print(f"[{cloud}] emulator on {emu.url}; {polling}; reclaim in {after:g}s")
        scheduled = await control.schedule("reclaim", in_=after)
        updates = merged_updates(sources)
        try:
            async for _source, update in updates:
                if isinstance(update, Notice) and update.kind.value == "reclaim":
                    served = (await control.notices())[0]["served_at"]
                    latency_ms = (time.time() - served) * 1000
                    left = update.seconds_left()
                    print(f"[{cloud}] detected {update.kind} from {update.source} id={update.id} "
                          f"{latency_ms:.0f} ms after the emulator served it; "
                          f"deadline in {left:.0f}s" if left is not None else "no deadline")
                    break
        finally:
            await updates.aclose()
        del scheduled
