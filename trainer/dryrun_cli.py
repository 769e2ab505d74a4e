"""`spotguard dry-run`: run the whole path on this machine against simulated reclaims."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from spotguard.config import ConfigError, positive_int
from spotguard.daemon import run_daemon, until_stopped


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dry-run", help="run a training job locally through simulated reclaims and show the timeline",
        description="Start a small local Kubernetes (API, Job controller, scheduler, per simulated node a "
                    "metadata emulator, a node agent and a kubelet) and the supervisor's own controller over it, "
                    "submit the training Job users deploy, inject the scenario's reclaims; print the timeline "
                    "and write report.json and timeline.png. Exits 1 if a deadline was missed or a step lost.")
    p.add_argument("--cloud", choices=("aws", "gcp", "azure", "alibaba"), default=None)
    p.add_argument("--scenario", default=None, help="scenario YAML or spot-trace CSV (default: the embedded one)")
    p.add_argument("--workers", default=None, help="simulated nodes, one rank each")
    p.add_argument("--framework", choices=("ddp", "fsdp2", "deepspeed", "hf", "accelerate", "lightning"), default=None,
                   help="hf / accelerate / lightning: that framework's reference script with its integration "
                        "(accelerate in place; hf, lightning: the restart path)")
    p.add_argument("--membership", choices=("in-place", "restart"), default=None,
                   help="how membership changes happen (default: in place for elastic DDP, FSDP2, DeepSpeed, "
                        "Accelerate jobs)")
    p.add_argument("--policy", choices=("elastic", "fixed"), default=None)
    p.add_argument("--out", default=None, help="run directory (default: runs/dryrun-<time>)")
    p.add_argument("--time-limit", default="600", help="give up after this many seconds (default 600)")
    p.add_argument("--no-live", action="store_true", help="no live progress view (plain log lines)")
    p.add_argument("train_command", nargs=argparse.REMAINDER,
                   help="-- extra arguments for the trainer (spotguard.trainer.train)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotguard.trainer.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
        workers = None if args.workers is None else positive_int("--workers", args.workers)
        scenario = scenario.with_overrides(cloud=args.cloud, workers=workers, framework=args.framework,
                                           policy=args.policy, membership=args.membership)
    except ScenarioError as exc:
        raise ConfigError("--scenario", str(exc)) from None
    if scenario.min_workers > scenario.workers:
        scenario = scenario.with_overrides(min_workers=scenario.workers)
    time_limit = positive_int("--time-limit", args.time_limit)
    extra = list(args.train_command)
    if extra and extra[0] == "--":
        extra = extra[1:]
    run_dir = usable_run_dir(Path(args.out or f"runs/dryrun-{time.strftime('%Y%m%d-%H%M%S')}").resolve())
    live = not args.no_live and sys.stdout.isatty()
    return run_daemon(lambda stop: _run(scenario, run_dir, extra, time_limit, live, stop))


def usable_run_dir(run_dir: Path) -> Path:
    """`run_dir`, created, once it is a folder this user can write; else ConfigError("--out")
    naming the path and why (before anything starts)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("--out", f"{run_dir} exists and is not a folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--out", f"cannot create {run_dir}: {exc.strerror or exc}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"{run_dir} is not writable")
    return run_dir


async def _run(scenario, run_dir: Path, extra: list[str], time_limit: int, live: bool, stop: asyncio.Event) -> int:
    from spotguard.trainer.dryrun import DryRun, write_outputs
    from spotguard.trainer.local_cluster import DEFAULT_TIMINGS
    from spotguard.trainer.progress import LiveView
    from spotguard.trainer.report import render_text

    logging.basicConfig(level=logging.INFO if not live else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aiohttp", "spotguard.agent", "spotguard.hooks"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    print(f"spotguard dry-run: scenario {scenario.name!r} on {scenario.cloud}, {scenario.workers} workers, "
          f"{scenario.framework}, {scenario.policy} policy; run dir {run_dir}", flush=True)
    print(f"local cluster, quicker than a real one: {DEFAULT_TIMINGS.describe()}", flush=True)
    view = LiveView(scenario) if live else None
    dry = DryRun(scenario, run_dir, extra, on_update=view.update if view else None, time_limit=time_limit)
    with view or contextlib.nullcontext():
        report = await until_stopped(stop, dry.run())  # cancelled, run() stops every process it started
    if report is None:
        print("dry-run interrupted: every process it started was stopped", file=sys.stderr)
        return 130
    report_path, plot_path = write_outputs(report, run_dir)
    print(render_text(report))
    print(f"report: {report_path}\nplot:   {plot_path}")
    return 0 if report["ok"] else 1
