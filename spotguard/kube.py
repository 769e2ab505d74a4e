"""Loads a Kubernetes API client: in-cluster config, or a kubeconfig file for out-of-cluster use.

The official `kubernetes` client is blocking: call it through `asyncio.to_thread` from async code.
"""
from __future__ import annotations

from spotguard.config import ConfigError


def load_api_client(kubeconfig: str | None = None, host: str | None = None):
    """An `ApiClient`. `host` (tests: a kmock URL) wins over `kubeconfig`, which wins over
    in-cluster config. ConfigError names the flag when nothing usable is found."""
    try:
        import kubernetes
    except ImportError:
        raise ConfigError(
            "--kubeconfig", "the kubernetes client is not installed (pip install 'spotguard[k8s]')") from None
    if host is not None:
        cfg = kubernetes.client.Configuration()
        cfg.host = host.rstrip("/")
        return kubernetes.client.ApiClient(cfg)
    cfg = kubernetes.client.Configuration()
    try:
        if kubeconfig:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
    except (kubernetes.config.ConfigException, OSError) as exc:
        raise ConfigError("--kubeconfig", f"no usable Kubernetes config ({exc})") from None
    return kubernetes.client.ApiClient(cfg)
