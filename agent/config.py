"""The agent's configuration, resolved by `spotguard.config.Layers` (flags > SPOTGUARD_*
environment > `--config FILE` or SPOTGUARD_CONFIG > defaults).

Contract: `load_config(args, environ)` validates everything before the agent starts and
raises `ConfigError` naming the field as the user wrote it (`--interval`,
`--interval (from SPOTGUARD_INTERVAL)`, or `interval (in FILE)`). Unknown keys in the file are errors.

| key (file)        | flag                  | env                         | default |
|-------------------|-----------------------|-----------------------------|---------|
| cloud             | --cloud               | SPOTGUARD_CLOUD             | auto |
| metadata_url      | --metadata-url        | SPOTGUARD_METADATA_URL      | the cloud's |
| node              | --node                | SPOTGUARD_NODE, NODE_NAME   | hostname |
| interval          | --interval            | SPOTGUARD_INTERVAL          | the cloud's (1 s) |
| timeout           | --timeout             | SPOTGUARD_TIMEOUT           | 2 |
| listen            | --listen              | SPOTGUARD_LISTEN            | 0.0.0.0:9740 |
| kubernetes        | --no-kubernetes       | SPOTGUARD_KUBERNETES        | true |
| kubeconfig        | --kubeconfig          | SPOTGUARD_KUBECONFIG        | in-cluster |
| kube_host         | --kube-host           | SPOTGUARD_KUBE_HOST         | (tests) |
| cordon            | --cordon              | SPOTGUARD_CORDON            | false |
| gpu               | --gpu                 | SPOTGUARD_GPU               | auto |
| gpu_policy        | --gpu-policy          | SPOTGUARD_GPU_POLICY        | built-in |
| report_token_file | --report-token-file   | SPOTGUARD_REPORT_TOKEN_FILE | none |
| log_level         | --log-level           | SPOTGUARD_LOG_LEVEL         | info |
| ready_grace       | --ready-grace         | SPOTGUARD_READY_GRACE       | 30 |
| keepalive         | --keepalive           | SPOTGUARD_KEEPALIVE         | 10 |
| header_timeout    | --header-timeout      | SPOTGUARD_HEADER_TIMEOUT    | 10 |
| max_streams       | --max-streams         | SPOTGUARD_MAX_STREAMS       | 512 |
| max_streams_per_client | --max-streams-per-client | SPOTGUARD_MAX_STREAMS_PER_CLIENT | 32 |

`header_timeout`: seconds a connection has to send a request's headers (from connecting, or
from its previous response) and, separately, a request body; idle keep-alive connections
are closed after it too. `max_streams` bounds open `/v1/stream` subscriptions in all,
`max_streams_per_client` per client IP address (at most `max_streams`).
"""
from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from spotguard.config import ConfigError, Layers, http_url, one_of, positive_float, positive_int
from spotguard.wire import names

CLOUD_CHOICES = ("aws", "gcp", "azure", "alibaba", "auto")
GPU_CHOICES = ("auto", "on", "nvml", "off", "fake:<scenario file>")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LISTEN = f"0.0.0.0:{names.AGENT_PORT}"
FILE_KEYS = ("cloud", "metadata_url", "node", "interval", "timeout", "listen", "kubernetes", "kubeconfig",
             "kube_host", "cordon", "gpu", "gpu_policy", "report_token_file", "log_level", "ready_grace", "keepalive",
             "header_timeout", "max_streams", "max_streams_per_client")
DEFAULTS: dict[str, Any] = {"cloud": "auto", "timeout": "2", "listen": DEFAULT_LISTEN, "kubernetes": True,
                            "cordon": False, "gpu": "auto", "log_level": "info", "ready_grace": "30",
                            "keepalive": "10", "header_timeout": "10", "max_streams": "512",
                            "max_streams_per_client": "32"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class AgentConfig:
    cloud: str = "auto"
    metadata_url: str | None = None
    node: str = "localhost"
    interval: float | None = None
    timeout: float = 2.0
    host: str = "0.0.0.0"
    port: int = names.AGENT_PORT
    kubernetes: bool = True
    kubeconfig: str | None = None
    kube_host: str | None = None
    cordon: bool = False
    gpu: str = "auto"
    gpu_policy: str | None = None
    report_token_file: str | None = None
    log_level: str = "info"
    ready_grace: float = 30.0
    keepalive: float = 10.0
    header_timeout: float = 10.0
    max_streams: int = 512
    max_streams_per_client: int = 32

    @property
    def listen(self) -> str:
        return f"{self.host}:{self.port}"


def parse_listen(field: str, value: Any) -> tuple[str, int]:
    """`ADDR:PORT` (IPv6 as `[::1]:PORT`) -> (addr, port); ConfigError(field) otherwise."""
    text = str(value).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(field, f"expected ADDR:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise ConfigError(field, f"port must be <= 65535, got {port}")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        raise ConfigError(field, f"{host!r} is not an IP address") from None
    return host, port


def parse_gpu(field: str, value: Any) -> str:
    """auto | on | nvml | off | fake:<scenario file> (the file is read when the agent starts)."""
    text = str(value).strip()
    if text.lower() in ("auto", "on", "nvml", "off"):
        return text.lower()
    if text.startswith("fake:") and len(text) > 5:
        return text
    raise ConfigError(field, f"expected one of {', '.join(GPU_CHOICES)}, got {value!r}")


def parse_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(field, f"expected true or false, got {value!r}")


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentConfig:
    """Merges and validates every setting; see the module docstring."""
    from spotguard.agent.watch import resolve_source_config

    layers = Layers(args, environ, file_keys=FILE_KEYS)

    def get(key: str, **kwargs: Any) -> tuple[Any, str]:
        return layers.get(key, DEFAULTS.get(key), **kwargs)

    cloud, cloud_field = get("cloud")
    one_of(cloud_field, cloud, CLOUD_CHOICES)
    metadata_url, url_field = get("metadata_url")
    interval, interval_field = get("interval")
    timeout, timeout_field = get("timeout")
    node, _ = get("node", also_env=("NODE_NAME",))
    by_flag = {"--metadata-url": url_field, "--interval": interval_field, "--timeout": timeout_field}
    try:  # the same validation as `spotguard watch`, reported under the field actually used
        source = resolve_source_config(argparse.Namespace(
            cloud=cloud, metadata_url=None if metadata_url is None else str(metadata_url),
            interval=interval, timeout=timeout, node=None if node is None else str(node)))
    except ConfigError as exc:
        raise ConfigError(by_flag.get(exc.field, exc.field), exc.message) from None

    host, port = parse_listen(*reversed(get("listen")))
    kubernetes_value = _kubernetes_layer(args, layers)
    kubeconfig, _ = get("kubeconfig")
    kube_host, kube_host_field = get("kube_host")
    if kube_host is not None:
        kube_host = http_url(kube_host_field, kube_host)
    cordon, cordon_field = get("cordon")
    gpu, gpu_field = get("gpu")
    gpu_policy, _ = get("gpu_policy")
    token_file, _ = get("report_token_file")
    log_level, level_field = get("log_level")
    grace, grace_field = get("ready_grace")
    keepalive, keepalive_field = get("keepalive")
    header_timeout, header_timeout_field = get("header_timeout")
    max_streams, max_streams_field = get("max_streams")
    per_client, per_client_field = get("max_streams_per_client")
    max_streams = positive_int(max_streams_field, max_streams)
    per_client = positive_int(per_client_field, per_client)
    if per_client > max_streams:
        raise ConfigError(per_client_field, f"must be <= max_streams ({max_streams}), got {per_client}")
    return AgentConfig(
        cloud=cloud,
        metadata_url=source["base_url"],
        node=source["node"],
        interval=source["interval"],
        timeout=source["timeout"],
        host=host, port=port,
        kubernetes=kubernetes_value,
        kubeconfig=None if kubeconfig is None else str(kubeconfig),
        kube_host=kube_host,
        cordon=parse_bool(cordon_field, cordon),
        gpu=parse_gpu(gpu_field, gpu),
        gpu_policy=None if gpu_policy is None else str(gpu_policy),
        report_token_file=None if token_file is None else str(token_file),
        log_level=one_of(level_field, str(log_level).lower(), LOG_LEVELS),
        ready_grace=positive_float(grace_field, grace, allow_zero=True),
        keepalive=positive_float(keepalive_field, keepalive),
        header_timeout=positive_float(header_timeout_field, header_timeout),
        max_streams=max_streams,
        max_streams_per_client=per_client,
    )


def _kubernetes_layer(args: argparse.Namespace, layers: Layers) -> bool:
    """`--no-kubernetes` (flag), SPOTGUARD_KUBERNETES / SPOTGUARD_NO_KUBERNETES, or `kubernetes:`:
    the layers' order, with the one flag and one variable that say the opposite."""
    if getattr(args, "no_kubernetes", None):
        return False
    value, field = layers.get("kubernetes", True, flag="--no-kubernetes", also_env=("SPOTGUARD_NO_KUBERNETES",))
    return parse_bool(field, value) != field.endswith("(from SPOTGUARD_NO_KUBERNETES)")
