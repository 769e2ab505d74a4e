"""The job's generations, from what ran: a generation is one group the ranks formed from the
start (not one they joined), whatever launched it. Pure: events in, generations out.

Each trainer event carries `generation` = its container's launch epoch (the kubelet's
`SPOTGUARD_GENERATION`: a new one whenever a container of the job starts while none runs) and
`group` = its launcher's rendezvous address (`MASTER_ADDR:MASTER_PORT`; torchrun's c10d picks a
new one for every rendezvous round, so a scale-out that torchrun answers by restarting its
workers inside their pods is a new group in the same epoch). A process is one node's events
between two `start`s (changes.process_logs). `rounds(events, launched_at)` keys each process by
(epoch, group, step) of its `start`: the ranks that form a group together resume at one step,
and a group relaunched while a container of the old one still ran (the same epoch and, in
place, the same launcher address) resumes at a later one. A process that joined a running group
(`joined`) belongs to the last group of its epoch that started before it. Groups are numbered in the order they started;
it returns the events with `generation` replaced by that number, and a `GenerationRecord` per
group: its starting world size, its nodes, when it was launched (the latest container start
among the pods that formed it: `container_starts`, (node, time) pairs, the one on each node
last before its rank started; else its first `start`), when its last event was, its drained
exit codes (a `drained` event's, or the exit of a departure the kubelet saw: `left`), and how it
ended (finished, drained, crashed).
"""
from __future__ import annotations

from collections.abc import Iterable

from spotguard.trainer.changes import process_logs
from spotguard.trainer.report import GenerationRecord
from spotguard.wire.names import EXIT_PREEMPTED


def _key(start: dict) -> tuple[int, str, int]:
    return int(start.get("generation", 0)), str(start.get("group") or ""), int(start.get("step") or 0)


def rounds(events: Iterable[dict], container_starts: Iterable[tuple[str, float]] = ()
           ) -> tuple[list[dict], list[GenerationRecord]]:
    """See the module docstring."""
    logs = sorted((log for log in process_logs(events) if log), key=lambda log: log[0]["t"])
    order: list[tuple[int, str, int]] = []
    members: dict[tuple[int, str, int], list[list[dict]]] = {}
    for log in logs:
        first = log[0]
        key = _key(first)
        if first["event"] == "start" and first.get("joined"):
            key = next((k for k in reversed(order) if k[0] == key[0]), key)
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(log)
    relabeled: list[dict] = []
    records = []
    for number, key in enumerate(order):
        logs_here = members[key]
        for log in logs_here:
            relabeled += [{**e, "generation": number} for e in log]
        records.append(_record(number, logs_here, list(container_starts)))
    relabeled.sort(key=lambda e: e["t"])
    return relabeled, records


def _launched(founders: list[dict], container_starts: list[tuple[str, float]], first_start: float) -> float:
    """The latest container start among the founders' pods (see the module docstring)."""
    pods = [max((t for node, t in container_starts if node == e.get("node") and t <= e["t"]), default=None)
            for e in founders]
    known = [t for t in pods if t is not None]
    return min(max(known), first_start) if known else first_start


def _record(number: int, logs: list[list[dict]], container_starts: list[tuple[str, float]]) -> GenerationRecord:
    events = [e for log in logs for e in log]
    starts = [e for e in events if e["event"] == "start"]
    founders = [e for e in starts if not e.get("joined")] or starts
    first_start = min((e["t"] for e in starts), default=min(e["t"] for e in events))
    launched = _launched(founders, container_starts, first_start)
    drained = {str(e.get("node")): int(e["exit_code"]) for e in events if e["event"] in ("drained", "left")
               and e.get("exit_code") is not None}
    if any(e["event"] == "finished" for e in events):
        reason = "finished"
    elif any(code == EXIT_PREEMPTED for code in drained.values()):
        reason = "drained"
    else:
        reason = "crashed"
    return GenerationRecord(number, max((int(e.get("world_size") or 0) for e in founders), default=0),
                            sorted({str(e.get("node")) for e in events}), launched,
                            ended_at=max(e["t"] for e in events), exit_codes=drained, reason=reason)
