"""`spotguard launch`: torchrun's per-node launch for jobs that change membership in place.

torchrun's elastic agent restarts every worker of a node when the membership changes; in place,
the survivors must keep their processes. This command takes torchrun's flags (also spelled
with underscores: --nproc_per_node, --node_rank, --master_addr, --master_port; `--standalone`
is one node on a free 127.0.0.1 port), starts the node's P workers ONCE with torchrun's
environment plus spotguard's in-place one, and never restarts them (`hooks/local_workers.py`:
signals forwarded, a crash stops the rest, the exit status aggregated). The ranks re-form
their group themselves (the Guard's in-place path), driven by the membership the supervisor
writes.

Environment of local worker l on node I (N nodes, P workers each), docs/protocols.md:
RANK=I*P+l, LOCAL_RANK=l, WORLD_SIZE=N*P, LOCAL_WORLD_SIZE=P, GROUP_RANK=I, GROUP_WORLD_SIZE=N,
ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT=0,
TORCHELASTIC_MAX_RESTARTS=0, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, OMP_NUM_THREADS=1 unless set;
SPOTGUARD_IN_PLACE=1, SPOTGUARD_NODE, SPOTGUARD_RDZV_HOST, SPOTGUARD_RDZV_PORT (the same on every
local worker: only one of them hosts a store), SPOTGUARD_LAUNCHER_PID (this launcher: a worker
whose launcher died leaves, `hooks/orphan_watch.py`), and SPOTGUARD_JOIN=1, SPOTGUARD_READY_FILE,
SPOTGUARD_REFORM_TIMEOUT, SPOTGUARD_MIN_WORLD_SIZE when set.

Each worker starts in a session of its own, as torchrun's do. `--same-session` starts each in a
process group of its own inside the launcher's session instead: for several simulated nodes on
one host (the dry-run), since the kernel's autogroup scheduling (`sched_autogroup_enabled`, on by
default) makes every session a scheduling group of its own, and a CPU-bound start-up in one
session then slows the step of ranks in the others (a joiner's interpreter and `import torch`
beside 4 gloo ranks on 2 cores: README, "goodput backfill, one session"). Signals and the
way out work the same in both (each worker leads its own process group).

`--nnodes MIN:MAX` (torchrun's range) starts at min: SPOTGUARD_START_AT_MIN=1 (the workers'
first group is the first membership the supervisor pushes once MIN pods are Ready, later pods
join in place: `hooks/elastic/join.py`), SPOTGUARD_MIN_WORLD_SIZE=MIN*P unless given; RANK and
WORLD_SIZE (MIN*P) are provisional until that group forms. A fixed `--nnodes N` is unchanged.

Settings: a flag, else (for spotguard's own settings) its SPOTGUARD_* variable, else the
default (`spotguard.config.Layers`); torchrun's flags have no variable. A bad value exits 2
naming its flag before any worker starts.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from spotguard.config import ConfigError, Layers, positive_float, positive_int
from spotguard.hooks.local_workers import LocalWorkers, Worker
from spotguard.processes import free_port
from spotguard.wire import names

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


@dataclass(frozen=True)
class LaunchConfig:
    """One node's launch, validated. `command` is the worker's argv after the interpreter."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    node_name: str
    rdzv_host: str
    rdzv_port: int
    join: bool
    ready_file: str | None
    reform_timeout: float | None
    min_world_size: int | None
    shutdown_timeout: float
    command: tuple[str, ...]
    start_at_min: bool = False  # `--nnodes MIN:MAX`: the first group is the supervisor's first membership
    same_session: bool = False  # workers in this launcher's session (own process groups), not sessions of their own
    max_nodes: int = 0  # MAX of the range (nnodes when fixed)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch", allow_abbrev=False,
        help="start this node's training workers once, for in-place membership changes (torchrun's flags)",
        description="Start this node's workers with torchrun's environment and spotguard's in-place one, "
                    "once: a worker is never restarted; survivors of a membership change keep running.")
    p.add_argument("--nnodes", default=None,
                   help="nodes in the job at start (default 1), or MIN:MAX: start with the first membership "
                        "the supervisor pushes once MIN pods are Ready, grow in place up to MAX")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", default=None,
                   help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None,
                   help="workers on this node (default 1)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help=f"address of node rank 0 (default {DEFAULT_MASTER_ADDR})")
    p.add_argument("--master-port", "--master_port", dest="master_port", default=None,
                   help=f"port of node rank 0's store (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--standalone", action="store_true",
                   help="one node alone: nnodes 1, master 127.0.0.1 on a free port")
    p.add_argument("--node-name", default=None,
                   help="this host as membership and notices name it "
                        "(default $SPOTGUARD_NODE, else $NODE_NAME, else the host name)")
    p.add_argument("--rdzv-host", default=None,
                   help="address peers reach this host's rendezvous store at (default $SPOTGUARD_RDZV_HOST, "
                        "else --master-addr on node rank 0 and this host name's address on the others)")
    p.add_argument("--rdzv-port", default=None,
                   help="port of this host's rendezvous store (default $SPOTGUARD_RDZV_PORT, else --master-port)")
    p.add_argument("--join", action="store_const", const="1", default=None,
                   help="the workers join a running job, taking its state from a live peer ($SPOTGUARD_JOIN)")
    p.add_argument("--ready-file", default=None,
                   help="file a joining worker creates once ready ($SPOTGUARD_READY_FILE)")
    p.add_argument("--reform-timeout", default=None,
                   help="seconds a re-form may take before the restart fallback ($SPOTGUARD_REFORM_TIMEOUT)")
    p.add_argument("--min-world-size", default=None,
                   help="fewer survivors than this drain instead of re-forming ($SPOTGUARD_MIN_WORLD_SIZE)")
    p.add_argument("--shutdown-timeout", default=None,
                   help=f"seconds between SIGTERM and SIGKILL to the other workers after a crash "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    p.add_argument("--same-session", action="store_const", const="1", default=None,
                   help="each worker in a process group of its own in this launcher's session, not a session "
                        "of its own (torchrun's way): for several simulated nodes on one host")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("-m", "--module", action="store_true",
                   help="run the training script as a module (python -m), as torchrun's -m")
    p.add_argument("training_script", help="the training script, or the module with -m")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validates, then starts the workers and waits for them; returns the aggregated exit status."""
    from spotguard.logs import setup_logging

    config = build_config(args)
    setup_logging(args.log_level)
    return asyncio.run(LocalWorkers(workers(config, os.environ), config.shutdown_timeout,
                                    same_session=config.same_session).run())


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The LaunchConfig the flags and environment describe; ConfigError names the bad field."""
    from spotguard.hooks.signals import node_name

    layers = Layers(args, environ)
    if args.standalone:
        given = [flag for flag, key in (("--nnodes", "nnodes"), ("--node-rank", "node_rank"),
                                        ("--master-addr", "master_addr"), ("--master-port", "master_port"))
                 if getattr(args, key) is not None]
        if given:
            raise ConfigError("--standalone", f"runs one node on a free local port; drop {', '.join(given)}")
    nnodes, max_nodes = layers.parse("nnodes", 1, nnodes_range, env=None)
    node_rank = layers.parse("node_rank", 0, lambda f, v: positive_int(f, v, allow_zero=True), env=None)
    if node_rank >= max_nodes:
        raise ConfigError("--node-rank", f"must be below --nnodes ({max_nodes}), got {node_rank}")
    nproc = layers.parse("nproc_per_node", 1, positive_int, env=None)
    master_addr = str(layers.value("master_addr", DEFAULT_MASTER_ADDR, env=None)).strip()
    if not master_addr:
        raise ConfigError("--master-addr", "must not be empty")
    master_port = free_port() if args.standalone else layers.parse("master_port", DEFAULT_MASTER_PORT, port_number,
                                                                   env=None)
    rdzv_host = layers.value("rdzv_host") or (master_addr if node_rank == 0 else host_address())
    min_world, min_world_field = layers.get("min_world_size")
    start_at_min = ":" in str(args.nnodes or "")
    if min_world is None and start_at_min:  # torchrun's MIN: fewer nodes than that drain
        min_world, min_world_field = nnodes * nproc, "--nnodes"
    reform, reform_field = layers.get("reform_timeout")
    return LaunchConfig(
        nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc,
        master_addr=master_addr, master_port=master_port,
        node_name=layers.value("node_name", env=names.ENV_NODE) or node_name(),
        rdzv_host=str(rdzv_host),
        rdzv_port=layers.parse("rdzv_port", master_port, port_number),
        join=layers.parse("join", "0", flag_value, env=names.ENV_JOIN),
        ready_file=layers.value("ready_file") or None,
        reform_timeout=None if reform is None else positive_float(reform_field, reform),
        min_world_size=None if min_world is None else positive_int(min_world_field, min_world),
        start_at_min=start_at_min, max_nodes=max_nodes,
        same_session=layers.parse("same_session", "0", flag_value, env=None),
        shutdown_timeout=layers.parse("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT,
                                      lambda f, v: positive_float(f, v, allow_zero=True), env=None),
        command=worker_command(args),
    )


def nnodes_range(field: str, value: object) -> tuple[int, int]:
    """`--nnodes`: "N" -> (N, N); "MIN:MAX" (torchrun's range) -> (MIN, MAX), 1 <= MIN <= MAX;
    else ConfigError(field)."""
    text = str(value).strip()
    if ":" not in text:
        number = positive_int(field, text)
        return number, number
    low, _, high = text.partition(":")
    if not low.strip().isdigit() or not high.strip().isdigit():
        raise ConfigError(field, f"expected N or MIN:MAX with whole numbers, got {value!r}")
    least, most = int(low), int(high)
    if least < 1 or most < least:
        raise ConfigError(field, f"expected 1 <= MIN <= MAX in MIN:MAX, got {value!r}")
    return least, most


def port_number(field: str, value: object) -> int:
    """A TCP port 1..65535, else ConfigError(field)."""
    number = positive_int(field, value)
    if number > 65535:
        raise ConfigError(field, f"port must be <= 65535, got {number}")
    return number


def flag_value(field: str, value: object) -> bool:
    """A boolean setting as a variable writes it: 1/true/yes or 0/false/no."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ConfigError(field, f"expected 1 or 0, got {value!r}")


def host_address() -> str:
    """This host name's address as the resolver gives it (a pod's IP in Kubernetes), else the name."""
    hostname = socket.gethostname()
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return hostname


def worker_command(args: argparse.Namespace) -> tuple[str, ...]:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS`; ConfigError when the script is missing."""
    target = args.training_script
    if args.module:
        return (sys.executable, "-m", target, *args.training_script_args)
    if not os.path.isfile(target):
        raise ConfigError("training_script", f"no such file: {target!r} (a module needs -m)")
    return (sys.executable, target, *args.training_script_args)


def global_rank(config: LaunchConfig, local_rank: int) -> int:
    """RANK of local worker `local_rank`: node I's workers hold ranks I*P .. I*P+P-1."""
    return config.node_rank * config.nproc_per_node + local_rank


def worker_env(config: LaunchConfig, local_rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of local worker `local_rank` (the module docstring lists it)."""
    rank = global_rank(config, local_rank)
    world = config.nnodes * config.nproc_per_node
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node), "GROUP_RANK": str(config.node_rank),
        "GROUP_WORLD_SIZE": str(config.nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(config.master_port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        names.ENV_IN_PLACE: "1", names.ENV_NODE: config.node_name,
        names.ENV_RDZV_HOST: config.rdzv_host, names.ENV_RDZV_PORT: str(config.rdzv_port),
        names.ENV_LAUNCHER_PID: str(os.getpid()),
    })
    optional = {names.ENV_JOIN: "1" if config.join else None,
                names.ENV_START_AT_MIN: "1" if config.start_at_min else None,
                names.ENV_READY_FILE: config.ready_file,
                names.ENV_REFORM_TIMEOUT: None if config.reform_timeout is None else f"{config.reform_timeout:g}",
                names.ENV_MIN_WORLD_SIZE: None if config.min_world_size is None else str(config.min_world_size)}
    for name, value in optional.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def workers(config: LaunchConfig, environ: Mapping[str, str]) -> list[Worker]:
    """The node's `Worker`s, local rank 0 first."""
    return [Worker(rank=global_rank(config, local), local_rank=local,
                   argv=list(config.command), env=worker_env(config, local, environ))
            for local in range(config.nproc_per_node)]
