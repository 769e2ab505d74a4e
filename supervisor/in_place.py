"""Membership of jobs that change it in place (annotation `spotguard.io/in-place: "true"`,
elastic policy only): which pods are members, in which order, and where their store is. Pure.

Contract (docs/protocols.md, "In-place membership"):
- a pod is a member when it is an active replica, Running, on a node that is not departing (the
  caller's `on_healthy_node`: membership_plan.py reads notices through notice_policy, so a
  rebalance or a maintenance beyond the horizon keeps its members), and
  either its host is in the last pushed membership (a survivor), or no membership has been
  pushed yet (the launcher's initial group), or it is Ready (a joiner: its readiness probe is
  the trainer's ready file, injector/patch.py);
- hosts keep a STABLE order: the previous membership's hosts that are still members keep
  their order, new hosts are appended in completion-index order. The first host (rank 0) is
  therefore the longest-running survivor, never a joiner, and the group never renumbers the
  survivors;
- `store` is "<first host's pod IP>:<port>", the port being the trainer container's
  `SPOTGUARD_RDZV_PORT` value (default `names.RDZV_PORT`); "" while that pod has no IP yet.
- at most max-replicas hosts (`capped`): a backfill job may keep a spare replica pod (its
  replicas above max-replicas, gated until a notice or a swap-back needs it, placement.py); a
  Ready joiner beyond max takes the place of one on-demand member in the same membership (the
  swap-back: the spot joiner joins, the on-demand member leaves, the world size stays), or waits;
- warm standby with the replacement hold (`held_for_replacement`, a backfill job with a spare:
  its memberships say `standby`): a previous member on a departing node stays a member while
  a replacement is on its way, one member per replacement (the gated spare, which the warm
  standby places at the notice; one starting; or one Ready and held back by the settle window),
  the first listed first; its rank trains on meanwhile (the Guard's hold). A spare that cannot be
  placed (no capacity) costs nothing: the rank leaves by itself at its latest safe moment.
  The membership that admits the replacement leaves that member out: one change, the world size
  kept. A member whose rank left by itself at its safe moment is no longer Running: it drops out;
- joiners that become Ready together are admitted together: `joiners_settled` holds Ready
  joiners back while another replacement is still starting, for at most a settle window;
- start at min (`spotguard.io/start-at-min: "true"`, `start_members`): no group runs before the
  supervisor's first membership, marked `start`: the Ready pods (each worker's ready file says it
  waits for one) once at least min-replicas are, in completion-index order; later Ready pods are
  joiners as above; a later membership names the start as its `first` while all the start's
  pods are still members as they were (a host of it that reads only a later one still forms it:
  hooks/elastic/join.py `first_to_form`; a host back with a new pod joins instead). After the group
  is gone the next first membership is made the same way;
- the group is GONE (`group_gone`) when none of the member pods of the last membership still
  runs as the incarnation it was pushed for (`incarnation`: pod uid and restarts; every member
  exited after a fallback or a crash, and the Job controller re-created the pods or restarted
  their containers). Its membership is then stale, and the next one is the relaunched job's
  own group (`fresh_members`): pushed only once every replica pod runs, hosts
  in completion-index order (the ranks of the launcher's first group), the store of the lowest
  index's pod (its rank 0).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from spotguard.supervisor import membership
from spotguard.wire import names

TRUE_VALUES = ("true",)
FALSE_VALUES = ("false", "")


def wants_in_place(annotations: Mapping[str, str], name: str = names.ANN_IN_PLACE) -> bool:
    """Whether a job (or pod template) opts in (`name`: in-place, or start-at-min); ValueError for a
    value other than true/false."""
    raw = str(annotations.get(name, "")).strip().lower()
    if raw not in TRUE_VALUES + FALSE_VALUES:
        raise ValueError(f"expected \"true\" or \"false\", got {annotations.get(name)!r}")
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
                on_healthy_node: Callable[[Mapping[str, Any]], bool],
                admit_joiners: bool = True) -> list[Mapping[str, Any]]:
    """The member pods among a job's active replica `pods` (rules in the module docstring);
    `on_healthy_node(pod)` says whether the pod's node is known and not departing. Without
    `admit_joiners`, Ready pods whose host is not in `previous` wait (`joiners_settled`)."""
    out = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Running" or not on_healthy_node(pod):
            continue
        if not previous or membership.host_of(pod, hosts_mode) in previous or (admit_joiners and pod_ready(pod)):
            out.append(pod)
    return out


def ready_joiners(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                  on_healthy_node: Callable[[Mapping[str, Any]], bool]) -> list[Mapping[str, Any]]:
    """Running, Ready pods on healthy nodes whose host is not in `previous` (a pushed membership)."""
    if not previous:
        return []
    return [p for p in member_pods(pods, previous, hosts_mode, on_healthy_node)
            if membership.host_of(p, hosts_mode) not in previous]


def starting_joiners(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                     on_healthy_node: Callable[[Mapping[str, Any]], bool]) -> list[Mapping[str, Any]]:
    """Replacements still on their way: not Ready, not a previous host, not bound to a departing
    node (unscheduled or on a healthy one), and not held by a scheduling gate (a gated pod waits
    for someone to place it, a backfill job's spare for as long as the job is whole)."""
    if not previous:
        return []
    return [p for p in pods if not pod_ready(p) and membership.host_of(p, hosts_mode) not in previous
            and not (p.get("spec") or {}).get("schedulingGates")
            and (not (p.get("spec") or {}).get("nodeName") or on_healthy_node(p))]


def held_for_replacement(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                         on_healthy_node: Callable[[Mapping[str, Any]], bool],
                         on_departing_node: Callable[[Mapping[str, Any]], bool],
                         admit_joiners: bool) -> Callable[[Mapping[str, Any]], bool]:
    """`on_healthy_node` widened by the members held for their replacements (module docstring):
    `on_departing_node(pod)` says the pod's node is departing (and nothing else takes the pod away)."""
    pods = list(pods)
    spares = sum(1 for p in pods if (p.get("spec") or {}).get("schedulingGates"))
    coming = spares + len(starting_joiners(pods, previous, hosts_mode, on_healthy_node))
    if not admit_joiners:
        coming += len(ready_joiners(pods, previous, hosts_mode, on_healthy_node))
    noticed = sorted((p for p in pods if (p.get("status") or {}).get("phase") == "Running" and on_departing_node(p)
                      and membership.host_of(p, hosts_mode) in previous),
                     key=lambda p: list(previous).index(membership.host_of(p, hosts_mode)))
    held = {id(p) for p in noticed[:coming]}
    return lambda pod: on_healthy_node(pod) or id(pod) in held


def joiners_settled(ready_for: Sequence[float], starting: int, settle: float) -> bool:
    """Whether Ready joiners are admitted now: none is still `starting`, or the one Ready the
    longest waited `settle` seconds (`ready_for`: how long each has been seen Ready)."""
    return not starting or not ready_for or max(ready_for) >= settle


def incarnation(pod: Mapping[str, Any]) -> str:
    """"<pod uid>/<restarts of its containers>": changes when the pod is re-created or restarted."""
    meta = pod.get("metadata") or {}
    restarts = sum(int(s.get("restartCount") or 0) for s in (pod.get("status") or {}).get("containerStatuses") or [])
    return f"{meta.get('uid') or meta.get('name', '')}/{restarts}"


def runs_as(pod: Mapping[str, Any], incarnations: Collection[str]) -> bool:
    """The pod is Running as one of `incarnations`, no container of it stopped."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or incarnation(pod) not in incarnations:
        return False
    return all("running" in (s.get("state") or {"running": {}}) for s in status.get("containerStatuses") or [])


def group_gone(pods: Iterable[Mapping[str, Any]], incarnations: Collection[str]) -> bool:
    """The last membership's group is gone (module docstring): it names member incarnations and
    none of the job's active replica `pods` runs as one of them."""
    return bool(incarnations) and not any(runs_as(p, incarnations) for p in pods)


def fresh_members(pods: Iterable[Mapping[str, Any]], replicas: int, hosts_mode: str
                  ) -> tuple[tuple[str, ...], str, tuple[str, ...]] | None:
    """(hosts, store, member incarnations) of the relaunched job's group once all `replicas`
    active replica pods run (module docstring); None until then. A pod on a noticed node is
    listed too (restartPolicy OnFailure restarts it there): the launcher's first group needs
    every worker, and that host then leaves it in place like any noticed host."""
    ordered = sorted(pods, key=membership.index_of)
    if not ordered or len(ordered) < replicas or not all(
            (p.get("status") or {}).get("phase") == "Running" for p in ordered):
        return None
    hosts, store = membership.hosts_of(ordered, hosts_mode), store_of(ordered[0])
    if not hosts or not store:
        return None
    return hosts, store, tuple(incarnation(p) for p in ordered)


def start_members(pods: Iterable[Mapping[str, Any]], least: int, hosts_mode: str,
                  on_healthy_node: Callable[[Mapping[str, Any]], bool], limit: int | None = None
                  ) -> tuple[tuple[str, ...], str, tuple[str, ...]] | None:
    """(hosts, store, member incarnations) of a start-at-min job's first group: its Running, Ready
    replica pods on healthy nodes, once there are at least `least` (min-replicas), hosts in
    completion-index order (at most `limit`, the lowest indices), the store of the lowest
    index's pod; None until then."""
    ready = sorted((p for p in pods if (p.get("status") or {}).get("phase") == "Running" and pod_ready(p)
                    and on_healthy_node(p)), key=membership.index_of)
    hosts = membership.hosts_of(ready, hosts_mode)[:limit]
    ready = [p for p in ready if membership.host_of(p, hosts_mode) in hosts]
    if len(hosts) < least:
        return None
    store = store_of(next(p for p in ready if membership.host_of(p, hosts_mode) == hosts[0]))
    if not store:
        return None
    return hosts, store, tuple(incarnation(p) for p in ready)


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


def capped(hosts: Sequence[str], previous: Sequence[str], limit: int | None,
           replaceable: Collection[str] = ()) -> tuple[str, ...]:
    """`hosts` (stable order) cut to `limit` (None: no limit). `replaceable`: the on-demand hosts.
    Each spot joiner beyond the limit takes the place of one on-demand previous host (the
    swap-back: one membership, the world size kept), the last listed first, so rank 0 stays. An
    on-demand joiner never displaces anyone: over the limit, on-demand joiners wait first, then
    the spot joiners with no on-demand host to replace, the last listed first."""
    excess = len(hosts) - limit if limit is not None else 0
    if excess <= 0:
        return tuple(hosts)
    joiners = [h for h in hosts if h not in previous]
    out = [h for h in reversed(joiners) if h in replaceable][:excess]  # on-demand joiners wait first
    spot_joiners = [h for h in joiners if h not in replaceable]
    excess -= len(out)
    displaced = [h for h in reversed(hosts) if h in previous and h in replaceable][:min(excess, len(spot_joiners))]
    excess -= len(displaced)
    out += displaced + spot_joiners[::-1][:excess]
    return tuple(h for h in hosts if h not in out)


def in_place_members(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                     on_healthy_node: Callable[[Mapping[str, Any]], bool],
                     admit_joiners: bool = True) -> tuple[tuple[str, ...], str]:
    """(member hosts in stable order, the first host's store) for a job's active replica pods."""
    hosts, store, _ = in_place_group(pods, previous, hosts_mode, on_healthy_node, admit_joiners)
    return hosts, store


def in_place_group(pods: Iterable[Mapping[str, Any]], previous: Sequence[str], hosts_mode: str,
                   on_healthy_node: Callable[[Mapping[str, Any]], bool],
                   admit_joiners: bool = True, limit: int | None = None,
                   replaceable: Collection[str] = ()) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """`in_place_members` and the member pods' incarnations (in completion-index order), at most
    `limit` hosts (`capped`)."""
    members = sorted(member_pods(pods, previous, hosts_mode, on_healthy_node, admit_joiners), key=membership.index_of)
    hosts = capped(stable_hosts(previous, membership.hosts_of(members, hosts_mode)), previous, limit, replaceable)
    members = [p for p in members if membership.host_of(p, hosts_mode) in hosts]
    if not hosts:
        return (), "", ()
    first = next(p for p in members if membership.host_of(p, hosts_mode) == hosts[0])
    return hosts, store_of(first), tuple(incarnation(p) for p in members)
