"""`spotguard sidecar` (run the pod's sidecar) and `spotguard sidecar prestop` (the preStop hook).

Defaults come from the environment the pod spec sets (downward API): the agent is at
`http://$SPOTGUARD_NODE_IP:9740` (`status.hostIP`), the token file is $SPOTGUARD_TOKEN_FILE,
the agent's bearer token $SPOTGUARD_AGENT_TOKEN_FILE, the podinfo volume
$SPOTGUARD_PODINFO_DIR (else /etc/podinfo), the pod's rank count $SPOTGUARD_LOCAL_WORLD_SIZE,
the pod name and namespace $SPOTGUARD_POD_NAME / $SPOTGUARD_POD_NAMESPACE, the notice horizon
$SPOTGUARD_HORIZON_SECONDS (the Guard's variable: the injector copies it from the app
container, so both hold a notice alike). A flag beats its variable (`spotguard.config.Layers`);
`--listen`, `--hostfile`, `--deepspeed-config` and `--log-level` have no variable, and the
sidecar reads no config file: the pod spec is its config.

`spotguard sidecar prestop` runs in the trainer container as an `exec` preStop hook (an
`httpGet` hook would come from the kubelet to the pod IP, not to loopback). It prints the
sidecar's answer and exits 0 when the checkpoint is durable or there was nothing to wait for
(`done`, `no-notice`, `withdrawn`), 1 when it gave up (`timeout`, `deadline`, `failed`), and 3
when the sidecar cannot be reached; Kubernetes proceeds with the termination in every case.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request

from spotguard.config import ConfigError, Layers, http_url, positive_float, positive_int
from spotguard.daemon import run_daemon
from spotguard.wire import names, notice_policy

DEFAULT_LISTEN = f"127.0.0.1:{names.SIDECAR_PORT}"
DEFAULT_URL = f"http://{DEFAULT_LISTEN}"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
OK_OUTCOMES = ("done", "no-notice", "withdrawn")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sidecar", help="run the training pod's sidecar (relay, hooks, preStop, hostfile)",
        description="Relay the node agent's notices to this pod's training processes on loopback, "
                    "collect their hook reports, hold preStop until the checkpoint is durable, "
                    "and keep a DeepSpeed hostfile in step with the job's membership.")
    p.add_argument("--agent-url", default=None,
                   help="node agent base URL (default http://$SPOTGUARD_NODE_IP:9740)")
    p.add_argument("--listen", default=None, help=f"host:port to serve on (default {DEFAULT_LISTEN})")
    p.add_argument("--token-file", default=None,
                   help="where to write the hooks token, mode 0600 (default $SPOTGUARD_TOKEN_FILE)")
    p.add_argument("--agent-token-file", default=None,
                   help="bearer token for the agent's POST /v1/reports (default $SPOTGUARD_AGENT_TOKEN_FILE; "
                        "unset: reports are not forwarded)")
    p.add_argument("--podinfo-dir", default=None,
                   help="downward-API volume with the pod's annotations "
                        "(default $SPOTGUARD_PODINFO_DIR or /etc/podinfo)")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile to keep in step with the membership")
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON config whose elasticity block bounds the world size")
    p.add_argument("--local-world-size", default=None,
                   help="ranks in this pod, for preStop (default $SPOTGUARD_LOCAL_WORLD_SIZE, "
                        "else the world size in the first hook report)")
    p.add_argument("--header-timeout", default=None,
                   help="seconds a connection has to send a request's headers, or its body; idle "
                        "keep-alive connections close after it too (default $SPOTGUARD_HEADER_TIMEOUT or 10)")
    p.add_argument("--horizon-seconds", default=None,
                   help="a notice due further ahead is held, its host kept in the hostfile, until it is "
                        "within this many seconds of its deadline: the Guard's setting "
                        "(default $SPOTGUARD_HORIZON_SECONDS or 120)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="sidecar_command", metavar="SUBCOMMAND")
    pre = sub.add_parser("prestop", help="block until this pod's checkpoint is durable (preStop hook)")
    pre.add_argument("--url", default=None, help=f"sidecar URL (default $SPOTGUARD_SIDECAR_URL or {DEFAULT_URL})")
    pre.add_argument("--timeout", default="120", help="seconds to wait at most (default 120)")
    pre.set_defaults(func=run_prestop)


def parse_listen(value: str, field: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(field, f"expected host:port, got {value!r}")
    number = positive_int(field, port, allow_zero=True)
    if number > 65535:
        raise ConfigError(field, f"port out of range: {number}")
    return host.strip("[]"), number


def _default_namespace() -> str:
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def build_config(args: argparse.Namespace, environ=None):
    """The SidecarConfig the flags and environment describe; ConfigError names the bad field."""
    from spotguard.hooks.sidecar.service import SidecarConfig

    layers = Layers(args, environ)
    agent_url, agent_url_field = layers.get("agent_url", env=None)
    if agent_url is None:
        node_ip = layers.value("node_ip")
        if node_ip is None:
            raise ConfigError("--agent-url", "not given and SPOTGUARD_NODE_IP is unset (downward API status.hostIP)")
        agent_url = f"http://{node_ip}:{names.AGENT_PORT}"
    agent_url = http_url(agent_url_field, agent_url)
    token_file = layers.value("token_file")
    if not token_file:
        raise ConfigError("--token-file", "not given and SPOTGUARD_TOKEN_FILE is unset")
    local, local_field = layers.get("local_world_size")
    host, port = layers.parse("listen", DEFAULT_LISTEN, lambda f, v: parse_listen(v, f), env=None)
    return SidecarConfig(
        agent_url=agent_url,
        token_file=token_file,
        listen_host=host, listen_port=port,
        agent_token_file=layers.value("agent_token_file") or None,
        podinfo_dir=layers.value("podinfo_dir") or "/etc/podinfo",
        hostfile=layers.value("hostfile", env=None),
        deepspeed_config=layers.value("deepspeed_config", env=None),
        local_world_size=None if local is None else positive_int(local_field, local),
        pod=layers.value("pod_name") or socket.gethostname(),
        namespace=layers.value("pod_namespace") or _default_namespace(),
        header_timeout=layers.parse("header_timeout", 10, positive_float),
        horizon_seconds=layers.parse("horizon_seconds", notice_policy.HORIZON_SECONDS, positive_float),
    )


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    return run_daemon(lambda stop: _serve(config, stop), log_level=args.log_level)


async def _serve(config, stop: asyncio.Event) -> int:
    from spotguard.hooks.sidecar.service import Sidecar

    async with Sidecar(config):
        await stop.wait()
    return 0


def run_prestop(args: argparse.Namespace) -> int:
    timeout = positive_float("--timeout", args.timeout)
    base = Layers(args).parse("url", DEFAULT_URL, http_url, env="SPOTGUARD_SIDECAR_URL")
    url = f"{base}/v1/prestop?{urllib.parse.urlencode({'timeout': f'{timeout:g}'})}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(url, timeout=timeout + 10) as resp:
            body = json.loads(resp.read(65536))
    except urllib.error.HTTPError as exc:
        print(json.dumps({"outcome": "error", "status": exc.code,
                          "error": exc.read(2048).decode("utf-8", "replace")}), flush=True)
        return 3
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(json.dumps({"outcome": "unreachable", "error": str(exc)}), flush=True)
        print(f"spotguard sidecar prestop: cannot reach the sidecar at {base}: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(body), flush=True)
    return 0 if body.get("outcome") in OK_OUTCOMES else 1
