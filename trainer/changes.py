"""The job's changes as the ranks logged them, tied together by their own ids.

Input: the trainers' events (`trainer.events`), every rank of every generation. Output:
- `process_logs(events)`: each process's events in time order. A process is one (generation,
  node) log between two `start` events: a node that left in place and later joined again in the
  same generation has two.
- `actions(log)`: what one process did at each change: an `agreed` notice (its `notice_id`) with
  the `durable`, `drained`, `resized` and `left` events that follow it in that process's log, a
  `resized` with no agreement (a grow: the membership that admitted joiners), or a `left` with no
  agreement (the deadline watchdog answered the notice before the ranks agreed:
  trainer.departures).
- `job_changes(events, ...)`: one `Change` per change of the job: the actions of one generation
  that carry one notice id (a shrink, a drain, a membership's fallback), or that resized at one
  step with no notice (a grow). Never grouped by time: two changes of one generation stay apart.

The path of a change: `in-place` (survivors logged `resized` in place), `fallback` (an in-place
change that ended with every survivor draining: the job relaunched from the durable step; only
an in-place job has one), `relaunch` (every rank drained, as a job that relaunches does).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from collections.abc import Iterable

MEMBERSHIP_NOTICE_PREFIX = "membership-"


@dataclass
class Action:
    """One process's part in one change."""

    generation: int
    node: str
    rank: int | None
    world_size: int | None  # the group's size when the change began
    step: int
    notice_id: str | None = None
    kind: str | None = None
    agreed: dict | None = None
    durable: dict | None = None
    drained: dict | None = None
    resized: dict | None = None
    left: dict | None = None  # the rank's departure, from its termination message (trainer.departures)

    @property
    def t(self) -> float:
        first = self.agreed or self.resized or self.durable or self.drained or self.left or {}
        return float(first.get("t", 0.0))


@dataclass
class Change:
    """One change of the job, from every action that belongs to it."""

    generation: int
    key: str  # the notice id, or "grow@<step>" for a grow
    step: int
    t: float
    notice_id: str | None
    reason: str
    from_world: int | None
    to_world: int | None
    path: str
    actions: list[Action] = field(default_factory=list)

    @property
    def pause_s(self) -> float | None:
        pauses = [a.resized.get("pause", 0.0) for a in self.actions
                  if a.resized is not None and a.resized.get("path") == "in-place"]
        return round(max(pauses), 4) if pauses else None

    @property
    def survivors(self) -> list[str]:
        return sorted({a.node for a in self.actions if a.resized is not None and a.resized.get("path") == "in-place"})

    @property
    def membership_generation(self) -> int | None:
        if self.notice_id and self.notice_id.startswith(MEMBERSHIP_NOTICE_PREFIX):
            try:
                return int(self.notice_id[len(MEMBERSHIP_NOTICE_PREFIX):])
            except ValueError:
                return None
        return None


def process_logs(events: Iterable[dict]) -> list[list[dict]]:
    """Each process's events in time order (see the module docstring)."""
    by_node: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for e in events:
        by_node[(int(e.get("generation", 0)), str(e.get("node") or f"rank{e.get('rank')}"))].append(e)
    logs: list[list[dict]] = []
    for stream in by_node.values():
        stream.sort(key=lambda e: e["t"])
        current: list[dict] = []
        for e in stream:
            if e["event"] == "start" and current:
                logs.append(current)
                current = []
            current.append(e)
        if current:
            logs.append(current)
    return logs


def actions(log: list[dict]) -> list[Action]:
    """One process's actions, in order (see the module docstring)."""
    out: list[Action] = []
    current: Action | None = None
    for e in log:
        kind = e["event"]
        if kind == "agreed":
            current = _action(e, notice_id=e.get("notice_id"), kind=e.get("kind"))
            current.agreed = e
            out.append(current)
        elif kind in ("durable", "drained"):
            if current is not None and getattr(current, kind) is None:
                setattr(current, kind, e)
        elif kind == "left":
            if current is None or current.notice_id != e.get("notice_id") or current.left is not None:
                current = _action(e, notice_id=e.get("notice_id"), kind=e.get("kind"))
                out.append(current)
            current.left = e
        elif kind == "resized":
            if current is not None and current.resized is None and current.step == e.get("step") \
                    and (current.drained is None or e.get("path") == "fallback"):
                current.resized = e
            else:
                current = _action(e, notice_id=e.get("notice_id"), kind=e.get("reason"))
                current.resized = e
                out.append(current)
    return out


def _action(e: dict, notice_id: str | None, kind: str | None) -> Action:
    return Action(int(e.get("generation", 0)), str(e.get("node") or f"rank{e.get('rank')}"), e.get("rank"),
                  e.get("world_size"), int(e.get("step") or 0), notice_id, kind)


def job_changes(events: Iterable[dict], notice_nodes: dict[str, str] | None = None,
                membership_hosts: dict[int, list[str]] | None = None, in_place: bool = False,
                min_workers: int = 1) -> list[Change]:
    """Every change of the job, in time order.

    `notice_nodes` (notice id -> the node it named) and `membership_hosts` (membership generation
    -> its hosts) give the intended new world of a change that did not happen in place;
    `in_place` and `min_workers` tell a fallback (the change could have been made in place) from
    a relaunch."""
    notice_nodes = notice_nodes or {}
    membership_hosts = membership_hosts or {}
    grouped: dict[tuple[int, str], list[Action]] = collections.defaultdict(list)
    for log in process_logs(events):
        for action in actions(log):
            key = action.notice_id or f"grow@{action.step}"
            grouped[(action.generation, key)].append(action)
    changes = [_change(generation, key, group, notice_nodes, membership_hosts, in_place, min_workers)
               for (generation, key), group in grouped.items()]
    return sorted(changes, key=lambda c: c.t)


def _change(generation: int, key: str, group: list[Action], notice_nodes: dict[str, str],
            membership_hosts: dict[int, list[str]], in_place: bool, min_workers: int) -> Change:
    first = min(group, key=lambda a: a.t)
    in_place_resized = [a.resized for a in group if a.resized is not None and a.resized.get("path") == "in-place"]
    fallback_resized = [a.resized for a in group if a.resized is not None and a.resized.get("path") == "fallback"]
    from_world = max((a.world_size for a in group if a.world_size is not None), default=None)
    notice_id = first.notice_id
    reason = first.kind or ""
    change = Change(generation, key, min(a.step for a in group), first.t, notice_id, reason, from_world, None, "")
    change.actions = sorted(group, key=lambda a: (a.rank if a.rank is not None else -1))
    if in_place_resized:
        change.path = "in-place"
        change.to_world = in_place_resized[0].get("to_world")
        change.from_world = in_place_resized[0].get("from_world", from_world)
        change.reason = in_place_resized[0].get("reason") or reason
        return change
    target = _intended_world(change, notice_nodes, membership_hosts)
    change.to_world = target
    could_stay = target is not None and target >= max(1, min_workers) and (
        change.membership_generation is not None or notice_id in notice_nodes)
    change.path = "fallback" if fallback_resized or (in_place and could_stay) else "relaunch"
    return change


def _intended_world(change: Change, notice_nodes: dict[str, str], membership_hosts: dict[int, list[str]]) -> int | None:
    """The world a change that did not happen in place asked for (None: unknown, the whole job drained)."""
    generation = change.membership_generation
    if generation is not None:
        hosts = membership_hosts.get(generation)
        return len(hosts) if hosts is not None else None
    node = notice_nodes.get(change.notice_id or "")
    if node is None or change.from_world is None:
        return None
    nodes = {a.node for a in change.actions}
    return change.from_world - 1 if node in nodes else change.from_world
