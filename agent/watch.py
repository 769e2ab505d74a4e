"""`spotguard watch`: run a cloud's notice sources alone and print updates as JSON lines.

Each line is a notice's wire object with `"event": "notice"`, or a withdrawal with
`"event": "withdrawn"`. The smallest useful tool: pipe it into anything.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket

from spotguard.config import http_url, positive_float, positive_int
from spotguard.daemon import run_daemon, until_stopped

CLOUD_CHOICES = ("aws", "gcp", "azure", "alibaba", "auto")


def add_source_flags(p: argparse.ArgumentParser) -> None:
    """The flags every command that runs cloud sources shares (watch, agent)."""
    p.add_argument("--cloud", default="auto", choices=CLOUD_CHOICES,
                   help="which cloud's metadata to watch (default: detect from DMI, then by probing)")
    p.add_argument("--metadata-url", default=None, help="metadata base URL (default: the cloud's own)")
    p.add_argument("--node", default=None, help="node name for notices (default: this host's name)")
    p.add_argument("--interval", default=None, help="poll interval in seconds (default: the cloud's, 1 s)")
    p.add_argument("--timeout", default="2", help="per-request timeout in seconds (default 2)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("watch", help="print a cloud's reclaim notices as JSON lines",
                              description="Run the notice sources for one cloud and print every notice "
                                          "and withdrawal as a JSON line.")
    add_source_flags(p)
    p.add_argument("--count", default="0", help="exit after this many updates (default 0: run until stopped)")
    p.set_defaults(func=run)


def resolve_source_config(args: argparse.Namespace) -> dict:
    """Validates the shared source flags; ConfigError names the bad flag."""
    return {
        "cloud": args.cloud,
        "base_url": None if args.metadata_url is None else http_url("--metadata-url", args.metadata_url),
        "interval": None if args.interval is None else positive_float("--interval", args.interval, allow_zero=True),
        "timeout": positive_float("--timeout", args.timeout),
        "node": args.node or socket.gethostname(),
    }


async def resolve_cloud(cloud: str, base_url: str | None) -> str:
    if cloud != "auto":
        return cloud
    from spotguard.agent.sources.detect import detect_cloud

    detected = await detect_cloud(base_url=base_url)
    if detected is None:
        from spotguard.config import ConfigError
        raise ConfigError("--cloud", "could not detect the cloud (no DMI match, no metadata answered); pass --cloud")
    return detected


def run(args: argparse.Namespace) -> int:
    config = resolve_source_config(args)
    count = positive_int("--count", args.count, allow_zero=True)
    return run_daemon(lambda stop: _watch(config, count, stop))


async def _watch(config: dict, count: int, stop: asyncio.Event) -> int:
    from spotguard.agent.sources.merge import merged_updates
    from spotguard.agent.sources.registry import build_sources

    cloud = await resolve_cloud(config["cloud"], config["base_url"])
    sources = build_sources(cloud, node=config["node"], base_url=config["base_url"],
                            interval=config["interval"], timeout=config["timeout"])

    async def consume() -> None:
        seen = 0
        updates = merged_updates(sources)
        try:
            async for _source, update in updates:
                wire = update.to_wire()
                event = "withdrawn" if "withdrawn" in wire else "notice"
                print(json.dumps({"event": event, **wire}), flush=True)
                seen += 1
                if count and seen >= count:
                    return
        finally:
            await updates.aclose()

    await until_stopped(stop, consume())
    return 0
