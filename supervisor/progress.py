"""What drained pods tell the supervisor: which replicas exited 83/84 (the Guard drained after its
checkpoint) since a moment, and the steps each lost. Pure functions over pod dicts.

A drained rank writes its termination message (`SPOTGUARD_TERMINATION_LOG`, by default the
container's `/dev/termination-log`, docs/protocols.md): JSON `{"v":1,"step":n,"saved_step":n,
"steps_lost":n}`, with an object store also `"durable_tier"` and `"object_step"`; the kubelet
copies it into `containerStatuses[].state.terminated.message`. Only an object-store commit
survives the node: a message whose `durable_tier` is `local` (the checkpoint was on the departing
node's disk only; its uploader ended with the rank, and nothing uploads it later) counts every
step after `object_step` (0 when absent) as lost, whatever its `steps_lost` says.
Each (pod uid, container, finishedAt) exit is counted once; the record keeps what was counted.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

from spotguard.supervisor.record import MAX_COUNTED_EXITS, Record
from spotguard.wire import names
from spotguard.wire.notice import NoticeFormatError, parse_time

DRAIN_CODES = (names.EXIT_PREEMPTED, names.EXIT_CHECKPOINT_FAILED)


def _finished_at(term: Mapping[str, Any]) -> datetime | None:
    try:
        return parse_time(term["finishedAt"], "finishedAt") if term.get("finishedAt") else None
    except NoticeFormatError:
        return None


def drained_exits(pods: Iterable[Mapping[str, Any]], since: datetime | None) -> Iterator[tuple[str, dict]]:
    """("<pod uid>/<container>/<finishedAt>", terminated state) for every container that exited
    83/84 at or after `since` (whole seconds, as the kubelet writes finishedAt; with a `since`, an
    exit without finishedAt is skipped: it cannot be told from an older drain; `since` None: any time)."""
    floor = since.replace(microsecond=0) if since is not None else None
    for pod in pods:
        uid = (pod.get("metadata") or {}).get("uid", "")
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            for state in (status.get("state") or {}, status.get("lastState") or {}):
                term = state.get("terminated") or {}
                if term.get("exitCode") not in DRAIN_CODES:
                    continue
                finished = _finished_at(term)
                if floor is not None and (finished is None or finished < floor):
                    continue
                yield f"{uid}/{status.get('name', '')}/{term.get('finishedAt', '')}", term


def _count(obj: Mapping[str, Any], name: str) -> int | None:
    value = obj.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def steps_lost_of(term: Mapping[str, Any]) -> int:
    """The steps lost a drained container reported in its termination message (0 if none); with
    `durable_tier` "local", at least the steps after `object_step` (see the module docstring)."""
    try:
        obj = json.loads(term.get("message") or "")
    except ValueError:
        return 0
    if not isinstance(obj, dict):
        return 0
    reported = _count(obj, "steps_lost") or 0
    step = _count(obj, "step")
    if obj.get("durable_tier") != "local" or step is None:
        return reported
    return max(reported, step - min(_count(obj, "object_step") or 0, step))


def count_steps_lost(pods: Iterable[Mapping[str, Any]], total: int,
                     counted: tuple[str, ...]) -> tuple[int, tuple[str, ...]] | None:
    """(new total, counted exits) after adding drained exits not counted yet; None if none are new.
    All ranks of a job drain at one agreed step, so the new exits count their largest report once."""
    per_pod: dict[str, int] = {}
    new: list[str] = []
    for exit_id, term in drained_exits(pods, None):
        if exit_id in counted:
            continue
        new.append(exit_id)
        pod_uid = exit_id.split("/", 1)[0]
        per_pod[pod_uid] = max(per_pod.get(pod_uid, 0), steps_lost_of(term))
    if not new:
        return None
    return total + max(per_pod.values(), default=0), (tuple(counted) + tuple(new))[-MAX_COUNTED_EXITS:]


def with_steps_lost(record: Record, pods: Iterable[Mapping[str, Any]]) -> Record:
    """`record` with the steps lost of the drained exits among `pods` not counted yet added."""
    counted = count_steps_lost(pods, record.steps_lost, record.counted_exits)
    if counted is None:
        return record
    total, exits = counted
    return record.with_(steps_lost=total, counted_exits=exits)


def steps_lost_annotation(record: Record) -> str | None:
    """The `spotguard.io/steps-lost` value for `record`: its total once the supervisor decided
    something for the job or counted a drained exit (None: the job carries none)."""
    if record.decided_at is None and not record.counted_exits:
        return None
    return str(record.steps_lost)
