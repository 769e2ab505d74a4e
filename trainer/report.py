"""The dry-run report: a timeline per injected event, built from what each part recorded.

Inputs: the scenario events as injected (with the emulator's `served_at`, the notice deadline,
and the ids the dry-run tied to each: the agent's notice id, the membership generation that
admitted a returning node, the generation drained to scale out), the generations the local
supervisor launched, the memberships it pushed, and the trainers' event logs (`trainer.events`,
with each departure the kubelet reported: `left`, trainer.departures). A notice's row says how
the ranks said they saved (`saved_by`: "boundary", the agreed step's save, or "watchdog", the
deadline watchdog's persist of the held snapshot; `checkpoint_step`; `snapshot_steps`, the steps
trained after it; `left_margin_s`, the seconds left to the deadline when they left), as they
reported it, never worked out again here.
Output: a JSON-able dict, a text rendering, and a PNG plot.

Attribution is by ids, never by time windows (`trainer.changes`): a notice's row takes the
change whose ranks agreed on that notice id; a returning node's row takes the grow its joiner
made (or the fallback of the membership that admitted it), or the drain that scaled the job out.

Step convention. The trainers' events count completed optimizer steps (`step` S: S steps done).
The report numbers steps as the Guard does: the step the user's loop passed to `guard.step(step)`
(0-based), the number a checkpoint folder carries (`step-000000073-notice` holds the state after
step 73, when 74 steps were done). So `agreed_step`, `checkpoint_step`, `resumed_step` (the
checkpoint step a relaunch resumed from; -1: from the beginning), `trained_step` (the last step
done) and a membership change's `step` (the step after which the group changed) are Guard steps
(`guard_step`); `total_steps`, `steps_completed`, `steps_trained` and `steps_lost` are counts.
Steps lost, per relaunch: the steps any rank of the ended generation completed beyond the state
the next generation resumed from; when training never resumed, beyond the newest state it could
resume from (its start or a durable checkpoint). A run that did not reach its last step says
where it stopped.
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Iterable

from spotguard.trainer.changes import Change, job_changes
from spotguard.trainer.scenario import TAKING_KINDS
from spotguard.wire.notice import Kind

NOTICE_KINDS = frozenset(kind.value for kind in Kind)  # a scenario event that is a notice (not capacity, cancel)
STEP_EVENTS = ("start", "step", "agreed", "durable", "resized", "drained", "finished")


def guard_step(done: int) -> int:
    """The Guard's number of the last step done after `done` completed steps (module docstring)."""
    return done - 1


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
    notice_id: str | None = None  # the id the node's agent gave the notice: what the ranks log when they agree
    membership: int | None = None  # capacity, in place: the membership generation that admitted the node
    rescaled: int | None = None  # capacity, relaunching: the generation drained to scale out to it
    launched_with: int | None = None  # capacity, relaunching: the generation launched with it (scaled out
    # while no group ran: nothing drained for it)
    scaled_from: int | None = None  # the replicas before the scale-out that took it in


@dataclass
class GenerationRecord:
    index: int
    world_size: int
    nodes: list[str]
    launched_at: float
    ended_at: float | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    reason: str = ""  # why it ended: notice, rescale, finished, crash


@dataclass
class MembershipRecord:
    """A membership the dry-run pushed to every node (what the supervisor's annotation would say)."""

    generation: int
    hosts: list[str]
    t: float
    cause: str  # "left" (a rank left in place), "admitted" (joiners), "relaunch" (the world of a new launch),
    # "start" (start at min: the first group, once min_workers nodes are ready)
    launch: int = 0  # the index of the generation (launch) it was pushed during


@dataclass
class _Generations:
    """Per launched generation: its events, where it started and how far it got."""

    events: dict[int, list[dict]]

    def started(self, index: int) -> list[dict]:
        return [e for e in self.events.get(index, []) if e["event"] == "start"]

    def reached(self, index: int) -> int:
        return max((e["step"] for e in self.events.get(index, []) if e["event"] in STEP_EVENTS and "step" in e),
                   default=0)

    def restore_point(self, index: int) -> int:
        """The newest step generation `index` could be resumed at: its start or a durable checkpoint
        (a `durable` event, or a departure that said its checkpoint was durable)."""
        mine = self.events.get(index, [])
        return max([e["step"] for e in mine if e["event"] in ("start", "durable")]
                   + [e["saved"] for e in mine if e["event"] == "left" and e.get("durable") and e.get("saved")],
                   default=0)

    def snapshot_digest(self, index: int, step: int) -> str | None:
        """The digest the lowest rank of generation `index` logged for its snapshot after `step`
        completed steps (None: none logged)."""
        snaps = [e for e in self.events.get(index, []) if e["event"] == "snapshot" and e.get("step") == step]
        return min(snaps, key=lambda e: e.get("rank") or 0).get("digest") if snaps else None


def _mark_not_reached(timeline: list[dict], finished: bool) -> None:
    """A capacity row whose node was never taken in says why (`finished`: training reached its end)."""
    for entry in timeline:
        if entry["kind"] == "capacity" and entry.get("note") != "already available" \
                and not entry.keys() & {"admitted", "joined", "relaunched", "agreed"}:
            entry["not_reached"] = "training finished before the node was taken in" if finished \
                else "the run ended before the node was taken in"


def build_report(scenario: dict, injected: list[InjectedEvent], generations: list[GenerationRecord],
                 trainer_events: Iterable[dict], started_at: float, finished_at: float,
                 total_steps: int, memberships: list[MembershipRecord] | None = None,
                 in_place: bool = False, min_workers: int = 1, allowed_steps_lost: int = 0) -> dict[str, Any]:
    """Assembles the report; `problems` lists every reason the run counts as failed (steps lost
    only beyond `allowed_steps_lost`, what the scenario expects to lose)."""
    events = sorted(trainer_events, key=lambda e: e["t"])
    memberships = memberships or []
    gens = _Generations(collections.defaultdict(list))
    for e in events:
        gens.events[int(e.get("generation", 0))].append(e)
    notice_nodes = {inj.notice_id: inj.node for inj in injected if inj.notice_id}
    hosts_of = {m.generation: list(m.hosts) for m in memberships}
    changes = job_changes(events, notice_nodes, hosts_of, in_place=in_place, min_workers=min_workers)
    relaunches = _relaunches(generations, gens, changes)
    problems: list[str] = []
    timeline = []
    for inj in injected:
        entry: dict[str, Any] = {"kind": inj.kind, "node": inj.node, "at": inj.at, "note": inj.note,
                                 "served": _rel(inj.served_at or inj.injected_at, started_at)}
        if inj.deadline is not None:
            entry["deadline"] = _rel(inj.deadline, started_at)
        change = None
        if inj.effective and inj.kind in NOTICE_KINDS and inj.notice_id:
            change = next((c for c in changes if c.notice_id == inj.notice_id), None)
            if change is not None:
                _notice_facts(entry, inj, change, started_at, problems, gens)
        elif inj.effective and inj.kind == "capacity" and inj.launched_with is not None:
            _launched_with(entry, inj, generations, started_at)
        elif inj.effective and inj.kind == "capacity":
            change = _capacity_change(inj, changes, gens, memberships, started_at, entry)
            if change is not None and change.path != "in-place":  # the drain it took: its checkpoint
                _notice_facts(entry, inj, change, started_at, problems, gens)
        if change is not None:
            _change_facts(entry, change, relaunches, generations, started_at, problems, inj)
        timeline.append(entry)

    finished = [e["step"] for e in events if e["event"] == "finished"]
    trained = max((e["step"] for e in events if e["event"] in STEP_EVENTS and "step" in e), default=0)
    completed = max(finished) if finished else trained
    if completed < total_steps:
        problems.append(f"training stopped after {completed} of {total_steps} steps")
    _mark_not_reached(timeline, bool(finished) and completed >= total_steps)
    lost = sum(r["steps_lost"] for r in relaunches)
    for entry in timeline:  # a rank that died (a user's kill) while the job lost nothing is a fact only
        if entry.get("ranks_missing") and (lost > allowed_steps_lost or completed < total_steps):
            problems.append(f"{entry['kind']} on {entry['node']}: only ranks {entry['ranks_agreed']} of "
                            f"{len(entry['ranks_agreed']) + len(entry['ranks_missing'])} acted")
    for r in relaunches:
        if r["steps_lost"] and lost > allowed_steps_lost:
            problems.append(f"generation {r['generation']} ({r['reason']}): {r['steps_lost']} steps lost "
                            f"(trained through step {r['trained_step']}, {resumed_text(r['resumed_step'])})")
        elif r["resumed_step"] is None and completed < total_steps:
            problems.append(f"generation {r['generation']} ({r['reason']}): the job never resumed")
    throughput = [{"t": _rel(e["t"], started_at), "step": e["step"], "world_size": e.get("world_size"),
                   "samples_per_s": e.get("samples_per_s"), "generation": e.get("generation", 0)}
                  for e in events if e["event"] == "step" and e.get("rank") == 0]
    return {
        "scenario": scenario,
        "ok": not problems,
        "problems": problems,
        "wall_s": round(finished_at - started_at, 3),
        "total_steps": total_steps,
        "finished": bool(finished) and completed >= total_steps,
        "steps_completed": completed,
        "steps_trained": trained,
        "steps_lost": lost,
        "timeline": timeline,
        "generations": [{**asdict(g), "launched": _rel(g.launched_at, started_at),
                         "ended": None if g.ended_at is None else _rel(g.ended_at, started_at)}
                        for g in generations],
        "relaunches": relaunches,
        "memberships": [{**asdict(m), "t": _rel(m.t, started_at)} for m in memberships],
        "throughput": throughput,
        "membership_changes": [_change_row(c, started_at) for c in changes],
        "survivors": survivors(events),
    }


def _notice_facts(entry: dict, inj: InjectedEvent, change: Change, started_at: float, problems: list[str],
                  gens: _Generations) -> None:
    """What the ranks did with one notice: agreed, detected, durable, drained (its own actions
    only), and how they said they saved (`_departure_facts`)."""
    agreed = [a.agreed for a in change.actions if a.agreed is not None]
    durable = [a.durable for a in change.actions if a.durable is not None]
    drained = [a.drained for a in change.actions if a.drained is not None]
    left = [a.left for a in change.actions if a.left is not None]
    label = f"{inj.kind} on {inj.node}"
    if agreed:
        steps = {guard_step(e["step"]) for e in agreed}
        entry["agreed_step"] = min(steps)
        entry["agreed"] = _rel(min(e["t"] for e in agreed), started_at)
        entry["ranks_agreed"] = sorted({e["rank"] for e in agreed})
        detected = [e["detected_at_unix"] for e in agreed if e.get("detected_at_unix")]
        if detected:
            entry["detected"] = _rel(min(detected), started_at)
        if len(steps) > 1:
            problems.append(f"{label}: ranks agreed on different steps {sorted(steps)}")
        world = max((e.get("world_size") or 0 for e in agreed), default=0)
        if len(entry["ranks_agreed"]) < world:  # a fact; a failure only if the job lost by it (build_report)
            entry["ranks_missing"] = sorted(set(range(world)) - set(entry["ranks_agreed"]))
    if durable:
        saved = {guard_step(e["step"]) for e in durable}
        entry["checkpoint_step"] = max(saved)
        entry["durable"] = _rel(max(e["t"] for e in durable), started_at)
        entry["snapshot_fallback"] = any(e.get("snapshot") for e in durable)
        entry["saved_digest"] = next((e.get("digest") for e in sorted(durable, key=lambda e: e.get("rank", 0))
                                      if e.get("digest")), None)
        if len(saved) > 1:
            problems.append(f"{label}: ranks saved different steps {sorted(saved)}")
        if inj.deadline is not None:
            entry["margin_s"] = round(inj.deadline - max(e["t"] for e in durable), 3)
            if entry["margin_s"] < 0:
                problems.append(f"{label}: checkpoint durable {-entry['margin_s']:.2f}s after the deadline")
    elif agreed:
        problems.append(f"{label}: no durable checkpoint after agreeing")
    if drained:
        entry["drained"] = _rel(max(e["t"] for e in drained), started_at)
        entry["exit_codes"] = sorted({e.get("exit_code") for e in drained})
    if left:
        _departure_facts(entry, left, started_at, problems, label, agreed=bool(agreed))
    if "checkpoint_step" in entry and not entry.get("saved_digest"):  # a snapshot's save: the state it held
        entry["saved_digest"] = gens.snapshot_digest(change.generation, entry["checkpoint_step"] + 1)


def _departure_facts(entry: dict, left: list[dict], started_at: float, problems: list[str], label: str,
                     agreed: bool) -> None:
    """How the ranks said they left (their termination messages, trainer.departures): which path
    saved (`saved_by`), the step, the steps the snapshot cost (`snapshot_steps`, the most of any
    rank) and the seconds left to the deadline when they left (`left_margin_s`, the least); for
    a departure the ranks did not log themselves (the deadline watchdog's), also the checkpoint's
    step, when they exited and with which codes."""
    paths = sorted({e["saved_by"] for e in left if e.get("saved_by")})
    if paths:
        entry["saved_by"] = paths[0] if len(paths) == 1 else paths
        if len(paths) > 1:
            problems.append(f"{label}: ranks saved by different paths {paths}")
    costs = [e["snapshot_steps"] for e in left if e.get("snapshot_steps") is not None]
    if costs:
        entry["snapshot_steps"] = max(costs)
    margins = [e["margin_seconds"] for e in left if e.get("margin_seconds") is not None]
    if margins:
        entry["left_margin_s"] = min(margins)
    saved = {guard_step(e["saved"]) for e in left if e.get("durable") and e.get("saved") is not None}
    if "checkpoint_step" not in entry and saved:
        entry["checkpoint_step"] = max(saved)
        if len(saved) > 1:
            problems.append(f"{label}: ranks saved different steps {sorted(saved)}")
    elif "checkpoint_step" not in entry and not agreed:
        problems.append(f"{label}: the ranks left with nothing durable ({', '.join(paths) or 'no account'})")
    entry.setdefault("drained", _rel(max(e["t"] for e in left), started_at))
    entry.setdefault("exit_codes", sorted({e["exit_code"] for e in left if e.get("exit_code") is not None}))


def _launched_with(entry: dict, inj: InjectedEvent, generations: list[GenerationRecord], started_at: float) -> None:
    """A node taken in by a relaunch that was due anyway (no group ran when it was scaled out to)."""
    nxt = next((g for g in generations if g.index == inj.launched_with), None)
    if nxt is None:
        return
    entry["path"] = "relaunch"
    entry["world"] = f"{inj.scaled_from if inj.scaled_from is not None else '?'} -> {nxt.world_size}"
    entry["relaunched"] = _rel(nxt.launched_at, started_at)
    entry["relaunch_world_size"] = nxt.world_size


def _capacity_change(inj: InjectedEvent, changes: list[Change], gens: _Generations,
                     memberships: list[MembershipRecord], started_at: float, entry: dict) -> Change | None:
    """The change a returning node made: its joiner's grow, its membership's fallback, or the
    drain that relaunched the job to take it in."""
    if inj.rescaled is not None:
        mine = [c for c in changes if c.generation == inj.rescaled and c.path == "relaunch"]
        return mine[-1] if mine else None
    if inj.membership is None:
        return None
    admitted = next((m for m in memberships if m.generation == inj.membership), None)
    if admitted is None:
        return None
    entry["admitted"] = _rel(admitted.t, started_at)
    joins = [e for e in gens.started(admitted.launch) if e.get("joined") and e.get("node") == inj.node
             and e["t"] >= admitted.t]
    if joins:
        join = min(joins, key=lambda e: e["t"])
        entry["joined"] = _rel(join["t"], started_at)
        grow = next((c for c in changes if c.generation == admitted.launch and c.path == "in-place"
                     and c.step == join["step"] and c.notice_id is None), None)
        if grow is not None:
            return grow
    later = {m.generation for m in memberships if m.generation >= inj.membership and inj.node in m.hosts}
    return next((c for c in changes if c.generation == admitted.launch and c.membership_generation in later), None)


def _change_facts(entry: dict, change: Change, relaunches: list[dict], generations: list[GenerationRecord],
                  started_at: float, problems: list[str], inj: InjectedEvent) -> None:
    """The path a change took; for one that relaunched, how and where the job resumed."""
    entry["path"] = change.path
    entry["world"] = f"{change.from_world} -> {change.to_world if change.to_world is not None else '?'}"
    if change.pause_s is not None:
        entry["pause_s"] = change.pause_s
    if change.path == "in-place":
        return
    relaunch = next((r for r in relaunches if r["generation"] == change.generation), None)
    if relaunch is None:
        return
    entry["steps_lost"] = relaunch["steps_lost"]
    nxt = next((g for g in generations if g.index == relaunch["next_generation"]), None)
    if nxt is None:
        problems.append(f"{inj.kind} on {inj.node}: the job never resumed after its checkpoint")
        return
    entry["relaunched"] = _rel(nxt.launched_at, started_at)
    entry["relaunch_world_size"] = nxt.world_size
    entry["world"] = f"{change.from_world} -> {nxt.world_size}"  # the world it relaunched at, as it formed
    if relaunch["resumed_step"] is None:
        problems.append(f"{inj.kind} on {inj.node}: the job never resumed after its checkpoint")
        return
    entry["resumed_step"] = relaunch["resumed_step"]
    entry["resumed"] = _rel(relaunch["resumed"], started_at)
    entry["resumed_digest"] = relaunch["resumed_digest"]
    if entry.get("saved_digest") and entry.get("resumed_digest") \
            and entry["resumed_step"] == entry.get("checkpoint_step") \
            and entry["saved_digest"] != entry["resumed_digest"]:
        problems.append(f"{inj.kind} on {inj.node}: resumed state differs from the saved state")


def _relaunches(generations: list[GenerationRecord], gens: _Generations, changes: list[Change]) -> list[dict]:
    """Per generation that trained and ended without finishing: what it trained, where the job
    resumed (the next generation that started training) and the steps lost between them."""
    trained = [g for g in generations if gens.started(g.index)]
    out = []
    for i, g in enumerate(trained):
        mine = gens.events.get(g.index, [])
        if any(e["event"] == "finished" for e in mine):
            continue
        later = [n for n in generations if n.index > g.index]
        nxt = trained[i + 1] if i + 1 < len(trained) else None
        reached = gens.reached(g.index)
        ending = [c for c in changes if c.generation == g.index and c.path != "in-place"]
        reason = f"{ending[-1].path} ({ending[-1].reason})" if ending else (g.reason or "ended")
        row: dict[str, Any] = {"generation": g.index, "reason": reason, "trained_step": guard_step(reached),
                               "next_generation": later[0].index if later else None,
                               "resumed_step": None, "resumed": None, "resumed_digest": None}
        if nxt is not None:
            starts = gens.started(nxt.index)
            first = min(starts, key=lambda e: e["t"])
            resumed = min(e["step"] for e in starts)
            row.update(next_generation=nxt.index, resumed_step=guard_step(resumed), resumed=first["t"],
                       resumed_digest=next((e.get("digest") for e in starts if e.get("rank") == 0), None))
            row["steps_lost"] = max(0, reached - resumed)
        else:
            row["steps_lost"] = max(0, reached - gens.restore_point(g.index))
        out.append(row)
    return out


def _change_row(c: Change, started_at: float) -> dict:
    row = {"t": _rel(c.t, started_at), "generation": c.generation, "step": guard_step(c.step),
           "from_world": c.from_world,
           "to_world": c.to_world, "path": c.path, "reason": c.reason, "pause_s": c.pause_s,
           "nodes": c.survivors or sorted({a.node for a in c.actions})}
    if c.notice_id:
        row["notice_id"] = c.notice_id
    return row


def survivors(events: list[dict]) -> dict[str, dict]:
    """Per node that finished: whether one process trained there from the first start to the
    end (`pid_kept`), how many processes trained there (`processes`: a relaunch or a rejoin
    starts a new one), whether the last one joined a running group, and the longest gap between
    two of its completed steps (pauses included)."""
    out: dict[str, dict] = {}
    for e in events:
        if e["event"] != "finished" or not e.get("node"):
            continue
        starts = [s for s in events if s["event"] == "start" and s.get("node") == e["node"] and s["t"] <= e["t"]]
        pids = {s.get("pid") for s in starts}
        last = max(starts, key=lambda s: s["t"]) if starts else {}
        out[e["node"]] = {"pid_kept": pids == {e.get("pid")}, "processes": len(pids),
                          "max_step_gap_s": e.get("max_step_gap"), "joined": bool(last.get("joined"))}
    return out


def _process_text(facts: dict) -> str:
    """How a node's training process lived, in words (`survivors`)."""
    if facts["pid_kept"]:
        return "same process throughout"
    if facts.get("joined"):
        return "rejoined in place (a new process after its reclaim)"
    count = facts.get("processes")
    return f"relaunched ({count} processes in turn)" if count else "process replaced"


def saved_text(entry: dict) -> str:
    """Which path saved a notice's checkpoint, as the ranks said, in words."""
    paths = entry["saved_by"] if isinstance(entry["saved_by"], list) else [entry["saved_by"]]
    text = f"saved by {' and '.join(paths)}"
    if "checkpoint_step" in entry:
        text += f" at step {entry['checkpoint_step']}"
    if entry.get("snapshot_steps") is not None:
        text += f" ({entry['snapshot_steps']} steps trained after it)"
    if "left_margin_s" in entry:
        text += f", left {entry['left_margin_s']:.2f}s before the deadline"
    return text


def resumed_text(step: int | None) -> str:
    """Where a relaunch resumed, in words (`resumed_step`: a Guard step, -1 the beginning)."""
    if step is None:
        return "never resumed"
    return "restarted from the beginning" if step < 0 else f"resumed from step {step}"


def _rel(t: float, origin: float) -> float:
    return round(t - origin, 3)


def render_text(report: dict) -> str:
    """The timeline as lines a person reads: one block per injected event."""
    total = report.get("total_steps")
    done = report["steps_completed"]
    if total is None or done >= total:
        progress = f"{done} steps"
    else:
        progress = f"stopped after {done} of {total} steps (trained {report.get('steps_trained', done)})"
    out = [f"scenario {report['scenario'].get('name')}: {'OK' if report['ok'] else 'FAILED'} in "
           f"{report['wall_s']:.1f}s, {progress}, {report['steps_lost']} lost"]
    for e in report["timeline"]:
        head = f"- t={e['at']:>5.1f}s {e['kind']} on {e['node']}"
        if e.get("note"):
            head += f" ({e['note']})"
        out.append(head)
        chain = []
        for key, label in (("served", "served"), ("detected", "detected"), ("agreed", "agreed"),
                           ("durable", "durable"), ("drained", "drained"), ("admitted", "admitted"),
                           ("joined", "joined"), ("relaunched", "relaunched"), ("resumed", "resumed")):
            if key in e:
                extra = ""
                if key == "agreed":
                    extra = f" at step {e['agreed_step']}"
                elif key == "durable":
                    extra = f" step {e['checkpoint_step']}" + (" (snapshot)" if e.get("snapshot_fallback") else "")
                elif key == "relaunched":
                    extra = f" W={e['relaunch_world_size']}"
                elif key == "resumed":
                    extra = f" from step {e['resumed_step']}" if e["resumed_step"] >= 0 else " from the beginning"
                chain.append(f"{label} {e[key]:.2f}s{extra}")
        if chain:
            out.append("    " + " -> ".join(chain))
        facts = []
        if e["kind"] not in (*TAKING_KINDS, "capacity") and not e.keys() & {"agreed", "drained", "saved_by"}:
            facts.append("no drain: training went on")  # the node stayed, and no rank left for the notice
        if e.get("not_reached"):
            facts.append(f"not reached: {e['not_reached']}")
        if e.get("ranks_missing"):
            facts.append(f"ranks {e['ranks_missing']} did not take part (their process had ended)")
        if "margin_s" in e:
            facts.append(f"deadline margin {e['margin_s']:.2f}s")
        if "saved_by" in e:
            facts.append(saved_text(e))
        if "steps_lost" in e:
            facts.append(f"steps lost {e['steps_lost']}")
        if e.get("path") == "in-place":
            facts.append(f"in-place: world {e['world']}, survivors paused {e.get('pause_s') or 0.0:.3f}s")
        elif "path" in e:
            facts.append(f"{e['path']}: world {e['world']}, relaunched")
        if e.get("saved_digest") and e.get("resumed_digest"):
            facts.append("resumed state == saved state" if e["saved_digest"] == e["resumed_digest"]
                         else "resumed state != saved state")
        if facts:
            out.append("    " + ", ".join(facts))
    for node, facts in sorted(report.get("survivors", {}).items()):
        out.append(f"  {node}: {_process_text(facts)}, longest gap between steps {facts['max_step_gap_s']}s")
    for r in report.get("relaunches", []):
        out.append(f"  generation {r['generation']} ended ({r['reason']}): trained through step "
                   f"{r['trained_step']}, {resumed_text(r['resumed_step'])}, {r['steps_lost']} steps lost")
    for d in report.get("supervisor_decisions", []):
        out.append(f"  supervisor t={d['t']:5.1f}s {d['action']}: {d['message']}")
    if report.get("local_cluster"):
        out.append(f"  local cluster: {report['local_cluster']}")
    first = "training finished first" if report.get("finished") else "the run ended first"
    for e in report.get("not_reached", []):
        out.append(f"  (t={e['at']:.1f}s {e['kind']} on {e['node']}: not reached, {first})")
    for problem in report["problems"]:
        out.append(f"! {problem}")
    crash = report.get("crash")
    if crash:
        out.append(f"! cause: pod {crash['pod']} exited {crash['exit_code']}; the end of its log {crash['log']}:")
        out += [f"!   {line}" for line in crash["tail"]]
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    """Throughput and the real world size over time, the injected events marked, as a PNG
    (trainer/timeline_plot.py)."""
    from spotguard.trainer.timeline_plot import plot as draw

    draw(report, path)
