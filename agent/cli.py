"""`spotguard agent`: the node agent (DaemonSet process). See agent/app.py for what it does and
agent/config.py for every setting (flags > SPOTGUARD_* environment > --config file > defaults).

At start it prints one JSON line to stdout, `{"event": "listening", "listen": "host:port",
"node": ..., "pid": ...}` (with `--listen 127.0.0.1:0` this is how a caller learns the port);
logs are JSON lines on stderr. SIGTERM or SIGINT: graceful shutdown, exit 0. Bad config: exit 2
naming the field.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from spotguard.agent.watch import add_source_flags
from spotguard.daemon import run_daemon


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "agent", help="run the node agent: merge notices, serve them, mark the node",
        description="Run this node's notice sources, keep one table of live notices, serve it on "
                    "HTTP (GET /v1/notices, GET /v1/stream as Server-Sent Events, /metrics, /healthz, "
                    "/readyz; POST /v1/reports authenticated) and, in cluster mode, mark the Node.")
    add_source_flags(p)
    # None means "not given", so the environment and the config file can fill it in.
    p.set_defaults(cloud=None, timeout=None)
    p.add_argument("--listen", default=None, help="ADDR:PORT to serve on (default 0.0.0.0:9740)")
    p.add_argument("--no-kubernetes", action="store_const", const=True, default=None,
                   help="local mode: no Kubernetes API (no node marks, no node source)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for out-of-cluster use (default: in-cluster)")
    p.add_argument("--kube-host", default=None, help="Kubernetes API URL without credentials (tests)")
    p.add_argument("--cordon", action="store_const", const=True, default=None,
                   help="also cordon the node while a notice is live")
    p.add_argument("--gpu", default=None,
                   help="GPU health source: auto (default: NVML if present), on|nvml (required), off, "
                        "fake:<scenario file>")
    p.add_argument("--gpu-policy", default=None, help="YAML/JSON GPU policy merged over the built-in table")
    p.add_argument("--report-token-file", default=None,
                   help="file holding the shared secret that authenticates POST /v1/reports")
    p.add_argument("--config", default=None, help="YAML or JSON file of settings (keys as in the docs)")
    p.add_argument("--log-level", default=None, help="debug, info (default), warning, error")
    p.add_argument("--ready-grace", default=None,
                   help="seconds after which /readyz says ready even if a source never answered (default 30)")
    p.add_argument("--keepalive", default=None, help="seconds between stream keepalive comments (default 10)")
    p.add_argument("--header-timeout", default=None,
                   help="seconds a connection has to send a request's headers, or its body; idle "
                        "keep-alive connections close after it too (default 10)")
    p.add_argument("--max-streams", default=None, help="open /v1/stream subscriptions at most (default 512)")
    p.add_argument("--max-streams-per-client", default=None,
                   help="open /v1/stream subscriptions per client IP address at most (default 32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotguard.agent.config import load_config
    config = load_config(args, os.environ)
    return run_daemon(lambda stop: _main(config, stop), log_level=config.log_level)


async def _main(config, stop: asyncio.Event) -> int:
    from spotguard.agent.app import Agent, run_agent

    def announce(address: str) -> None:
        print(json.dumps({"event": "listening", "listen": address, "node": config.node, "pid": os.getpid()}),
              flush=True)

    await run_agent(Agent(config), stop, announce)
    return 0
