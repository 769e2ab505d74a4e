"""`spotguard supervisor`: the job supervisor (a Deployment; two replicas, one leader).

At start it prints one JSON line to stdout, `{"event": "listening", "listen": "host:port",
"identity": ..., "pid": ...}` (with `--listen 127.0.0.1:0` this is how a caller learns the
port); logs are JSON lines on stderr. SIGTERM/SIGINT: release the Lease, exit 0. Bad settings:
exit 2 naming the field. Settings resolve as every command's do (`spotguard.config.Layers`):
flag > SPOTGUARD_<FLAG> environment variable > `--config FILE` (keys as the flags, `_` or `-`)
> default.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket

from spotguard.config import ConfigError, Layers, http_url, one_of, positive_float, positive_int
from spotguard.daemon import run_daemon


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "supervisor", help="run the job supervisor: rescale or suspend managed jobs on notices",
        description="Watch Nodes for spotguard notices and jobs labelled spotguard.io/managed=true; scale "
                    "elastic jobs to the surviving replicas, suspend fixed ones after their checkpoint, and "
                    "bring them back when capacity returns. Leader-elected on a Lease.")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for out-of-cluster use (default: in-cluster)")
    p.add_argument("--kube-host", default=None, help="Kubernetes API URL without credentials (tests)")
    p.add_argument("--namespace", default=None, help="namespace of the jobs to manage (default: all)")
    p.add_argument("--lease-name", default=None, help="Lease name (default spotguard-supervisor)")
    p.add_argument("--lease-namespace", default=None,
                   help="Lease namespace (default: $POD_NAMESPACE, else --namespace, else default)")
    p.add_argument(
        "--identity", default=None, help="this replica's identity in the Lease (default: $POD_NAME or host-pid)")
    p.add_argument("--listen", default=None, help="ADDR:PORT for /metrics and /healthz (default 0.0.0.0:9742)")
    p.add_argument("--prices", default=None, help="YAML/JSON price table for cost metrics (see supervisor/README.md)")
    p.add_argument("--resync", default=None, help="seconds between full reconciles (default 60)")
    p.add_argument("--lease-duration", default=None, help="Lease duration in seconds (default 15)")
    p.add_argument("--checkpoint-timeout", default=None,
                   help="fixed policy: seconds to wait for the checkpoint when a notice has no deadline (default 120)")
    p.add_argument("--scale-out-delay", default=None,
                   help="elastic policy: seconds after a decision before scaling back out (default 30)")
    p.add_argument("--membership-hosts", default=None, help="hosts in the membership: node (default), pod-ip, pod-name")
    p.add_argument("--workers", default=None, help="concurrent job reconciles (default 4)")
    p.add_argument("--log-level", default=None, help="debug, info (default), warning, error")
    p.add_argument("--config", default=None, help="YAML or JSON file of settings (keys as the flags)")
    p.set_defaults(func=run)


FILE_KEYS = ("kubeconfig", "kube_host", "namespace", "lease_name", "lease_namespace", "identity", "listen", "prices",
             "resync", "lease_duration", "checkpoint_timeout", "scale_out_delay", "membership_hosts", "workers",
             "log_level")


def layers_from_args(args: argparse.Namespace, environ=os.environ) -> Layers:
    """The supervisor's settings: flags, SPOTGUARD_* variables, the --config file, defaults."""
    return Layers(args, environ, file_keys=FILE_KEYS)


def parse_listen(value: str, field: str = "--listen") -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not host:
        raise ConfigError(field, f"expected ADDR:PORT, got {value!r}")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(field, f"bad port in {value!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(field, f"port out of range in {value!r}")
    return host.strip("[]"), number


def options_from_args(args: argparse.Namespace, environ=os.environ):
    """Validated Options; ConfigError names the field."""
    from spotguard.supervisor.app import Options
    from spotguard.supervisor.cost import PriceTable
    from spotguard.supervisor.membership import HOST_MODES

    layers = layers_from_args(args, environ)
    namespace = layers.value("namespace")
    if namespace in ("", "all", "*"):
        namespace = None
    host, port = layers.parse("listen", "0.0.0.0:9742", lambda f, v: parse_listen(v, f))
    prices_path = layers.value("prices")
    prices = PriceTable.from_file(prices_path) if prices_path else None
    lease_duration, lease_field = layers.get("lease_duration", 15)
    lease_duration = positive_float(lease_field, lease_duration)
    if lease_duration < 2:
        raise ConfigError(lease_field, "must be >= 2 seconds")
    kube_host, kube_host_field = layers.get("kube_host")
    if kube_host is not None:
        kube_host = http_url(kube_host_field, kube_host)
    return Options(
        kubeconfig=layers.value("kubeconfig"),
        kube_host=kube_host,
        namespace=namespace,
        lease_namespace=layers.value("lease_namespace") or environ.get("POD_NAMESPACE") or namespace or "default",
        lease_name=layers.value("lease_name", "spotguard-supervisor"),
        identity=layers.value("identity") or environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        listen_host=host,
        listen_port=port,
        prices=prices,
        resync=layers.parse("resync", 60, positive_float),
        lease_duration=lease_duration,
        checkpoint_timeout=layers.parse("checkpoint_timeout", 120, positive_float),
        scale_out_delay=layers.parse("scale_out_delay", 30, lambda f, v: positive_float(f, v, allow_zero=True)),
        membership_hosts=layers.parse("membership_hosts", "node", lambda f, v: one_of(f, v, HOST_MODES)),
        workers=layers.parse("workers", 4, positive_int),
    )


def run(args: argparse.Namespace) -> int:
    level, level_field = layers_from_args(args).get("log_level", "info")
    level = one_of(level_field, str(level).lower(), ("debug", "info", "warning", "error"))
    options = options_from_args(args)
    return run_daemon(lambda stop: _main(options, stop), log_level=level)


async def _main(options, stop: asyncio.Event) -> int:
    from spotguard.supervisor.app import run_supervisor

    def announce(address: str) -> None:
        print(json.dumps({"event": "listening", "listen": address, "identity": options.identity, "pid": os.getpid()}),
              flush=True)

    await run_supervisor(options, stop, announce)
    return 0
