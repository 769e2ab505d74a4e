"""The injected sidecar of a pod, as the local kubelet runs it: in its own process (a `Sidecar`
of hooks/sidecar/service.py), configured from the pod's init container of that name the way the
sidecar's own command line configures it (hooks/sidecar/cli.py `build_config`, its flags and its
resolved environment, container paths mapped to the pod's directory), with what one shared host
changes: it listens on a port of its own (every pod here shares 127.0.0.1; `PortMap` rewrites the
port the pod knows it by wherever the pod's other containers name it), it reaches the node agent
where the dry-run's agent listens, and it reads the podinfo file every 0.1 s (the kubelet
rewrites the downward-API file at once). The pod's projected service-account token (audience
spotguard) is the agents' shared report secret, what a local-mode agent checks.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotguard.hooks.sidecar.cli import build_config, register
from spotguard.hooks.sidecar.service import SidecarConfig
from spotguard.trainer.cluster.container import Volumes, container_env, expand
from spotguard.wire.injection import SIDECAR_NAME


def sidecar_container(pod: Mapping[str, Any]) -> dict | None:
    """The pod's injected sidecar (a native sidecar init container), or None; ValueError for any
    other init container (the local kubelet runs none)."""
    found = None
    for container in (pod.get("spec") or {}).get("initContainers") or []:
        if container.get("name") == SIDECAR_NAME and container.get("restartPolicy") == "Always":
            found = container
        else:
            raise ValueError(f"init container {container.get('name')!r}: the local kubelet runs only the "
                             f"injected {SIDECAR_NAME}")
    return found


def write_service_account_tokens(pod: Mapping[str, Any], pod_dir: Path, token: str) -> None:
    """Each projected service-account token volume of the pod, holding `token`."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        for source in (volume.get("projected") or {}).get("sources") or []:
            account = source.get("serviceAccountToken")
            if account is not None:
                path = pod_dir / "volumes" / str(volume["name"]) / str(account.get("path", "token"))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(token)


def sidecar_config(pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Volumes, agent_url: str
                   ) -> tuple[SidecarConfig, int]:
    """(the config the sidecar runs with here, the port the pod knows it by)."""
    env = container_env(pod, container, volumes, {})
    argv = [volumes.host_path(expand(str(w), env)) for w in container.get("args") or []]
    parser = argparse.ArgumentParser(prog="spotguard")
    register(parser.add_subparsers())
    config = build_config(parser.parse_args(argv), env)
    return dataclasses.replace(config, agent_url=agent_url, listen_host="127.0.0.1", listen_port=0,
                               podinfo_interval=0.1), config.listen_port


@dataclasses.dataclass(frozen=True)
class PortMap:
    """The sidecar's port as the pod knows it, and the one it listens on here."""

    pod_port: int
    actual_port: int

    def rewrite(self, text: str) -> str:
        return text.replace(f"127.0.0.1:{self.pod_port}", f"127.0.0.1:{self.actual_port}")
