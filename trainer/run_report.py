"""The dry-run's report, assembled from what the run recorded (report.py builds and renders it).

`assemble(...)` derives the generations from the trainers' events (rounds.py), places each
membership the supervisor pushed in the generation it was pushed during, ties each returning
node to what it caused (`tie_capacity`), builds the report and adds what only the run knows:
the supervisor's decisions, the run's status, the events not reached, the local cluster's
timings, and the run's own problems (a rank still training at its node's deadline).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from spotguard.trainer.crashes import Crash
from spotguard.trainer.report import GenerationRecord, InjectedEvent, MembershipRecord, build_report
from spotguard.trainer.rounds import rounds
from spotguard.trainer.scenario import Scenario


def generation_at(generations: list[GenerationRecord], t: float) -> int:
    """The generation running at `t`: the last one launched by then (0 before any)."""
    return max((g.index for g in generations if g.launched_at <= t), default=0)


def tie_capacity(injected: list[InjectedEvent], memberships: list[MembershipRecord], decisions: list[dict],
                 generations: list[GenerationRecord], in_place: bool) -> None:
    """Each node given back gets the first membership after it that adds the node (in place), or
    else the generation that was running when the next scale-out came (it drains to grow)."""
    for inj in injected:
        if inj.kind != "capacity" or not inj.effective:
            continue
        since = inj.served_at or inj.injected_at
        previous: list[str] = []
        for m in memberships if in_place else []:
            if m.t >= since and inj.node in m.hosts and inj.node not in previous:
                inj.membership = m.generation
                break
            previous = m.hosts
        if inj.membership is None:
            grow = next((d for d in decisions if d["t"] >= since and d["action"] == "scale"
                         and d.get("reason") == "CapacityReturned"), None)
            if grow is None:
                continue
            running = next((g for g in generations if g.index == generation_at(generations, grow["t"])), None)
            if running is not None and running.ended_at is not None and running.ended_at < grow["t"]:
                # no group ran: the relaunch already due takes the node in, nothing drains for it
                inj.launched_with = next((g.index for g in generations if g.launched_at >= grow["t"]), None)
                inj.scaled_from = _replicas_before(decisions, grow)
            else:
                inj.rescaled = running.index if running is not None else 0


def _replicas_before(decisions: list[dict], decision: dict) -> int | None:
    """The replicas the last scale before `decision` set."""
    earlier = [d for d in decisions if d["t"] < decision["t"] and d["action"] == "scale" and d.get("replicas")]
    return earlier[-1]["replicas"] if earlier else None


def expectation_problems(scenario: Scenario, report: Mapping[str, Any]) -> list[str]:
    """The scenario's `expect` counts that the run did not meet, each named with what it saw."""
    seen = {"decisions": [f"t={d['t']}s {d['action']}: {d['message']}" for d in report["supervisor_decisions"]],
            "memberships": [f"t={m['t']}s generation {m['generation']} {m['hosts']} ({m['cause']})"
                            for m in report["memberships"]],
            "changes": [f"t={c['t']}s {c['path']} {c['from_world']} -> {c['to_world']} ({c['reason']})"
                        for c in report["membership_changes"]],
            "agreed": [f"{e['kind']} on {e['node']} at t={e['agreed']}s" for e in report["timeline"] if "agreed" in e]}
    labels = {"decisions": "supervisor decisions", "memberships": "memberships pushed",
              "changes": "membership changes of the ranks", "agreed": "notices the ranks agreed on"}
    return [f"expected {count} {labels[what]}, got {len(seen[what])}" + (f": {'; '.join(seen[what])}"
                                                                          if seen[what] else "")
            for what, count in scenario.expect if len(seen[what]) != count]


def assemble(scenario: Scenario, injected: list[InjectedEvent], events: Iterable[dict],
             container_starts: list[tuple[str, float]], memberships: list[MembershipRecord], decisions: list[dict], *,
             started_at: float, finished_at: float, status: str, not_reached: int, problems: list[str],
             timings: str, crash: Crash | None = None) -> dict[str, Any]:
    """See the module docstring."""
    relabeled, generations = rounds(events, container_starts)
    memberships = [dataclasses.replace(m, launch=generation_at(generations, m.t)) for m in memberships]
    tie_capacity(injected, memberships, decisions, generations, scenario.in_place)
    report = build_report(dataclasses.asdict(scenario), injected, generations, relabeled, started_at, finished_at,
                          scenario.steps, memberships=memberships, in_place=scenario.in_place,
                          min_workers=scenario.min_workers, allowed_steps_lost=scenario.allow_steps_lost)
    report["supervisor_decisions"] = [{**d, "t": round(d["t"] - started_at, 3)} for d in decisions]
    report["status"] = status
    report["local_cluster"] = timings
    report["crash"] = crash.as_dict() if crash is not None else None
    report["not_reached"] = [{"at": e.at, "kind": e.kind, "node": e.node} for e in scenario.events[not_reached:]]
    report["problems"] += problems + expectation_problems(scenario, report)
    if status != "finished":
        report["problems"].append(f"the run ended: {status}")
    report["ok"] = not report["problems"]
    return report
