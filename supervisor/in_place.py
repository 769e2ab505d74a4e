"""Membership of jobs that change it in place (annotation `spotguard.io/in-place: "true"`,
elastic policy only): which pods are members, in which order, and where their store is. Pure.

Contract (docs/protocols.md, "In-place membership"):
- a pod is a member when it is an active replica, Running, on a node without a notice, and
  either its host is in the last pushed membership (a survivor), or no membership has been
  pushed yet (the launcher's initial group), or it is Ready (a joiner: its readiness probe is
  the trainer's ready file, injector/patch.py);
- hosts keep a STABLE order: the previous membership's hosts that are still members keep
  their order, new hosts are appended in completion-index order. The first host (rank 0) is
  therefore the longest-running survivor, never a joiner, and the group never renumbers the
  survivors;
- `store` is "<first host's pod IP>:<port>", the port being the trainer container's
  `SPOTGUARD_RDZV_PORT` value (default `names.RDZV_PORT`); "" while that pod has no IP yet.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from spotguard.supervisor import membership
from spotguard.wire import names

TRUE_VALUES = ("true",)
FALSE_VALUES = ("false", "")


def wants_in_place(annotations: Mapping[str, str]) -> bool:
    """Whether a job (or pod template) opts in; ValueError for a value other than true/false."""
    raw = str(annotations.get(names.ANN_IN_PLACE, "")).strip().lower()
    if raw not in TRUE_VALUES + FALSE_VALUES:
        raise ValueError(f"expected \"true\" or \"false\", got {annotations.get(names.ANN_IN_PLACE)!r}")
    return raw in TRUE_VALUES


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's `Ready` condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def stable_hosts(previous: Sequence[str], current: Iterable[str]) -> tuple[str, ...]:
    """`previous` hosts still in `current`, in their order, then the new ones of `current` in
    its order (callers pass completion-index order). Repeats are dropped."""
    now = list(dict.fromkeys(current))
    kept = [h for h in dict.fromkeys(previous) if h in now]
    return (*kept, *(h for h in now if h not in kept))


def member_pods(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                on_healthy_node: Callable[[Mapping[str, Any]], bool]) -> list[Mapping[str, Any]]:
    """The member pods among a job's active replica `pods` (rules in the module docstring);
    `on_healthy_node(pod)` says whether the pod's node is known and has no notice."""
    out = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Running" or not on_healthy_node(pod):
            continue
        if not previous or membership.host_of(pod, hosts_mode) in previous or pod_ready(pod):
            out.append(pod)
    return out


def rdzv_port(pod: Mapping[str, Any]) -> int:
    """The first container's literal `SPOTGUARD_RDZV_PORT` (the injector sets it on every
    trainer container), else `names.RDZV_PORT`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for env in (container or {}).get("env") or []:
            if env.get("name") == names.ENV_RDZV_PORT and str(env.get("value", "")).isdigit():
                port = int(env["value"])
                if 0 < port < 65536:
                    return port
    return names.RDZV_PORT


def store_of(pod: Mapping[str, Any]) -> str:
    """"<pod IP>:<rendezvous port>" of `pod`, "" while it has no IP."""
    ip = (pod.get("status") or {}).get("podIP") or ""
    if not ip:
        return ""
    return f"[{ip}]:{rdzv_port(pod)}" if ":" in ip else f"{ip}:{rdzv_port(pod)}"


def in_place_members(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                     on_healthy_node: Callable[[Mapping[str, Any]], bool]) -> tuple[tuple[str, ...], str]:
    """(member hosts in stable order, the first host's store) for a job's active replica pods."""
    members = member_pods(pods, previous, hosts_mode, on_healthy_node)
    hosts = stable_hosts(previous, membership.hosts_of(members, hosts_mode))
    if not hosts:
        return (), ""
    first = next(p for p in sorted(members, key=membership.index_of) if membership.host_of(p, hosts_mode) == hosts[0])
    return hosts, store_of(first)
