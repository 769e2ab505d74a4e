"""Goodput: one real spot trace replayed three ways (ideal, periodic checkpoints + SIGTERM, spotguard).

    .venv/bin/python bench/goodput.py                      # default window, ~7 minutes
    .venv/bin/python bench/goodput.py --plan               # only print the replayed events
    .venv/bin/python bench/goodput.py --steps 2500         # same events, a ~4 min job: ~15 minutes

A window of a spot availability trace (`t_seconds,event,node`; `--trace` takes a bundled name
from trainer/traces/ or any file) is mapped onto `--workers` local slots and compressed
`--time-scale` times (`trainer.scenario.scenario_from_trace`): the nodes live at `--start` hold
the slots first (in order of their add), then every trace preempt of a node holding a slot becomes
a reclaim notice with `--lead` seconds of warning, every add that finds a free slot becomes
capacity returning. The same job (same steps, same step time, same trace) then runs as a full
local dry-run in each mode (`trainer.goodput`):
  ideal      no faults, no Guard: the speed to compare against;
  periodic   today's practice: `--no-guard --checkpoint-every K`, SIGTERM to the noticed node's
             pod at notice time (as aws-node-termination-handler drains), restart from the
             last periodic checkpoint at the smaller world size;
  spotguard-restart  the dry-run relaunching every rank at each change (agreed checkpoint at
             notice, drain, resume): DeepSpeed's path, and the default before in-place changes;
  spotguard  the normal dry-run: agreed checkpoint at notice, the leaving rank exits, the
             survivors re-form in place; returning capacity joins in place (spot only).
  spotguard-backfill  the same with on-demand backfill (supervisor.backfill's rules on
             `--workers` extra on-demand slots): each reclaim notice starts its replacement at
             once (warm standby), a job below max for `--fallback-after` gets on-demand
             replicas, and each is swapped back for a spot one in place once spot has been
             free for `--return-after`. Printed beside it: its on-demand share of node-hours,
             each joiner's start-up and admission wait, and the replica-seconds it ran below
             max split by cause (`trainer.backfill_timeline`).
Printed per mode: reclaims that hit the job, steps lost per reclaim (mean, total), steps lost
on rescales, restarts and the time between them, wall time, goodput relative to ideal
(completed steps per second / ideal's; and the same in samples of kept steps, which also
counts the capacity the trace took away). Goals: spotguard loses 0 steps per reclaim with a
long enough notice; spotguard goodput >= 0.97 of ideal and above the periodic baseline;
backfill samples >= 0.97 of ideal (always full size) with 0 steps lost.

    .venv/bin/python bench/goodput.py --workers 4 --modes ideal,spotguard,spotguard-backfill
    .venv/bin/python bench/goodput.py --workers 4 --modes ideal,spotguard-backfill --rounds 3
    .venv/bin/python bench/goodput.py --workers 4 --time-scale 10 --steps 2400 \
        --modes ideal,spotguard,spotguard-backfill    # ~15 minutes

At 30x the default window replays in 90 s and a 1000-step job outlives it; at 10x with 2400 steps
the replay and the job are both ~270 s long, and every real-time cost (a pause, a joiner's
start-up on the same cores as the ranks) weighs a third as much against trace time.

`--rounds N` runs the modes N times, one round after another (ideal, backfill, ideal, backfill,
...): each round's ratios compare runs minutes apart, so a drift of the machine's load between
modes weighs less, and the last lines give every round's ratio and their median.

Default trace: aws-p3-bamboo (Bamboo's AWS p3 trace, reused by Oobleck and Parcae; the bundled
traces, their origin and licence: trainer/traces/README.md), the 45 minutes from t=15270 s, 30x
faster. 23 nodes are live there; on 2 slots (node33, node36) it gives 1 reclaim and 1 return
20 s apart (compressed), on 4 slots 3 reclaims and 3 returns. `--plan` shows any window's slots
and events before running it. `--workers` is bounded by the dry-run's global batch (32) and, in
practice, by the machine: every slot is a torchrun and a rank process.
The notice lead is not compressed (detection and the save run in real time); restarts are
not either, so at 30x each one weighs as much as minutes of trace time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from spotguard.wire import names
from spotguard.trainer.goodput import MODES, BackfillOptions, Comparison, across_rounds, render, run_mode
from spotguard.trainer.scenario import (ScenarioError, bundled_traces, find_trace, live_at, parse_trace,
                                        scenario_from_trace, trace_slots_at)

DEFAULT_TRACE = "aws-p3-bamboo"
MAX_WORKERS = 32  # the dry-run's global batch: beyond it a rank would get no sample


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _workers(text: str) -> int:
    value = _positive(int)(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_WORKERS} (the dry-run's global batch), got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return [m for m in MODES if m in modes]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/goodput.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help=f"a bundled trace ({', '.join(bundled_traces())}) or a trace CSV file "
                        f"(default {DEFAULT_TRACE})")
    p.add_argument("--workers", type=_workers, default=2,
                   help=f"local slots, one rank each, 1..{MAX_WORKERS} "
                        "(default 2; each is a torchrun + rank process)")
    p.add_argument("--time-scale", type=_positive(float), default=30.0,
                   help="trace seconds per replay second (default 30)")
    p.add_argument("--start", type=_non_negative, default=15270.0, help="window start in trace seconds (default 15270)")
    p.add_argument("--window", type=_positive(float), default=2700.0,
                   help="window length in trace seconds (default 2700)")
    p.add_argument("--lead", type=_positive(float), default=10.0,
                   help="reclaim notice lead in replay seconds (default 10; not compressed: the save is real time)")
    p.add_argument("--steps", type=_positive(int), default=1000, help="training steps in every mode (default 1000)")
    p.add_argument("--step-seconds", type=_non_negative, default=0.1, help="synthetic time per step (default 0.1)")
    p.add_argument("--checkpoint-every", type=_positive(int), default=100,
                   help="periodic baseline: checkpoint every K steps "
                        "(default 100: 10 s here, 5 min of trace time at 30x)")
    p.add_argument("--fallback-after", type=_positive(float), default=120.0,
                   help="backfill: trace seconds below max before on-demand replicas (default 120)")
    p.add_argument("--return-after", type=_positive(float), default=300.0,
                   help="backfill: trace seconds spot must stay free before a swap-back (default 300)")
    p.add_argument("--on-demand-max", type=_positive(int), default=None,
                   help="backfill: at most this many on-demand replicas (default --workers)")
    p.add_argument("--horizon", type=_positive(float), default=None,
                   help="the Guard's notice horizon in every rank (SPOTGUARD_HORIZON_SECONDS): a rank with a "
                        "notice keeps training until its deadline is this close (default: the Guard's 120 s, "
                        "so a rank leaves at once on the bench's --lead)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help=f"subset of {','.join(MODES)} (default all)")
    p.add_argument("--rounds", type=_positive(int), default=1,
                   help="run the modes this many times, interleaved; each round is compared within itself (default 1)")
    p.add_argument("--time-limit", type=_positive(float), default=420.0, help="per mode, seconds (default 420)")
    p.add_argument("--out", type=Path, default=None, help="keep the run directories here (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this file")
    p.add_argument("--plan", action="store_true", help="print the replayed events and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log the dry-runs' progress")
    return p.parse_args(argv)


class TraceError(ValueError):
    """The trace cannot be read or replayed; the message names the file (and line)."""


def build_scenario(args: argparse.Namespace):
    """(scenario, trace rows, trace path) of the window; TraceError if the trace is missing,
    unreadable (message: `--trace: ...`) or malformed (message: `file:line: field: ...`)."""
    try:
        path = find_trace(args.trace)
        text = path.read_text()
    except ScenarioError as exc:
        raise TraceError(f"--trace: {exc}") from None
    except OSError as exc:
        raise TraceError(f"--trace: cannot read {args.trace} ({exc.strerror})") from None
    try:
        return scenario_from_trace(text, origin=str(path), workers=args.workers, time_scale=args.time_scale,
                                   window=args.window, start=args.start, lead=args.lead, steps=args.steps,
                                   step_seconds=args.step_seconds), parse_trace(text, str(path)), path
    except ScenarioError as exc:
        raise TraceError(str(exc)) from None


def print_plan(args: argparse.Namespace, scenario, rows, path: Path) -> None:
    in_window = [r for r in rows if args.start <= r.t <= args.start + args.window]
    live = live_at(rows, args.start)
    holders = trace_slots_at(rows, args.workers, args.start)
    print(f"trace {path.name}: window {args.start:g}..{args.start + args.window:g} s "
          f"({len(in_window)} trace rows, {sum(r.event == 'preempt' for r in in_window)} preempts) "
          f"-> {args.window / args.time_scale:.1f} s replayed on {args.workers} slots ({scenario.cloud})")
    print(f"job: {scenario.steps} steps x {scenario.step_seconds:g} s, elastic (min 1), periodic baseline "
          f"checkpoints every {args.checkpoint_every} steps")
    print(f"at the start: {len(live)} trace nodes live; slots held by "
          + (", ".join(f"{slot}={node}" for node, slot in holders.items()) or "none")
          + ("" if len(holders) == args.workers else
             f" ({args.workers - len(holders)} slot(s) with no live trace node: the job starts them anyway)"))
    for e in scenario.events:
        lead = f", {e.lead:g}s notice" if e.kind == "reclaim" else ""
        trace_t = args.start + e.at * args.time_scale
        print(f"  t={e.at:6.1f}s  {e.kind:<9} {e.node}{lead}   (trace t={trace_t:.0f}s)")
    if not any(e.kind == "reclaim" for e in scenario.events):
        print("  (no reclaim of a slot in this window: choose another --start/--window)")


async def run_all(args: argparse.Namespace, scenario, run_dir: Path) -> list[Comparison]:
    """One Comparison per round (a round runs every mode once, in `args.modes` order)."""
    backfill = BackfillOptions(fallback_after=args.fallback_after / args.time_scale,
                               return_after=args.return_after / args.time_scale, on_demand_max=args.on_demand_max)
    rounds = []
    for index in range(args.rounds):
        round_dir = run_dir if args.rounds == 1 else run_dir / f"round-{index + 1}"
        results = {}
        for mode in args.modes:
            began = time.monotonic()
            print(f"running {mode}{'' if args.rounds == 1 else f' (round {index + 1})'} ...", flush=True)
            results[mode] = await run_mode(mode, scenario, round_dir, checkpoint_every=args.checkpoint_every,
                                           time_limit=args.time_limit, backfill=backfill)
            r = results[mode]
            print(f"  {mode}: {r.steps_completed}/{r.total_steps} steps, {r.status}, "
                  f"{time.monotonic() - began:.0f} s including set-up", flush=True)
        rounds.append(Comparison(results))
    return rounds


def explain(comparison: Comparison, time_scale: float) -> list[str]:
    """Where each mode's time went compared with ideal, and which limit stands in the way of a goal."""
    out = []
    ideal = comparison.results.get("ideal")
    if ideal is None or ideal.steps_per_s <= 0:
        return out
    step_s = 1.0 / ideal.steps_per_s
    for mode in ("periodic", "spotguard-restart", "spotguard", "spotguard-backfill"):
        r = comparison.results.get(mode)
        if r is None:
            continue
        if not r.finished:
            out.append(f"{mode} did not finish ({r.status}): its goodput counts the steps it completed.")
        redo = (r.steps_lost_reclaims + r.lost_on_rescales) * step_s
        rest = r.wall_s - ideal.wall_s - r.restart_gap_s - redo
        out.append(f"{mode}: {r.wall_s - ideal.wall_s:+.1f} s vs ideal = {r.restarts} restarts {r.restart_gap_s:.1f} s "
                   f"+ {r.steps_lost_reclaims + r.lost_on_rescales} lost steps redone ~{redo:.1f} s "
                   f"+ other {rest:+.1f} s (checkpoints, per-step agreement, load)")
    bf = comparison.results.get("spotguard-backfill")
    if bf is not None and bf.joiner_waits_s:
        waits = sorted(bf.joiner_waits_s)
        j = bf.joiners
        out.append(f"backfill: {len(waits)} joiners admitted, {j.get('stopped', 0)} stopped in their start-up; "
                   f"start to joining {waits[len(waits) // 2]:.1f} s median, max {waits[-1]:.1f} s "
                   f"(start-up to ready {_s(j.get('startup_median_s'))} / {_s(j.get('startup_max_s'))} s, "
                   f"ready to admitted {_s(j.get('admission_median_s'))} / {_s(j.get('admission_max_s'))} s); "
                   f"a joiner of a swap-back costs nothing (the on-demand member trains until it joins).")
    if bf is not None and bf.below_max_s:
        b = bf.below_max_s
        out.append(f"backfill below max: {sum(b.values()):.1f} replica-s = joiners starting up {b['startup']:.1f} "
                   f"+ joiners stopped in their start-up {b['startup_stopped']:.1f} + ready joiners waiting to be "
                   f"admitted {b['admission']:.1f} + no joiner on the way (fallback-after, no capacity) "
                   f"{b['uncovered']:.1f}; in-place pauses {bf.in_place_pause_s:.2f} s (the whole job).")
    sg = comparison.results.get("spotguard")
    if sg is not None and sg.restarts:
        per = sg.restart_gap_s / sg.restarts
        out.append(f"limit: each restart costs {per:.1f} s here (torchrun exit, new torchrun, interpreter + torch "
                   f"import, rendezvous, resume) = {per * time_scale / 60:.1f} min of trace time at {time_scale:g}x; "
                   f"every reclaim and every return of capacity is one restart. 0.97 of ideal allows "
                   f"~{0.03 * ideal.wall_s:.0f} s of restarts in this {ideal.wall_s:.0f} s job: it needs fewer "
                   f"membership changes per minute (a quieter window, less compression), a cheaper relaunch "
                   f"(warm workers, in-place rescale), or a job >= ~{sg.restart_gap_s / 0.03:.0f} s for these events.")
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        scenario, rows, path = build_scenario(args)
    except TraceError as exc:
        print(f"bench/goodput.py: {exc}", file=sys.stderr)
        return 2
    print_plan(args, scenario, rows, path)
    if args.plan:
        return 0
    if args.horizon is not None:  # every rank the dry-runs start inherits it
        os.environ[names.ENV_HORIZON_SECONDS] = f"{args.horizon:g}"
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aiohttp", "spotguard.agent", "spotguard.hooks"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    run_dir = args.out.resolve() if args.out else Path(tempfile.mkdtemp(prefix="spotguard-goodput-"))
    try:
        rounds = asyncio.run(run_all(args, scenario, run_dir))
    finally:
        if args.out is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    for index, comparison in enumerate(rounds):
        print()
        if len(rounds) > 1:
            print(f"round {index + 1} of {len(rounds)}:")
        print(render(comparison))
        for line in explain(comparison, args.time_scale):
            print("  " + line)
    if len(rounds) > 1:
        print()
        for line in across_rounds(rounds):
            print(line)
    if args.json:
        figures = rounds[0].as_dict() if len(rounds) == 1 else {"rounds": [c.as_dict() for c in rounds]}
        args.json.write_text(json.dumps({"scenario": {"trace": str(path), "start": args.start,
                                                      "window": args.window, "time_scale": args.time_scale,
                                                      "lead": args.lead, "workers": args.workers,
                                                      "steps": args.steps, "step_seconds": args.step_seconds,
                                                      "fallback_after": args.fallback_after,
                                                      "return_after": args.return_after,
                                                      "on_demand_max": args.on_demand_max,
                                                      "horizon": args.horizon,
                                                      "checkpoint_every": args.checkpoint_every,
                                                      "rounds": args.rounds},
                                         **figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
