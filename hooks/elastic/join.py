"""A process's first group: `init_process_group()` in place of torch's, for in-place jobs.

    from spotguard.hooks.elastic import init_process_group
    init_process_group()          # instead of torch.distributed.init_process_group("gloo")
    model, optimizer = build()    # then the adapter (with build=build), then the Guard
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=..., build=build)
    guard = Guard.from_env(adapter=adapter)
    start = guard.resume()        # a joiner receives the state of a live peer here

Contract:
- Without `SPOTGUARD_IN_PLACE=1` it is `torch.distributed.init_process_group(backend)` (env://).
- `backend`: "gloo" or "nccl". NCCL is checked first (`nccl.check`: torch >= 2.7, NCCL >= 2.26.2,
  the environment of `nccl.RECIPE`) and refused with a message naming what to change.
- In place it makes this process's `group_session.GroupSession` (its rendezvous and
  `Timeouts.from_env()`; `elastic_process()` returns it). A starting worker (RANK, WORLD_SIZE from
  the launcher) forms generation 0 at prefix `m0/` on the store of rank 0, which rank 0 serves on
  its rendezvous port for as long as it lives (`SPOTGUARD_RDZV_PORT`; the launcher makes it
  MASTER_PORT on node 0); its groups get torch's default timeout back once formed.
- A joiner (`SPOTGUARD_JOIN=1`) announces itself by creating `SPOTGUARD_READY_FILE` (the pod's
  readiness, or the dry-run's signal), then waits (at most `join_timeout` seconds) for a membership
  that lists its host (`SPOTGUARD_NODE`) with a `store`: from its sidecar's stream
  (`SPOTGUARD_SIDECAR_URL`), or from `memberships`, a callable polled for one (tests). It forms
  the group that membership names (prefix `m<generation>/`, rank by the host's place in the list)
  and remembers it: the Guard made next receives the state from a live peer in `resume()`; until
  then every group waits at most the re-form timeout (the survivors wait for it meanwhile).
- Without `SPOTGUARD_JOIN` (neither "1" nor "0") a worker that has a sidecar looks at the
  membership its pod already has (the sidecar sends it on connect; waited for at most
  `Timeouts.on_connect`).
  It joins (a pod the Job controller re-created after a reclaim) only when all of these hold:
  the membership has a `store` and lists other hosts but not this one, AND a group is live at
  that store: the store answers within `Timeouts.live_probe` (at most a third of the re-form
  timeout) and holds the liveness key its group's leader sets once the group is formed and keeps
  while it leads (rendezvous.py `live_group`; polled within the same bound). Otherwise the
  membership is stale (every worker of the job was relaunched after a fallback or a crash: its
  store is dead, or served by a relaunched leader whose first group cannot form without this
  worker) and the worker starts the first group from the launcher's flags like the others.
  Every worker creates the ready file once its group is formed too, so a pod's readiness probe
  passes in both cases.
- Start at min (`SPOTGUARD_START_AT_MIN=1`, `spotguard launch --nnodes MIN:MAX`, no
  `SPOTGUARD_JOIN=1`): the worker's first group is not the launcher's but the supervisor's. It
  notes the membership its pod has on connect (a stale one from before a relaunch, or the running
  job's), creates its ready file (the supervisor waits for `min-replicas` Ready pods), then waits
  like a joiner for a NEWER membership that lists its host with a `store`. One marked `start`
  (the job's first group, pushed once min pods are Ready) is formed by its hosts together at
  `m<generation>/`: nobody joins, the Guard resumes from the durable checkpoint as at any start.
  Any other (the running job admitting this pod in place) is joined: the state comes from a live
  peer; but a host of the job's first group it descends from (its `first`), which never formed,
  forms that first group (`first_to_form`: its sidecar relayed only the newer membership).
  RANK, WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE are set to the group's once it formed.
- Raises `ReformError` when the group cannot be formed, `TimeoutError` when no membership lists
  this host in time.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

from spotguard.config import positive_int
from spotguard.hooks.elastic.membership_view import MembershipView
from spotguard.hooks.elastic.rendezvous import Rendezvous, live_group
from spotguard.hooks.group_session import GroupSession, Timeouts, process_session, use_session
from spotguard.wire import names
from spotguard.wire.membership import Membership, MembershipFormatError

log = logging.getLogger("spotguard.hooks.elastic")


def elastic_process() -> GroupSession | None:
    """This process's in-place session, once `init_process_group` formed its first group."""
    session = process_session()
    return session if session.in_place else None


def in_place_enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(names.ENV_IN_PLACE, "") == "1"


def init_process_group(backend: str = "gloo", *, memberships: Callable[[], dict | None] | None = None,
                       join_timeout: float = 600.0) -> None:
    """See the module docstring."""
    import torch.distributed as dist

    if not in_place_enabled():
        dist.init_process_group(backend)
        return
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: in-place membership changes run on 'gloo' or 'nccl', not {backend!r}")
    session = GroupSession(Timeouts.from_env(), Rendezvous.from_env())
    rendezvous, timeouts, env = session.rendezvous, session.timeouts, os.environ
    assert rendezvous is not None
    if backend == "nccl":
        from spotguard.hooks.elastic import nccl

        nccl.check(timeouts.reform)  # refuses unsafe versions and settings before anything is made
        rendezvous.backend = "nccl"
        rendezvous.local_rank = positive_int("LOCAL_RANK", env.get("LOCAL_RANK") or 0, allow_zero=True)
    if env.get(names.ENV_START_AT_MIN, "") == "1" and env.get(names.ENV_JOIN, "") != "1":
        start_at_min(use_session(session), memberships, join_timeout)
        return
    if env.get(names.ENV_JOIN, "") not in ("0", "1") and env.get(names.ENV_SIDECAR_URL) and memberships is None:
        found = first_membership(env[names.ENV_SIDECAR_URL], timeouts.on_connect)
        view = MembershipView.from_env()
        found, node = (view.trimmed(found) if found is not None else None), view.node
        if found is not None and found.store and found.hosts and node not in found.hosts:
            live = live_group(found.store, timeouts.live_probe)
            if live is None:
                log.warning("membership %d runs without %s, but no group is live at its store %s: it is stale, "
                            "starting the job's group", found.generation, node, found.store)
            else:
                log.warning("membership %d runs without %s (group %s live at %s): joining it", found.generation,
                            node, live, found.store)
                env[names.ENV_JOIN] = "1"
    use_session(session)
    if env.get(names.ENV_JOIN, "") != "1":
        rank = positive_int("RANK", env.get("RANK") or 0, allow_zero=True)
        world = positive_int("WORLD_SIZE", env.get("WORLD_SIZE") or 1)
        master = f"{env.get('MASTER_ADDR') or '127.0.0.1'}:{env.get('MASTER_PORT') or rendezvous.port}"
        with session.bounded(timeouts.reform):
            session.reform(master, "m0/", rank, world, timeouts.reform)
        announce(env.get(names.ENV_READY_FILE))
        return
    view = MembershipView.from_env()
    warm_up()
    announce(env.get(names.ENV_READY_FILE))
    membership = wait_for_membership(view.node, memberships, join_timeout, trim=view.trimmed)
    rank = membership.hosts.index(view.node) * view.procs_per_host + view.local_rank
    world = len(membership.hosts) * view.procs_per_host
    log.warning("joining membership %d as rank %d of %d (store %s)", membership.generation, rank, world,
                membership.store)
    join_membership(session, membership, rank, world)


def join_membership(session: GroupSession, membership: Membership, rank: int, world: int) -> None:
    """Forms the group `membership` names and keeps it bounded until the Guard's `resume()` has
    received the state (the machine's join walk releases it)."""
    session.bound(session.timeouts.reform)
    session.reform(membership.store, f"m{membership.generation}/", rank, world, session.timeouts.reform)
    session.joined = membership


def start_at_min(session: GroupSession, memberships: Callable[[], dict | None] | None, timeout: float) -> None:
    """The start-at-min path of `init_process_group` (module docstring)."""
    env = os.environ
    view = MembershipView.from_env()
    url = env.get(names.ENV_SIDECAR_URL)
    if memberships is not None:
        before = _membership(memberships())
    else:
        before = first_membership(url, session.timeouts.on_connect) if url else None
    warm_up()
    announce(env.get(names.ENV_READY_FILE))
    newer = -1 if before is None else before.generation
    membership = wait_for_membership(view.node, memberships, timeout, newer_than=newer, trim=view.trimmed)
    if not membership.start:
        first = first_to_form(membership, view.node, session.timeouts.live_probe)
        if first is not None:
            log.warning("membership %d descends from the job's first group %d, which lists %s and is not live at "
                        "its store %s (its `start` was not read: a sidecar relays the newest): forming it",
                        membership.generation, first.generation, view.node, first.store)
            membership = first
    rank = membership.hosts.index(view.node) * view.procs_per_host + view.local_rank
    world = len(membership.hosts) * view.procs_per_host
    log.warning("%s membership %d as rank %d of %d (store %s)", "starting with" if membership.start else "joining",
                membership.generation, rank, world, membership.store)
    if membership.start:
        with session.bounded(session.timeouts.reform):
            session.reform(membership.store, f"m{membership.generation}/", rank, world, session.timeouts.reform)
        session.started = membership
    else:
        join_membership(session, membership, rank, world)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(rank // view.procs_per_host),
                "GROUP_WORLD_SIZE": str(len(membership.hosts))})


def first_to_form(membership: Membership, node: str, probe: float) -> Membership | None:
    """The job's first group (`membership.first`, start at min) when `node`, waiting for its first
    group, is one of its hosts and it never formed: `node` is its first host (its leader, whose
    store is this process's), or no group is live at its store within `probe` seconds
    (rendezvous.py `live_group`: the leader of a formed group keeps its key there). A host whose
    sidecar relayed only a later membership then forms the first group with the hosts that read
    its `start`; a host the first group does not list, or one it lists whose group is live (it
    restarted: a rank of that group no more), joins as any joiner does. None otherwise."""
    first = membership.first
    if first is None or node not in first.hosts:
        return None
    if first.hosts[0] != node and live_group(first.store, probe) is not None:
        return None
    return first


# What a process's first `deepspeed.initialize` imports beyond `import deepspeed` (DeepSpeed 0.19:
# about 1500 modules, 1.5 s of CPU: its Muon optimizer calls torch.compile, which loads inductor).
DEEPSPEED_FIRST_ENGINE = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_layer",
                          "deepspeed.module_inject.auto_ep_presets.registry", "deepspeed.comm.mori",
                          "deepspeed.ops.triton_ops", "deepspeed.moe.ep_router", "deepspeed.ops.op_builder.all_ops")
_cpu_info_lock = threading.Lock()


def keep_cpu_info(prime: bool = False) -> None:
    """DeepSpeed's CPU Adam asks py-cpuinfo for the CPU's vendor whenever one is made: a subprocess,
    about 1 s here, inside an in-place change's pause (a rebuilt engine, a joiner's first one). The
    CPU does not change within a process: from this call on, `cpuinfo.get_cpu_info` answers from
    the first answer (a copy of it; callers at once wait for the one in flight). `prime`: ask now,
    in a background thread. Nothing without py-cpuinfo."""
    try:
        import cpuinfo  # type: ignore[import-untyped]
    except ImportError:
        return
    with _cpu_info_lock:
        if not getattr(cpuinfo.get_cpu_info, "spotguard_kept", False):
            original = cpuinfo.get_cpu_info
            answers: list[dict] = []

            def get_cpu_info():
                with _cpu_info_lock:
                    if not answers:
                        answers.append(original())
                return dict(answers[0])

            get_cpu_info.spotguard_kept = True  # type: ignore[attr-defined]
            cpuinfo.get_cpu_info = get_cpu_info
    if prime:
        threading.Thread(target=cpuinfo.get_cpu_info, name="spotguard-cpu-info", daemon=True).start()


def warm_up() -> None:
    """Imports what building and loading a model in a new group needs, before the joiner says it
    is ready: the survivors wait for the joiner only after that (their pause), not for imports.
    DeepSpeed's first engine's imports too, and its CPU Adam's CPU query (`keep_cpu_info`), when
    the process imported DeepSpeed (nothing of it otherwise)."""
    import importlib

    deepspeed = DEEPSPEED_FIRST_ENGINE if "deepspeed" in sys.modules else ()
    for module in ("torch.nn.parallel", "torch.distributed.device_mesh", "torch.distributed.fsdp",
                   "torch.distributed.tensor", "torch.distributed.tensor.debug",
                   "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                   "torch.distributed.algorithms.ddp_comm_hooks", *deepspeed):
        try:
            importlib.import_module(module)
        except ImportError:  # an optional part missing from this torch build
            pass
    if deepspeed:
        keep_cpu_info(prime=True)


def announce(ready_file: str | None) -> None:
    """Creates the ready file (its directory too); nothing without one."""
    if not ready_file:
        return
    path = Path(ready_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")


def _membership(data: dict | None) -> Membership | None:
    """A membership event's data as a Membership; None when absent or malformed."""
    try:
        return Membership.from_wire(data) if data else None
    except MembershipFormatError:
        return None


def _lists(node: str, newer_than: int = -1) -> Callable[[Membership], bool]:
    return lambda membership: (node in membership.hosts and bool(membership.store)
                               and membership.generation > newer_than)


def sidecar_membership(url: str, timeout: float, wanted: Callable[[Membership], bool]) -> Membership | None:
    """The first membership from the sidecar's stream at `url` that is `wanted`, or None within
    `timeout` (the sidecar sends the pod's current one on connect)."""
    from spotguard.hooks.notice_listener import NoticeListener

    got = threading.Event()
    box: list[Membership] = []

    def on_membership(data: dict[str, Any]) -> None:
        membership = _membership(data)
        if membership is not None and wanted(membership) and not box:
            box.append(membership)
            got.set()

    listener = NoticeListener(url, lambda _notice: None, on_membership=on_membership)
    listener.start()
    try:
        return box[0] if got.wait(timeout) else None
    finally:
        listener.stop()


def first_membership(url: str, timeout: float) -> Membership | None:
    """The membership the sidecar at `url` sends on connect, or None within `timeout`."""
    return sidecar_membership(url, timeout, lambda _membership: True)


def wait_for_membership(node: str, memberships: Callable[[], dict | None] | None, timeout: float,
                        newer_than: int = -1, trim: Callable[[Membership], Membership] = lambda m: m) -> Membership:
    """The first membership listing `node` with a store, of a generation above `newer_than`, from
    `memberships` or the sidecar stream, as `trim` makes it (`MembershipView.trimmed`: the hosts
    the elasticity rule keeps)."""
    lists = _lists(node, newer_than)

    def listed(membership: Membership) -> bool:
        return lists(trim(membership))

    if memberships is not None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = _membership(memberships())
            if found is not None and listed(found):
                return trim(found)
            time.sleep(0.05)
        raise TimeoutError(f"no membership listed {node} within {timeout:.0f}s")
    url = os.environ.get(names.ENV_SIDECAR_URL)
    if not url:
        raise TimeoutError(f"a joiner needs {names.ENV_SIDECAR_URL} (or memberships=) to learn its membership")
    found = sidecar_membership(url, timeout, listed)
    if found is None:
        raise TimeoutError(f"no membership listed {node} within {timeout:.0f}s")
    return trim(found)
