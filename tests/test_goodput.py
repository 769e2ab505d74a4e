"""The goodput benchmark's library: its accounting, and every mode on a small trace replay."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from spotguard.trainer.events import read_events
from spotguard.trainer.goodput import MODES, Comparison, ModeResult, across_rounds, run_mode, summarize
from spotguard.trainer.report import GenerationRecord, InjectedEvent
from spotguard.trainer.rounds import rounds
from spotguard.trainer.scenario import find_trace, scenario_from_trace

# 15.5 minutes of the bundled AWS p3 trace (from uclasystem/bamboo, MIT), t=15270..16200, on 2 slots:
# node33 and node36 are live at the start and hold the slots; node36 is preempted at t=16020.
TRACE = find_trace("aws-p3-bamboo")
CHECKPOINT_EVERY = 40
STEPS = 120


def ev(t, event, gen, step, rank=0, **extra):
    return {"t": t, "event": event, "generation": gen, "rank": rank, "step": step, **extra}


def test_summarize_keeps_lost_and_attributes_steps():
    gens = [GenerationRecord(0, 2, ["node-0", "node-1"], launched_at=90.0, ended_at=110.0),
            GenerationRecord(1, 1, ["node-1"], launched_at=110.0, ended_at=130.0),
            GenerationRecord(2, 2, ["node-0", "node-1"], launched_at=130.0, ended_at=150.0)]
    events = [ev(100.0, "start", 0, 0, global_batch=32), ev(105.0, "step", 0, 57),
              ev(112.0, "start", 1, 50, global_batch=16), ev(120.0, "step", 1, 80),  # rescale drains at 80
              ev(133.0, "start", 2, 80, global_batch=32), ev(140.0, "finished", 2, 100)]
    injected = [InjectedEvent("reclaim", "node-0", 5.0, 104.0, served_at=104.0, deadline=114.0),
                InjectedEvent("capacity", "node-0", 15.0, 118.0, served_at=118.0),
                InjectedEvent("reclaim", "node-1", 60.0, 160.0, served_at=160.0, deadline=170.0)]  # after the end
    r = summarize("periodic", events, gens, injected, total_steps=100)
    assert r.finished and r.steps_completed == 100
    assert r.wall_s == 40.0
    assert (r.reclaims_injected, r.reclaims_hit, r.leads_s) == (1, 1, [10.0])
    assert r.lost_on_reclaims == [7] and r.lost_on_rescales == 0
    assert r.restarts == 2 and r.restart_gap_s == (112.0 - 105.0) + (133.0 - 120.0)
    assert r.useful_samples == 50 * 32 + 30 * 16 + 20 * 32


def test_a_reclaim_served_while_the_group_still_starts_hits_it():
    """The notice came at 2.5 s, while the job's containers still started (launched at 3 s, under
    load); the node went at its deadline, 7.5 s, in the middle of training: the reclaim hit that
    generation (a CI run counted 0 hits: it read only the moment the notice was served)."""
    gens = [GenerationRecord(0, 2, ["node-0", "node-1"], launched_at=3.0, ended_at=8.0),
            GenerationRecord(1, 1, ["node-0"], launched_at=9.0, ended_at=20.0)]
    events = [ev(3.5, "start", 0, 0, global_batch=32), ev(7.4, "step", 0, 21),
              ev(9.5, "start", 1, 0, global_batch=16), ev(19.0, "finished", 1, 120)]
    injected = [InjectedEvent("reclaim", "node-1", 2.5, 2.5, served_at=2.5, deadline=7.5)]
    r = summarize("periodic", events, gens, injected, total_steps=120)
    assert (r.reclaims_injected, r.reclaims_hit) == (1, 1)
    late = [InjectedEvent("reclaim", "node-1", 2.0, 2.0, served_at=2.0, deadline=2.9)]  # gone before the launch
    assert summarize("periodic", events, gens, late, total_steps=120).reclaims_hit == 0


def test_a_reclaim_served_while_the_group_saves_silently_hits_it():
    """Generation 0 logged its last step (40) at 2.4 s and was in its periodic save when the notice
    came at 2.63 s; it never logged again (evicted), and generation 1 launched at 11.4 s: the
    reclaim hit generation 0 (ci on df11f57 counted 0 hits: it read the last event as its end). A
    generation that finished or drained before a notice is not hit by it."""
    gens = [GenerationRecord(0, 2, ["node-0", "node-1"], launched_at=-20.0, ended_at=2.4, reason="crashed"),
            GenerationRecord(1, 1, ["node-0"], launched_at=11.4, ended_at=33.0, reason="finished")]
    events = [ev(0.0, "start", 0, 0, global_batch=32), ev(2.4, "step", 0, 40),
              ev(28.7, "start", 1, 40, global_batch=16), ev(33.0, "finished", 1, 120)]
    injected = [InjectedEvent("reclaim", "node-1", 2.5, 2.6, served_at=2.63, deadline=7.63)]
    r = summarize("periodic", events, gens, injected, total_steps=120)
    assert (r.reclaims_hit, r.restarts, r.lost_on_reclaims) == (1, 1, [0])
    done = [GenerationRecord(0, 2, ["node-0", "node-1"], launched_at=-20.0, ended_at=2.4, reason="finished")]
    finished = [ev(0.0, "start", 0, 0, global_batch=32), ev(2.4, "finished", 0, 40)]
    assert summarize("periodic", finished, done, injected, total_steps=40).reclaims_hit == 0
    drained = [GenerationRecord(0, 2, ["node-0", "node-1"], launched_at=-20.0, ended_at=2.4, reason="drained"),
               gens[1]]  # its ranks left at their drain (2.4 s): a notice after it hit nothing running
    assert summarize("periodic", events, drained, injected, total_steps=120).reclaims_hit == 0


def test_goals_compare_against_ideal_and_baseline():
    def result(mode, wall, lost):
        return ModeResult(mode, "finished", 100, 100, wall, 3200, reclaims_hit=1, leads_s=[10.0],
                          lost_on_reclaims=[lost])
    comparison = Comparison({"ideal": result("ideal", 10.0, 0), "periodic": result("periodic", 20.0, 30),
                             "spotguard": result("spotguard", 10.2, 0)})
    assert comparison.goodput("spotguard") == pytest.approx(10.0 / 10.2)
    assert [met for _, met, _ in comparison.goals()] == [True, True, True]
    comparison.results["spotguard"] = result("spotguard", 25.0, 2)
    assert [met for _, met, _ in comparison.goals()] == [False, False, False]
    comparison.results["spotguard"].leads_s = [1.0]  # too short for a fresh save: not judged
    assert comparison.goals()[0][1] is None


def test_backfill_goals_and_on_demand_share():
    """The backfill mode's lines: samples vs always-full beside spot only, its on-demand share."""
    def result(mode, samples, **extra):
        return ModeResult(mode, "finished", 100, 100, 10.0, samples, **extra)
    comparison = Comparison({"ideal": result("ideal", 3200), "spotguard": result("spotguard", 2800),
                             "spotguard-backfill": result("spotguard-backfill", 3150, spot_node_s=30.0,
                                                          on_demand_node_s=10.0)})
    assert comparison.results["spotguard-backfill"].on_demand_share == pytest.approx(0.25)
    assert comparison.results["spotguard"].on_demand_share is None  # not split by capacity type
    goals = {goal: (met, figure) for goal, met, figure in comparison.goals()}
    met, figure = goals["backfill samples >= 0.97 of always-full (ideal)"]
    assert met and "0.984" in figure and "spot only 0.875" in figure and "share of node-hours 0.250" in figure
    assert goals["backfill loses 0 steps"][0] is True
    comparison.results["spotguard-backfill"].useful_samples = 3000
    assert comparison.goals()[-2][1] is False


@pytest.mark.timeout(600)
async def test_every_mode_replays_a_trace_window(tmp_path):
    scenario = scenario_from_trace(TRACE.read_text(), origin=str(TRACE), workers=2, time_scale=300.0,
                                   start=15270.0, window=930.0, lead=5.0, steps=STEPS, step_seconds=0.05)
    assert [(e.kind, e.node) for e in scenario.events] == [("reclaim", "node-1")]
    # The backfill mode's dry-run is tests/test_backfill_dryrun.py's (here it would add ~30 s of CI).
    # The modes run at once, each its own local cluster (ports, folders, processes): most of a
    # dry-run is waiting, and one after the other they held a CI worker for ~100-175 s.
    modes = [mode for mode in MODES if mode != "spotguard-backfill"]
    runs = [run_mode(mode, scenario, tmp_path, checkpoint_every=CHECKPOINT_EVERY, time_limit=300) for mode in modes]
    results = dict(zip(modes, await asyncio.gather(*runs), strict=True))

    for mode, r in results.items():
        assert r.finished, f"{mode}: {r.steps_completed}/{STEPS} steps ({r.status})"
    assert results["ideal"].reclaims_injected == 0 and results["ideal"].restarts == 0

    periodic = results["periodic"]
    assert periodic.reclaims_hit == 1 and periodic.restarts == 1
    report = json.loads((tmp_path / "periodic" / "report.json").read_text())
    assert report["generations"][0]["reason"] == "evicted"  # SIGTERM at notice time, no Guard to save it
    events = numbered(tmp_path / "periodic")
    assert not [e for e in events if e["event"] in ("agreed", "durable")]
    resumed = [e["step"] for e in events if e["event"] == "start" and e["generation"] == 1]
    assert resumed and all(s % CHECKPOINT_EVERY == 0 for s in resumed)  # back to a periodic checkpoint

    relaunched = results["spotguard-restart"]
    assert relaunched.reclaims_hit == 1 and relaunched.leads_s == [5.0]
    assert relaunched.lost_on_reclaims == [0] and relaunched.restarts == 1 and relaunched.in_place == 0
    events = numbered(tmp_path / "spotguard-restart")
    durable = [e for e in events if e["event"] == "durable" and e["generation"] == 0]
    assert durable and {e["step"] for e in durable} == {
        min(e["step"] for e in events if e["event"] == "start" and e["generation"] == 1)}

    guarded = results["spotguard"]  # in place: the survivor never restarts
    assert guarded.reclaims_hit == 1 and guarded.leads_s == [5.0]
    assert guarded.lost_on_reclaims == [0] and guarded.restarts == 0 and guarded.in_place == 1
    events = list(read_events(tmp_path / "spotguard" / "events"))
    durable = [e for e in events if e["event"] == "durable"]
    resized = [e for e in events if e["event"] == "resized"]
    assert resized and {e["step"] for e in resized} == {e["step"] for e in durable}


def numbered(run: Path) -> list[dict]:
    """The run's trainer events with `generation` the group they belong to, as the report numbers
    them (trainer/rounds.py). The raw field is the container's launch epoch, which stays 0 when the
    relaunch's container starts while one of the old group's still exits (seen under load)."""
    return rounds(read_events(run / "events"))[0]


def test_rounds_are_each_compared_with_their_own_ideal_run():
    """Each round's ratio uses that round's ideal (a drift of the load between rounds cancels), and
    the summary gives every round, the median and the minimum."""
    def result(mode, wall, restarts=0):
        return ModeResult(mode, "finished", 100, 100, wall, 3200, restarts=restarts)
    rounds = [Comparison({"ideal": result("ideal", 10.0), "spotguard-backfill": result("spotguard-backfill", 10.5)}),
              Comparison({"ideal": result("ideal", 20.0), "spotguard-backfill": result("spotguard-backfill", 20.0)}),
              Comparison({"ideal": result("ideal", 10.0),
                          "spotguard-backfill": result("spotguard-backfill", 12.5, restarts=1)})]
    lines = across_rounds(rounds)
    assert lines == ["spotguard-backfill goodput (steps) by round: 0.952 / 1.000 / 0.800; median 0.952, min 0.800",
                     "spotguard-backfill goodput (samples) by round: 0.952 / 1.000 / 0.800; median 0.952, min 0.800",
                     "spotguard-backfill restarts by round: 0 / 0 / 1"]
