"""`spotguard emulate`: serve one cloud's metadata API with the control API beside it."""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from spotguard.config import ConfigError, Layers, positive_int
from spotguard.daemon import run_daemon

CLOUDS = ("aws", "gcp", "azure", "alibaba")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("emulate", help="run a cloud metadata emulator (tests, benchmarks, dry-run)",
                              description="Serve a cloud's metadata API on HTTP, with a control API "
                                          "(/_emulator/...) to schedule notices and inject faults.")
    p.add_argument("--cloud", required=True, choices=CLOUDS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", default="0", help="port (default: an ephemeral one, printed at start)")
    p.add_argument("--control-token", default=None,
                   help="bearer token for the control API (default: random; env SPOTGUARD_EMULATOR_TOKEN)")
    p.add_argument("--imdsv2-only", action="store_true", help="aws: refuse GETs without a session token")
    p.add_argument("--alibaba-hardened", action="store_true", help="alibaba: require a session token")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    port = positive_int("--port", args.port, allow_zero=True)
    if port > 65535:
        raise ConfigError("--port", f"must be <= 65535, got {port}")
    options = {}
    if args.cloud == "aws":
        options["imdsv1"] = not args.imdsv2_only
    if args.cloud == "alibaba":
        options["hardened"] = args.alibaba_hardened
    token = Layers(args).value("control_token", env="SPOTGUARD_EMULATOR_TOKEN")
    return run_daemon(lambda stop: _serve(args.cloud, args.host, port, token, options, stop))


async def _serve(cloud: str, host: str, port: int, token: str | None, options: dict, stop: asyncio.Event) -> int:
    from spotguard.emulator.server import Emulator
    async with Emulator(cloud, host=host, port=port, control_token=token, **options) as emu:
        print(json.dumps({"cloud": cloud, "url": emu.url, "control_token": emu.control_token,
                          "pid": os.getpid()}), flush=True)
        await stop.wait()
    return 0
