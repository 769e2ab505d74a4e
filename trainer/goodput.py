"""Goodput under a replayed spot trace: the same job and trace run three ways, then compared.

Modes (each one a full local dry-run, `trainer.dryrun.DryRun`, in its own run directory):
- `ideal`: no faults. The scenario without its events, trainer with `--no-guard`: the pure
  training speed every other mode is measured against.
- `periodic`: today's practice. The trainer runs `--no-guard --checkpoint-every K`; when a
  node's reclaim notice appears, the node is drained the way aws-node-termination-handler
  does it: its pod evicted at notice time (`PeriodicDryRun`; the kubelet's SIGTERM). Without the Guard
  the rank dies, its peers fail in their next collective, and the job restarts from the last
  periodic checkpoint at the smaller world size (the supervisor decides it, as in every mode).
- `spotguard`: the normal dry-run: notice -> agreed step -> checkpoint -> drain -> resume.
  Spot only: a reclaimed node's place stays empty until the trace returns capacity.
- `spotguard-backfill`: the same, with on-demand backfill (`trainer.backfill_run`): a warm
  standby for each reclaim, on-demand replicas after `fallback_after`, and each on-demand
  member swapped back for spot in place once spot has been free for `return_after`. Its
  on-demand share of node-hours comes from the memberships it pushed.

Every mode gets the same trainer flags plus `--log-every=1`, so the steps each generation
reached are known exactly. Accounting (`summarize`), from the trainers' event logs:
- a generation keeps the steps from where it started to where the next one resumed; the
  rest of what it computed is lost;
- a generation's loss is put on a reclaim when a reclaim hit one of its nodes while it was
  live (until its last event when it finished or drained, else until the next one was
  launched), otherwise on a rescale (capacity returning: the job restarts to grow);
- wall time runs from the first `start` event to the `finished` one;
- goodput (steps) = completed steps per second; goodput (samples) = samples of kept steps
  per second (the elastic job trains on fewer samples per step at a smaller world size, so
  this one also shows the capacity the trace took away, which no handler can recover).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from spotguard.trainer.backfill_run import BackfillDryRun
from spotguard.trainer.backfill_timeline import summarize_joiners
from spotguard.trainer.dryrun import DryRun
from spotguard.kube.api import PODS, NotFound
from spotguard.trainer.cluster.job_pods import epoch
from spotguard.trainer.job_manifest import NAMESPACE
from spotguard.trainer.report import GenerationRecord, InjectedEvent
from spotguard.trainer.scenario import Scenario

log = logging.getLogger("spotguard.goodput")

MODES = ("ideal", "periodic", "spotguard-restart", "spotguard", "spotguard-backfill")
TRAIN_FLAGS = ["--log-every=1"]  # exact per-step progress in every mode
# The Guard's modes save once after their first step, so every rank that started the job has a
# save estimate before any notice (the replacement hold holds only with one).
GUARD_FLAGS = ["--checkpoint-first"]
DRAIN_KINDS = ("reclaim",)  # notices the termination handler drains a node for
STEP_EVENTS = ("start", "step", "agreed", "durable", "finished")


@dataclass
class Eviction:
    """One drain the periodic baseline's termination handler carried out."""

    number: int
    node: str
    notice_id: str
    at: float  # wall clock
    pods: list[str] = field(default_factory=list)
    survivors_stopped: bool = False


class PeriodicDryRun(DryRun):
    """Today's practice: periodic checkpoints, and a node's pods evicted at notice time.

    The termination handler sees the same notices the agent serves (it polls the same metadata)
    and drains the noticed node the way aws-node-termination-handler does: it evicts the job's
    pod there (the eviction API: `DisruptionTarget`, then deletion; its kubelet sends SIGTERM),
    once per notice, and, if the other pods have not failed by themselves within
    `survivor_grace` seconds, evicts them too (torchrun would restart them on the membership
    change).
    """

    def __init__(self, scenario: Scenario, run_dir: Path, checkpoint_every: int,
                 train_argv_extra: list[str] | None = None, survivor_grace: float = 10.0, **kwargs: Any):
        if checkpoint_every <= 0:
            raise ValueError("checkpoint_every must be > 0 for the periodic baseline")
        # Today's practice relaunches on every change: torchrun, no Guard, nothing in place.
        baseline = dataclasses.replace(scenario, checkpoint_every=checkpoint_every, membership="restart")
        super().__init__(baseline, run_dir, ["--no-guard", *(train_argv_extra or [])], **kwargs)
        self.shape.inject = False  # no sidecar either: its preStop would hold the drain for a notice
        self.survivor_grace = survivor_grace
        self.evictions: list[Eviction] = []
        self._drained_ids: set[str] = set()

    async def on_tick(self) -> None:
        now = time.time()
        for name, node in self.nodes.items():
            for notice in node.live_notices():
                if notice.kind.value in DRAIN_KINDS and notice.id not in self._drained_ids:
                    self._drained_ids.add(notice.id)
                    log.info("termination handler: %s notice on %s: evicting its pods", notice.kind.value, name)
                    evicted = self._evict(lambda pod, name=name: pod["spec"].get("nodeName") == name)
                    self.evictions.append(Eviction(len(self.evictions), name, notice.id, now, evicted))
        for eviction in self.evictions:
            if not eviction.survivors_stopped and now - eviction.at > self.survivor_grace:
                eviction.survivors_stopped = True
                survivors = self._evict(lambda pod, at=eviction.at: _started_before(pod, at))
                if survivors:
                    log.info("termination handler: %d pods still running %.0fs after the eviction: evicting them",
                             len(survivors), self.survivor_grace)

    def report(self, finished_at: float) -> dict:
        """The report, each generation that crashed after a drain hit it (no Guard to save it) and
        before the next one launched marked `evicted`."""
        report = super().report(finished_at)
        generations = report["generations"]
        ends = [g["launched_at"] for g in generations[1:]] + [finished_at]
        evicted = {g["index"] for g, end in zip(generations, ends) if g["reason"] == "crashed"
                   and any(g["launched_at"] <= e.at <= end for e in self.evictions)}
        for row in [*generations, *report["relaunches"]]:
            if row.get("index", row.get("generation")) in evicted:
                row["reason"] = "evicted"
        return report

    def _evict(self, chosen) -> list[str]:
        """Evicts the job's running pods `chosen(pod)` picks; their names."""
        kube, out = self.cluster.kube, []
        for pod in self.cluster.pods():
            if (pod.get("status") or {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp") \
                    or not chosen(pod):
                continue
            conditions = [*(pod["status"].get("conditions") or []), {
                "type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
            try:
                kube.patch(PODS, NAMESPACE, pod["metadata"]["name"], {"status": {"conditions": conditions}},
                           status=True)
                kube.delete(PODS, NAMESPACE, pod["metadata"]["name"])
            except NotFound:
                continue
            out.append(pod["metadata"]["name"])
        return out


def _started_before(pod: dict, at: float) -> bool:
    started = (pod.get("status") or {}).get("startTime")
    return bool(started) and epoch(started) <= at


@dataclass
class ModeResult:
    """What one mode did, in the units the comparison needs (times in seconds)."""

    mode: str
    status: str
    total_steps: int
    steps_completed: int
    wall_s: float
    useful_samples: int
    reclaims_injected: int = 0
    reclaims_hit: int = 0  # reclaims of a node the running job was using
    leads_s: list[float] = field(default_factory=list)
    lost_on_reclaims: list[int] = field(default_factory=list)  # per generation ended by a reclaim
    lost_on_rescales: int = 0
    restarts: int = 0
    restart_gap_s: float = 0.0  # time between a generation's last step and the next one's start
    in_place: int = 0  # membership changes made in place (no relaunch)
    in_place_pause_s: float = 0.0  # the survivors' pauses of those changes, summed
    spot_node_s: float = 0.0  # member-seconds on spot nodes (backfill mode only)
    on_demand_node_s: float = 0.0  # member-seconds on on-demand nodes (backfill mode only)
    joiner_waits_s: list[float] = field(default_factory=list)  # backfill: admitted joiners' start -> admitted
    joiners: dict[str, Any] = field(default_factory=dict)  # backfill: `backfill_timeline.summarize_joiners`
    below_max_s: dict[str, float] = field(default_factory=dict)  # backfill: replica-s below max, by cause
    run_dir: str = ""

    @property
    def finished(self) -> bool:
        return self.steps_completed >= self.total_steps

    @property
    def steps_lost_reclaims(self) -> int:
        return sum(self.lost_on_reclaims)

    @property
    def lost_per_reclaim(self) -> float:
        return self.steps_lost_reclaims / self.reclaims_hit if self.reclaims_hit else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps_completed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.useful_samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def on_demand_share(self) -> float | None:
        """On-demand node-hours / all node-hours; None where nodes were not split by type."""
        total = self.spot_node_s + self.on_demand_node_s
        return self.on_demand_node_s / total if total > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "finished": self.finished,
                "steps_lost_reclaims": self.steps_lost_reclaims, "lost_per_reclaim": self.lost_per_reclaim,
                "steps_per_s": self.steps_per_s, "samples_per_s": self.samples_per_s,
                "on_demand_share": self.on_demand_share}


def summarize(mode: str, events: Iterable[dict], generations: list[GenerationRecord],
              injected: list[InjectedEvent], total_steps: int, status: str = "", run_dir: str = "") -> ModeResult:
    """Steps kept and lost, reclaims hit, wall time and useful samples of one finished dry-run."""
    events = list(events)
    by_gen: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_gen[int(e.get("generation", 0))].append(e)
    started = [g for g in generations if any(e["event"] == "start" for e in by_gen[g.index])]
    start_step = {g.index: min(e["step"] for e in by_gen[g.index] if e["event"] == "start") for g in started}
    start_t = {g.index: min(e["t"] for e in by_gen[g.index] if e["event"] == "start") for g in started}
    batch = {g.index: next((e.get("global_batch", 0) for e in by_gen[g.index] if e["event"] == "start"), 0)
             for g in started}
    reached = {g.index: max(e["step"] for e in by_gen[g.index] if e["event"] in STEP_EVENTS) for g in started}
    last_t = {g.index: max(e["t"] for e in by_gen[g.index] if e["event"] in STEP_EVENTS) for g in started}
    finished = [e for e in events if e["event"] == "finished"]
    t0 = min(start_t.values(), default=0.0)
    t_end = max((e["t"] for e in finished), default=max((e["t"] for e in events), default=t0))
    completed = max((e["step"] for e in finished), default=max(reached.values(), default=0))

    reclaims = [i for i in injected if i.kind == "reclaim" and (i.served_at or i.injected_at) <= t_end]
    hit_gens: dict[int, int] = collections.Counter()
    # A generation that finished or drained ended with its last event; one that crashed (the
    # baseline's eviction) may have run on silently until the next one was launched: its ranks in
    # a periodic save log nothing, and a notice after their last event still hit it (ci, df11f57).
    until = {g.index: g.ended_at if g.reason in ("finished", "drained") or nxt is None else nxt.launched_at
             for g, nxt in zip(generations, [*generations[1:], None])}
    for r in reclaims:  # a hit: a generation using the node ran at some time between its notice and its deadline
        served = r.served_at or r.injected_at
        gone = max(served, r.deadline or served)
        live = [g for g in generations if g.launched_at <= gone and (until[g.index] is None or served <= until[g.index])
                and r.node in g.nodes]
        if live:
            hit_gens[live[-1].index] += 1

    result = ModeResult(mode, status, total_steps, completed, round(t_end - t0, 3), 0, run_dir=run_dir,
                        reclaims_injected=len(reclaims), reclaims_hit=sum(hit_gens.values()),
                        leads_s=[round(r.deadline - (r.served_at or r.injected_at), 3) for r in reclaims
                                 if r.deadline is not None])
    for here, nxt in zip(started, [*started[1:], None]):
        kept_end = start_step[nxt.index] if nxt is not None else reached[here.index]
        changes = in_place_changes(by_gen[here.index])
        result.useful_samples += segment_samples(start_step[here.index], min(kept_end, reached[here.index]),
                                                 batch[here.index], changes)
        for change in changes:
            result.in_place += 1
            result.in_place_pause_s += change["pause"]
            if change.get("reason") != "membership":  # a reclaim answered in place: the survivors lost nothing
                result.lost_on_reclaims.append(0)
        if nxt is None:
            continue
        lost = max(0, reached[here.index] - kept_end)
        result.restarts += 1
        result.restart_gap_s += max(0.0, start_t[nxt.index] - last_t[here.index])
        if hit_gens.get(here.index):
            result.lost_on_reclaims.append(lost)
        else:
            result.lost_on_rescales += lost
    result.restart_gap_s = round(result.restart_gap_s, 3)
    result.in_place_pause_s = round(result.in_place_pause_s, 3)
    return result


def in_place_changes(events: list[dict]) -> list[dict]:
    """One generation's in-place changes (`resized` events), one per change: the slowest rank's
    pause, in step order."""
    by_step: dict[int, dict] = {}
    for e in events:
        if e["event"] == "resized" and e.get("path") == "in-place":
            seen = by_step.setdefault(e["step"], dict(e))
            seen["pause"] = max(seen.get("pause", 0.0), e.get("pause", 0.0))
    return [by_step[k] for k in sorted(by_step)]


def segment_samples(first: int, last: int, batch: int, changes: list[dict]) -> int:
    """Samples of steps first..last of one generation whose global batch started at `batch` and
    follows the world size at each in-place change (in-place jobs are elastic: `scale-lr` keeps
    each rank's batch)."""
    total, step, size = 0, first, batch
    for change in changes:
        at = min(max(change["step"], step), last)
        total += (at - step) * size
        if change.get("from_world"):
            size = size * change["to_world"] // change["from_world"]
        step = at
    return total + max(0, last - step) * size


@dataclass(frozen=True)
class BackfillOptions:
    """The backfill mode's settings, in replay seconds."""

    fallback_after: float = 4.0
    return_after: float = 10.0
    on_demand_max: int | None = None


async def run_mode(mode: str, scenario: Scenario, run_dir: Path, checkpoint_every: int = 100,
                   time_limit: float = 600.0, train_argv_extra: list[str] | None = None,
                   backfill: BackfillOptions = BackfillOptions()) -> ModeResult:
    """Runs `scenario` in `mode` (one of MODES) under `run_dir/mode` (its report.json too); returns its summary."""
    extra = [*TRAIN_FLAGS, *(train_argv_extra or [])]
    where = run_dir / mode
    if mode == "ideal":
        dry: DryRun = DryRun(dataclasses.replace(scenario, events=()), where, ["--no-guard", *extra],
                             time_limit=time_limit)
    elif mode == "periodic":
        dry = PeriodicDryRun(scenario, where, checkpoint_every, extra, time_limit=time_limit)
    elif mode == "spotguard-restart":  # every change relaunches every rank (DeepSpeed's path; the old default)
        dry = DryRun(dataclasses.replace(scenario, membership="restart"), where, extra, time_limit=time_limit)
    elif mode == "spotguard":
        dry = DryRun(scenario, where, [*GUARD_FLAGS, *extra], time_limit=time_limit)
    elif mode == "spotguard-backfill":
        dry = BackfillDryRun(scenario, where, [*GUARD_FLAGS, *extra], time_limit=time_limit,
                             fallback_after=backfill.fallback_after, return_after=backfill.return_after,
                             on_demand_max=backfill.on_demand_max)
    else:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    report = await dry.run()
    (where / "report.json").write_text(json.dumps(report, indent=2, default=str))
    events, generations = dry.trainer_events()
    result = summarize(mode, events, generations, dry.injected, scenario.steps,
                       status=report.get("status", ""), run_dir=str(where))
    if isinstance(dry, BackfillDryRun):
        until = max((e["t"] for e in events if e["event"] == "finished"), default=time.time())
        since = min((e["t"] for e in events if e["event"] == "start"), default=until)
        split = dry.node_seconds(since, until)
        result.spot_node_s, result.on_demand_node_s = split["spot"], split["on-demand"]
        result.joiner_waits_s = dry.joiner_waits()
        result.joiners = summarize_joiners(dry.joiners)
        result.below_max_s = dry.below_max(since, until)
    return result


@dataclass
class Comparison:
    """The modes side by side, goodput relative to the ideal run, and the goals."""

    results: dict[str, ModeResult]
    min_lead_s: float = 3.0  # a notice at least this long is "long enough" for a fresh save

    def goodput(self, mode: str, unit: str = "steps") -> float | None:
        ideal = self.results.get("ideal")
        mine = self.results.get(mode)
        if ideal is None or mine is None:
            return None
        base = ideal.steps_per_s if unit == "steps" else ideal.samples_per_s
        value = mine.steps_per_s if unit == "steps" else mine.samples_per_s
        return value / base if base > 0 else None

    def goals(self) -> list[tuple[str, bool | None, str]]:
        """(goal, met (None: not measured), the figure) for each goal of the benchmark."""
        out: list[tuple[str, bool | None, str]] = []
        sg = self.results.get("spotguard")
        if sg is not None:
            long_enough = all(lead >= self.min_lead_s for lead in sg.leads_s)
            met = sg.steps_lost_reclaims == 0 if long_enough else None
            out.append((f"spotguard loses 0 steps per reclaim with >= {self.min_lead_s:g}s notice", met,
                        f"{sg.steps_lost_reclaims} lost over {sg.reclaims_hit} reclaims"
                        + ("" if long_enough else " (some notices were shorter)")))
            g = self.goodput("spotguard")
            out.append(("spotguard goodput >= 0.97 of ideal", None if g is None else g >= 0.97,
                        "-" if g is None else f"{g:.3f}"))
            base = self.goodput("periodic")
            out.append(("spotguard goodput > periodic baseline", None if g is None or base is None else g > base,
                        "-" if g is None or base is None else f"{g:.3f} vs {base:.3f}"))
        bf = self.results.get("spotguard-backfill")
        if bf is not None:
            gs = self.goodput("spotguard-backfill", "samples")
            spot_only = self.goodput("spotguard", "samples")
            share = bf.on_demand_share
            out.append(("backfill samples >= 0.97 of always-full (ideal)", None if gs is None else gs >= 0.97,
                        ("-" if gs is None else f"{gs:.3f}")
                        + ("" if spot_only is None else f" (spot only {spot_only:.3f})")
                        + ("" if share is None else f", on-demand share of node-hours {share:.3f}")))
            out.append(("backfill loses 0 steps", bf.steps_lost_reclaims + bf.lost_on_rescales == 0,
                        f"{bf.steps_lost_reclaims + bf.lost_on_rescales} lost"))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"modes": {m: {**r.as_dict(), "goodput_steps": self.goodput(m),
                              "goodput_samples": self.goodput(m, "samples")} for m, r in self.results.items()},
                "goals": [{"goal": g, "met": met, "figure": fig} for g, met, fig in self.goals()]}


def across_rounds(rounds: list[Comparison]) -> list[str]:
    """Lines a person reads: each mode's goodput (steps, samples: each round against its own
    ideal run) in every round with the median and the minimum, and its restarts by round."""
    out = []
    for mode in rounds[0].results:
        if mode == "ideal":
            continue
        for unit in ("steps", "samples"):
            values = [c.goodput(mode, unit) for c in rounds]
            if any(v is None for v in values):
                continue
            ordered = sorted(v for v in values if v is not None)
            out.append(f"{mode} goodput ({unit}) by round: {' / '.join(f'{v:.3f}' for v in values if v is not None)}; "
                       f"median {ordered[len(ordered) // 2]:.3f}, min {ordered[0]:.3f}")
        out.append(f"{mode} restarts by round: {' / '.join(str(c.results[mode].restarts) for c in rounds)}")
    return out


def render(comparison: Comparison) -> str:
    """The comparison as a table and goal lines a person reads."""
    head = (f"{'mode':<18} {'done':>9} {'reclaims':>8} {'lost/recl':>9} {'lost recl':>9} {'lost resc':>9} "
            f"{'restarts':>8} {'gaps s':>7} {'in place':>8} {'pause s':>7} {'wall s':>7} {'steps/s':>7} "
            f"{'goodput':>7} {'samples':>7} {'od share':>8}")
    lines = [head, "-" * len(head)]
    for mode, r in comparison.results.items():
        g, gs = comparison.goodput(mode), comparison.goodput(mode, "samples")
        share = r.on_demand_share
        lines.append(f"{mode:<18} {r.steps_completed:>4}/{r.total_steps:<4} {r.reclaims_hit:>8} "
                     f"{r.lost_per_reclaim:>9.1f} {r.steps_lost_reclaims:>9} {r.lost_on_rescales:>9} "
                     f"{r.restarts:>8} {r.restart_gap_s:>7.1f} {r.in_place:>8} {r.in_place_pause_s:>7.2f} "
                     f"{r.wall_s:>7.1f} {r.steps_per_s:>7.2f} "
                     f"{'-' if g is None else f'{g:.3f}':>7} {'-' if gs is None else f'{gs:.3f}':>7} "
                     f"{'-' if share is None else f'{share:.3f}':>8}")
    lines.append("")
    for goal, met, figure in comparison.goals():
        mark = "n/a " if met is None else ("MET " if met else "MISS")
        lines.append(f"[{mark}] {goal}: {figure}")
    return "\n".join(lines)
