"""The dry-run report: a timeline per injected event, built from what each part recorded.

Inputs: the scenario events as injected (with the emulator's `served_at` and the notice
deadline), the generations the local supervisor launched, and the trainers' event logs
(`trainer.events`). Output: a JSON-able dict, a text rendering, and a PNG plot.

Step convention: `step` counts completed optimizer steps. A checkpoint "at step S" holds the
state after S steps; a run resumed from it logs `start` with step S. Steps lost by an event =
the furthest step any rank completed in the interrupted generation minus the step the next
generation resumed from.
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Iterable


@dataclass
class InjectedEvent:
    """One scenario event as the dry-run carried it out (times are wall-clock seconds)."""

    kind: str
    node: str
    at: float  # scenario time (seconds after training first started)
    injected_at: float
    served_at: float | None = None  # when the emulated cloud started showing the notice
    deadline: float | None = None
    emulator_id: str | None = None
    note: str = ""
    effective: bool = True  # False: changed nothing (e.g. capacity for a node that was already there)


@dataclass
class GenerationRecord:
    index: int
    world_size: int
    nodes: list[str]
    launched_at: float
    ended_at: float | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    reason: str = ""  # why it ended: notice, rescale, finished, crash


def _by_generation(events: list[dict]) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        grouped[int(e.get("generation", 0))].append(e)
    return grouped


def build_report(scenario: dict, injected: list[InjectedEvent], generations: list[GenerationRecord],
                 trainer_events: Iterable[dict], started_at: float, finished_at: float,
                 total_steps: int) -> dict[str, Any]:
    """Assembles the report; `problems` lists every reason the run counts as failed."""
    events = list(trainer_events)
    per_gen = _by_generation(events)
    problems: list[str] = []
    timeline = []

    def gen_of(t: float) -> GenerationRecord | None:
        live = [g for g in generations if g.launched_at <= t and (g.ended_at is None or t <= g.ended_at)]
        return live[-1] if live else None

    for inj in injected:
        entry: dict[str, Any] = {"kind": inj.kind, "node": inj.node, "at": inj.at, "note": inj.note,
                                 "served": _rel(inj.served_at or inj.injected_at, started_at)}
        if inj.deadline is not None:
            entry["deadline"] = _rel(inj.deadline, started_at)
        gen = gen_of(inj.served_at or inj.injected_at)
        if gen is not None and inj.effective and inj.kind in ("reclaim", "gpu-fault", "maintenance", "rebalance",
                                                                "capacity"):
            gev = per_gen.get(gen.index, [])
            agreed = [e for e in gev if e["event"] == "agreed" and e["t"] >= (inj.served_at or 0) - 1]
            durable = [e for e in gev if e["event"] == "durable" and e["t"] >= (inj.served_at or 0) - 1]
            drained = [e for e in gev if e["event"] == "drained" and e["t"] >= (inj.served_at or 0) - 1]
            if agreed:
                steps = {e["step"] for e in agreed}
                entry["agreed_step"] = min(steps)
                entry["agreed"] = _rel(min(e["t"] for e in agreed), started_at)
                entry["ranks_agreed"] = sorted({e["rank"] for e in agreed})
                detected = [e.get("detected_at_unix") for e in agreed if e.get("detected_at_unix")]
                if detected:
                    entry["detected"] = _rel(min(detected), started_at)
                if len(steps) > 1:
                    problems.append(f"{inj.kind} on {inj.node}: ranks agreed on different steps {sorted(steps)}")
                if len(entry["ranks_agreed"]) < gen.world_size:
                    problems.append(f"{inj.kind} on {inj.node}: only ranks {entry['ranks_agreed']} of "
                                    f"{gen.world_size} acted")
            if durable:
                saved = {e["step"] for e in durable}
                entry["checkpoint_step"] = max(saved)
                entry["durable"] = _rel(max(e["t"] for e in durable), started_at)
                entry["snapshot_fallback"] = any(e.get("snapshot") for e in durable)
                entry["saved_digest"] = next((e.get("digest") for e in durable if e.get("rank") == 0), None)
                if len(saved) > 1:
                    problems.append(f"{inj.kind} on {inj.node}: ranks saved different steps {sorted(saved)}")
                if inj.deadline is not None:
                    entry["margin_s"] = round(inj.deadline - max(e["t"] for e in durable), 3)
                    if entry["margin_s"] < 0:
                        problems.append(f"{inj.kind} on {inj.node}: checkpoint durable "
                                        f"{-entry['margin_s']:.2f}s after the deadline")
            elif agreed:
                problems.append(f"{inj.kind} on {inj.node}: no durable checkpoint after agreeing")
            if drained:
                entry["drained"] = _rel(max(e["t"] for e in drained), started_at)
                entry["exit_codes"] = sorted({e.get("exit_code") for e in drained})
            # The next generation that actually started training (one killed while starting up,
            # e.g. by a scale-out, never loaded anything and is skipped).
            later = [g for g in generations if g.index > gen.index]
            nxt = next((g for g in later if any(e["event"] == "start" for e in per_gen.get(g.index, []))),
                       later[0] if later else None)
            if nxt is not None and durable:
                starts = [e for e in per_gen.get(nxt.index, []) if e["event"] == "start"]
                entry["relaunched"] = _rel(nxt.launched_at, started_at)
                entry["relaunch_world_size"] = nxt.world_size
                if not starts:
                    problems.append(f"{inj.kind} on {inj.node}: the job never resumed after its checkpoint")
                if starts:
                    entry["resumed_step"] = min(e["step"] for e in starts)
                    entry["resumed"] = _rel(min(e["t"] for e in starts), started_at)
                    entry["resumed_digest"] = next((e.get("digest") for e in starts if e.get("rank") == 0), None)
                    reached = max((e["step"] for e in gev if e["event"] in ("step", "agreed", "durable")), default=0)
                    entry["steps_lost"] = max(0, reached - entry["resumed_step"])
                    if entry["steps_lost"]:
                        problems.append(f"{inj.kind} on {inj.node}: {entry['steps_lost']} steps lost")
                    if entry.get("saved_digest") and entry.get("resumed_digest") \
                            and entry["resumed_step"] == entry.get("checkpoint_step") \
                            and entry["saved_digest"] != entry["resumed_digest"]:
                        problems.append(f"{inj.kind} on {inj.node}: resumed state differs from the saved state")
        timeline.append(entry)

    changes = in_place_changes(events, started_at)
    for entry in timeline:
        change = next((c for c in changes if c["t"] >= entry["served"] - 0.5), None)
        if change is not None and entry["kind"] in ("reclaim", "gpu-fault", "maintenance", "capacity") \
                and "relaunched" not in entry:
            entry["path"] = change["path"]
            entry["pause_s"] = change["pause_s"]
            entry["world"] = f"{change['from_world']} -> {change['to_world']}"
    final_steps = [e["step"] for e in events if e["event"] == "finished"]
    completed = max(final_steps) if final_steps else max((e["step"] for e in events if "step" in e), default=0)
    if completed < total_steps:
        problems.append(f"training stopped at step {completed} of {total_steps}")
    throughput = [{"t": _rel(e["t"], started_at), "step": e["step"], "world_size": e.get("world_size"),
                   "samples_per_s": e.get("samples_per_s"), "generation": e.get("generation", 0)}
                  for e in events if e["event"] == "step" and e.get("rank") == 0]
    return {
        "scenario": scenario,
        "ok": not problems,
        "problems": problems,
        "wall_s": round(finished_at - started_at, 3),
        "steps_completed": completed,
        "steps_lost": sum(t.get("steps_lost", 0) for t in timeline),
        "timeline": timeline,
        "generations": [{**asdict(g), "launched": _rel(g.launched_at, started_at),
                         "ended": None if g.ended_at is None else _rel(g.ended_at, started_at)}
                        for g in generations],
        "throughput": throughput,
        "membership_changes": changes,
        "survivors": survivors(events),
    }


def in_place_changes(events: list[dict], started_at: float) -> list[dict]:
    """Each in-place change as the survivors logged it (`resized`): when, the sizes, which path,
    and the survivors' pause (the slowest rank's)."""
    grouped: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e["event"] == "resized":
            grouped[(e.get("generation", 0), e["step"], e.get("to_world"))].append(e)
    changes = []
    for (_gen, step, to_world), group in sorted(grouped.items(), key=lambda kv: min(e["t"] for e in kv[1])):
        changes.append({"t": _rel(min(e["t"] for e in group), started_at), "step": step,
                        "from_world": group[0].get("from_world"), "to_world": to_world,
                        "path": group[0].get("path"), "reason": group[0].get("reason"),
                        "pause_s": round(max(e.get("pause", 0.0) for e in group), 4),
                        "nodes": sorted({e.get("node") for e in group})})
    return changes


def survivors(events: list[dict]) -> dict[str, dict]:
    """Per node that finished: whether its process id stayed the one that started training there,
    and the longest gap between two of its completed steps (pauses included)."""
    out: dict[str, dict] = {}
    for e in events:
        if e["event"] != "finished" or not e.get("node"):
            continue
        starts = [s for s in events if s["event"] == "start" and s.get("node") == e["node"]
                  and s.get("generation") == e.get("generation")]
        first = min(starts, key=lambda s: s["t"]) if starts else None
        out[e["node"]] = {"pid_kept": first is not None and first.get("pid") == e.get("pid"),
                          "max_step_gap_s": e.get("max_step_gap"), "joined": any(s.get("joined") for s in starts)}
    return out


def _rel(t: float, origin: float) -> float:
    return round(t - origin, 3)


def render_text(report: dict) -> str:
    """The timeline as lines a person reads: one block per injected event."""
    out = [f"scenario {report['scenario'].get('name')}: {'OK' if report['ok'] else 'FAILED'} in "
           f"{report['wall_s']:.1f}s, {report['steps_completed']} steps, {report['steps_lost']} lost"]
    for e in report["timeline"]:
        head = f"- t={e['at']:>5.1f}s {e['kind']} on {e['node']}"
        if e.get("note"):
            head += f" ({e['note']})"
        out.append(head)
        chain = []
        for key, label in (("served", "served"), ("detected", "detected"), ("agreed", "agreed"),
                           ("durable", "durable"), ("drained", "drained"), ("relaunched", "relaunched"),
                           ("resumed", "resumed")):
            if key in e:
                extra = ""
                if key == "agreed":
                    extra = f" at step {e['agreed_step']}"
                elif key == "durable":
                    extra = f" step {e['checkpoint_step']}" + (" (snapshot)" if e.get("snapshot_fallback") else "")
                elif key == "relaunched":
                    extra = f" W={e['relaunch_world_size']}"
                elif key == "resumed":
                    extra = f" at step {e['resumed_step']}"
                chain.append(f"{label} {e[key]:.2f}s{extra}")
        if chain:
            out.append("    " + " -> ".join(chain))
        facts = []
        if e["kind"] in ("maintenance", "rebalance", "cancel") and "agreed" not in e:
            facts.append("no drain: training went on")
        if "margin_s" in e:
            facts.append(f"deadline margin {e['margin_s']:.2f}s")
        if "steps_lost" in e:
            facts.append(f"steps lost {e['steps_lost']}")
        if "path" in e:
            facts.append(f"{e['path']}: world {e['world']}, survivors paused {e['pause_s']:.3f}s")
        if e.get("saved_digest") and e.get("resumed_digest"):
            facts.append("resumed state == saved state" if e["saved_digest"] == e["resumed_digest"]
                         else "resumed state != saved state")
        if facts:
            out.append("    " + ", ".join(facts))
    for node, facts in sorted(report.get("survivors", {}).items()):
        kept = "same process throughout" if facts["pid_kept"] else "process replaced"
        out.append(f"  {node}: {'rejoined in place (a new process after its reclaim)' if facts.get('joined') else kept}"
                   f", longest gap between steps "
                   f"{facts['max_step_gap_s']}s")
    for d in report.get("supervisor_decisions", []):
        out.append(f"  supervisor t={d['t']:5.1f}s {d['action']}: {d['message']}")
    for e in report.get("not_reached", []):
        out.append(f"  (t={e['at']:.1f}s {e['kind']} on {e['node']}: not reached, training finished first)")
    for problem in report["problems"]:
        out.append(f"! {problem}")
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    """Throughput and world size over time, with the injected events marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(10, 4.5), dpi=110)
    by_generation: dict[int, list[dict]] = collections.defaultdict(list)
    for p in report["throughput"]:
        by_generation[p.get("generation", 0)].append(p)
    for i, (_, points) in enumerate(sorted(by_generation.items())):
        ax1.plot([p["t"] for p in points], [p["samples_per_s"] or 0 for p in points], color="tab:blue",
                 label="throughput (samples/s)" if i == 0 else None)
    ax1.set_xlabel("seconds since training started")
    ax1.set_ylabel("samples/s", color="tab:blue")
    ax2 = ax1.twinx()
    gens = report["generations"]
    xs, ys = [], []
    for g in gens:
        end = g["ended"] if g["ended"] is not None else report["wall_s"]
        xs += [g["launched"], end]
        ys += [g["world_size"], g["world_size"]]
    ax2.step(xs, ys, where="post", color="tab:green", label="world size")
    ax2.set_ylabel("world size", color="tab:green")
    ax2.set_ylim(0, max([g["world_size"] for g in gens] + [1]) + 1)
    colors = {"reclaim": "tab:red", "gpu-fault": "tab:purple", "capacity": "tab:olive",
              "maintenance": "tab:orange", "rebalance": "tab:brown", "cancel": "tab:gray"}
    for e in report["timeline"]:
        ax1.axvline(e["served"], color=colors.get(e["kind"], "black"), linestyle="--", alpha=0.8)
        ax1.annotate(f"{e['kind']} {e['node']}", (e["served"], ax1.get_ylim()[1] * 0.95), rotation=90,
                     fontsize=7, va="top", ha="right")
    ax1.set_title(f"spotguard dry-run: {report['scenario'].get('name')} "
                  f"({'OK' if report['ok'] else 'FAILED'}, {report['steps_lost']} steps lost)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
