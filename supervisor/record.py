"""The decision record: the JSON in a job's `spotguard.io/status` annotation.

All of the supervisor's memory about a job lives here (and in the job's own spec), so a
restarted or newly elected supervisor reads the record and carries on without repeating an
action. Contract:
- `handled` lists the notice ids already acted on for this job (most recent last, at most
  `MAX_HANDLED`); a notice in it never causes a second action.
- `key` is the idempotency key of the last decision; its Event is named after it, so an Event
  re-sent after a restart collides (409) instead of duplicating.
- Fallback (fallback.py): `capacity` is where the job runs now ("" = as created, "on-demand"
  after a fallback), `spot_directives` the scheduling directives saved before the fallback (per
  pod role, restored on return), `move_to` a move under way, `lacking_since` / `spot_free_since`
  the clocks of `fallback-after` / `return-after`, `drain` the id of the drain notice sent
  through the membership for the return.
- Backfill (backfill.py, placement.py): `below_max_since` / `spot_idle_since` the clocks of
  `fallback-after` / `return-after`, `split` the replica pods placed on each capacity type,
  `backfill` / `backfill_at` / `backfill_event` the last placement, when, and the reason of its
  Event (a placement is a decision: it has its own fields, not `decided_at` and `message`, whose
  clocks the policy reads).
- `generation` / `members` / `store`: the membership last pushed (`store` only for in-place
  jobs, in_place.py); a change of the hosts or the store raises the generation. `member_pods`
  (in place): the incarnations ("<pod uid>/<restarts>") of the member pods it was pushed for,
  so that a group whose every member pod restarted or ended is known to be gone.
  `start_generation` (start at min): the generation pushed as a job's first group, re-pushed
  with its `start` mark for as long as it is the current one; `start_hosts` / `start_store` what
  it listed and `start_pods` its member pods' incarnations (a later membership carries it as
  `first` while every one of those pods is still a member: membership_plan.py). `ready_seen` (in place): when each
  Ready joiner held back by the settle window was first seen Ready (pod uid -> time), so the
  window is the same for a restarted supervisor.
- `awaiting` (phase Checkpointing, fixed policy): the notices the checkpoint wait is for (notice
  id -> its node; "" for a pod Kubernetes takes away), so that a notice the cloud withdraws
  ends the wait.
- `cost` keeps the cost totals (cost.py) and `steps_lost` / `counted_exits` the steps lost
  reported by drained pods, so both survive a restart.
- Reading never fails: a missing, malformed or newer-version record reads as a fresh record
  (`RECORD_ERROR` tells the caller why), and the next decision overwrites it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

from spotguard.wire.notice import NoticeFormatError, format_time, parse_time

RECORD_VERSION = 1
MAX_HANDLED = 32

# Phases
RUNNING = "Running"  # running at the replicas the supervisor chose (or never touched)
CHECKPOINTING = "Checkpointing"  # fixed policy: a notice arrived, waiting for the checkpoint
SUSPENDED = "Suspended"  # suspended by the supervisor, waiting for capacity
GAVE_UP = "GaveUp"  # max-wait passed without capacity: stays suspended, no more waiting
PHASES = (RUNNING, CHECKPOINTING, SUSPENDED, GAVE_UP)
TIMES = ("decided_at", "waiting_since", "checkpoint_deadline", "lacking_since", "spot_free_since", "below_max_since",
         "spot_idle_since", "backfill_at")
MAX_COUNTED_EXITS = 64


@dataclass(frozen=True)
class Record:
    """What the supervisor decided last and why; see the module docstring."""

    phase: str = RUNNING
    reason: str = ""
    message: str = ""
    event: str = ""  # the Event reason that announced the decision
    decided_at: datetime | None = None
    key: str = ""
    replicas: int | None = None  # fixed: replicas to restore; elastic: the last target
    handled: tuple[str, ...] = ()
    waiting_since: datetime | None = None
    checkpoint_deadline: datetime | None = None
    generation: int = 0  # membership generation last pushed
    members: tuple[str, ...] = ()  # membership hosts last pushed
    store: str = ""  # in-place jobs: the rendezvous store last pushed with them
    member_pods: tuple[str, ...] = ()  # in-place jobs: "<pod uid>/<restarts>" of the members pushed
    start_generation: int = 0  # start at min: the generation of the last first group pushed (0: none)
    start_hosts: tuple[str, ...] = ()  # start at min: that first group's hosts
    start_store: str = ""  # start at min: and its store
    start_pods: tuple[str, ...] = ()  # start at min: and its member pods' incarnations
    reclaims_survived: int = 0
    decided_by: str = ""
    capacity: str = ""  # "" (as created) or "on-demand" (fallen back)
    spot_directives: dict | None = None  # {role: {nodeSelector, affinity, tolerations}} before the fallback
    move_to: str = ""  # a move under way: "spot" | "on-demand"
    lacking_since: datetime | None = None  # spot capacity missing since (fallback-after clock)
    spot_free_since: datetime | None = None  # spot capacity free since (return-after clock)
    drain: str = ""  # id of the drain requested through the membership
    cost: dict | None = None  # cost totals (cost.TOTALS)
    steps_lost: int = 0
    counted_exits: tuple[str, ...] = ()  # "<pod uid>/<container>" whose steps lost were counted
    below_max_since: datetime | None = None  # backfill: below max since (fallback-after clock)
    spot_idle_since: datetime | None = None  # backfill: a spot slot free since (return-after clock)
    split: dict | None = None  # backfill: {"spot": n, "on-demand": n} replica pods placed on each
    backfill: str = ""  # backfill: the last placement and why
    backfill_at: datetime | None = None  # backfill: when
    backfill_event: str = ""  # backfill: the reason of the last placement's Event
    ready_seen: dict[str, datetime] | None = None  # in place: Ready joiners held back -> first seen Ready
    awaiting: dict[str, str] | None = None  # checkpoint wait: notice id -> its node ("" for a pod's)

    def handled_add(self, *notice_ids: str) -> tuple[str, ...]:
        kept = [i for i in self.handled if i not in notice_ids] + list(notice_ids)
        return tuple(kept[-MAX_HANDLED:])

    def with_(self, **changes: Any) -> Record:
        return replace(self, **changes)

    def to_json(self) -> str:
        obj = asdict(self)
        obj = {"v": RECORD_VERSION, **obj}
        for name in TIMES:
            value = getattr(self, name)
            obj[name] = None if value is None else format_time(value)
        obj["handled"] = list(self.handled)
        obj["members"] = list(self.members)
        obj["member_pods"] = list(self.member_pods)
        obj["start_hosts"] = list(self.start_hosts)
        obj["start_pods"] = list(self.start_pods)
        obj["counted_exits"] = list(self.counted_exits)
        obj["ready_seen"] = None if self.ready_seen is None else {
            uid: format_time(t) for uid, t in self.ready_seen.items()}
        return json.dumps(obj, separators=(",", ":"), sort_keys=True)


class RecordError(ValueError):
    """The annotation is not a record this supervisor understands."""


def parse_record(text: str | None) -> Record:
    """The record in `text`; RecordError says why it cannot be read (caller starts afresh)."""
    if text is None or text == "":
        return Record()
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise RecordError(f"not JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("v") != RECORD_VERSION:
        raise RecordError(f"unsupported record version {obj.get('v') if isinstance(obj, dict) else None!r}")
    try:
        phase = obj.get("phase", RUNNING)
        if phase not in PHASES:
            raise RecordError(f"unknown phase {phase!r}")
        times = {}
        for name in TIMES:
            value = obj.get(name)
            times[name] = None if value is None else parse_time(value, name)
        replicas = obj.get("replicas")
        if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0):
            raise RecordError(f"replicas: bad value {replicas!r}")
        handled = obj.get("handled", [])
        members = obj.get("members", [])
        counted = obj.get("counted_exits", [])
        member_pods = obj.get("member_pods", [])
        start_hosts = obj.get("start_hosts", [])
        start_pods = obj.get("start_pods", [])
        if not all(isinstance(x, list) and all(isinstance(i, str) for i in x)
                   for x in (handled, members, counted, member_pods, start_hosts, start_pods)):
            raise RecordError("handled/members/counted_exits/member_pods/start_hosts/start_pods: expected lists "
                              "of strings")
        for name in ("spot_directives", "cost", "split", "ready_seen", "awaiting"):
            if obj.get(name) is not None and not isinstance(obj[name], dict):
                raise RecordError(f"{name}: expected an object")
        awaiting = obj.get("awaiting")
        if awaiting is not None and not all(isinstance(v, str) for v in awaiting.values()):
            raise RecordError("awaiting: expected node names")
        ready_seen = obj.get("ready_seen")
        return Record(
            phase=phase,
            reason=str(obj.get("reason", "")),
            message=str(obj.get("message", "")),
            event=str(obj.get("event", "")),
            key=str(obj.get("key", "")),
            replicas=replicas,
            handled=tuple(handled),
            generation=int(obj.get("generation", 0)),
            members=tuple(members),
            store=str(obj.get("store", "")),
            member_pods=tuple(member_pods),
            start_generation=int(obj.get("start_generation", 0)),
            start_hosts=tuple(start_hosts),
            start_store=str(obj.get("start_store", "")),
            start_pods=tuple(start_pods),
            reclaims_survived=int(obj.get("reclaims_survived", 0)),
            decided_by=str(obj.get("decided_by", "")),
            capacity=str(obj.get("capacity", "")),
            spot_directives=obj.get("spot_directives"),
            move_to=str(obj.get("move_to", "")),
            drain=str(obj.get("drain", "")),
            cost=obj.get("cost"),
            steps_lost=int(obj.get("steps_lost", 0)),
            counted_exits=tuple(counted),
            split=obj.get("split"),
            backfill=str(obj.get("backfill", "")),
            backfill_event=str(obj.get("backfill_event", "")),
            ready_seen=None if ready_seen is None else {
                str(uid): parse_time(t, "ready_seen") for uid, t in ready_seen.items()},
            awaiting=awaiting,
            **times,
        )
    except (NoticeFormatError, TypeError, ValueError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError(str(exc)) from None
