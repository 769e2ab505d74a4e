"""What the dry-run records of its cluster while it runs, from the local API's writes
(`LocalKube.subscribe`): the supervisor's decisions and memberships (its decision record on the
Job, supervisor/record.py) and each pod's life. Nothing here decides anything.

- `SupervisorLog`: every new decision (a new `key` in the record: time, action, replicas, reason,
  message), every new backfill placement (its reason), and every new membership generation
  (hosts, and its cause: `start` (the first group of a start-at-min job), `relaunch` (a new group
  after the last one was gone: none of its member pods runs in the new one), `admitted` (hosts
  added, a swap included) or `left`);
- `PodLog`: per pod, when it was created, placed (its scheduling gate removed), bound (and to
  which node), started (Running), Ready, and finished (with its exit code), and whether its
  container was killed with its node.
Both are fed from whichever thread wrote (a listener); reads take a copy.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from spotguard.kube.api import JOBS, PODS
from spotguard.supervisor.record import Record, RecordError, parse_record
from spotguard.trainer.report import MembershipRecord
from spotguard.wire import names

ACTIONS = {names.EVENT_SCALED: "scale", names.EVENT_SUSPENDED: "suspend", names.EVENT_RESUMED: "resume",
           names.EVENT_FELL_BACK: "move", names.EVENT_RETURNED: "move"}


class SupervisorLog:
    """See the module docstring. `job`: the name of the Job to follow; `first_group`: the hosts
    its launcher starts with (a first membership is compared with them)."""

    def __init__(self, job: str, first_group: list[str] | None = None):
        self.job = job
        self.first_group = list(first_group or [])
        self.decisions: list[dict] = []
        self.memberships: list[MembershipRecord] = []
        self.backfill_steps: list[dict] = []  # {"t", "backfill"}: each new placement reason
        self.record = Record()
        self._member_pods: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def __call__(self, kind: str, resource: str, obj: dict) -> None:
        if resource != str(JOBS) or (obj.get("metadata") or {}).get("name") != self.job or kind == "DELETED":
            return
        try:
            record = parse_record(((obj.get("metadata") or {}).get("annotations") or {}).get(names.ANN_STATUS))
        except RecordError:
            return
        with self._lock:
            self._follow(record, time.time())

    def _follow(self, record: Record, now: float) -> None:
        if record.key and record.key != self.record.key:
            self.decisions.append({"t": now, "action": ACTIONS.get(record.event, "record"),
                                   "replicas": record.replicas, "reason": record.reason, "message": record.message})
        if record.backfill and (record.backfill, record.backfill_at) != (self.record.backfill, self.record.backfill_at):
            self.backfill_steps.append({"t": now, "backfill": record.backfill})
        if record.generation > self.record.generation and record.members:
            previous = self.memberships[-1].hosts if self.memberships else self.first_group
            if record.start_generation == record.generation:
                cause = "start"
            elif self._member_pods and record.member_pods and not set(self._member_pods) & set(record.member_pods):
                cause = "relaunch"
            elif set(record.members) - set(previous):
                cause = "admitted"
            else:
                cause = "left"
            self.memberships.append(MembershipRecord(record.generation, list(record.members), now, cause))
            self._member_pods = record.member_pods
        self.record = record

    def snapshot(self) -> tuple[list[dict], list[MembershipRecord], Record]:
        with self._lock:
            return list(self.decisions), list(self.memberships), self.record


@dataclass
class PodLife:
    """One pod as the cluster saw it (wall-clock times; None: not (yet))."""

    name: str
    uid: str
    index: int
    created: float
    gated: bool = False
    placed: float | None = None
    node: str | None = None
    bound: float | None = None
    started: float | None = None
    ready: float | None = None
    finished: float | None = None
    exit_code: int | None = None
    node_lost: bool = False


class PodLog:
    """See the module docstring."""

    def __init__(self) -> None:
        self.pods: dict[str, PodLife] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, resource: str, obj: dict) -> None:
        if resource != str(PODS) or kind == "DELETED":
            return
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        now = time.time()
        with self._lock:
            life = self.pods.get(meta.get("name", ""))
            if life is None:
                index = str((meta.get("annotations") or {}).get("batch.kubernetes.io/job-completion-index", "-1"))
                life = self.pods[meta.get("name", "")] = PodLife(
                    meta.get("name", ""), meta.get("uid", ""), int(index) if index.lstrip("-").isdigit() else -1,
                    now, gated=bool(spec.get("schedulingGates")))
            self._update(life, spec, status, now)

    @staticmethod
    def _update(life: PodLife, spec: dict, status: dict, now: float) -> None:
        if life.gated and life.placed is None and not spec.get("schedulingGates"):
            life.placed = now
        if spec.get("nodeName") and life.bound is None:
            life.node, life.bound = spec["nodeName"], now
        if status.get("phase") == "Running" and life.started is None:
            life.started = now
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ready and life.ready is None:
            life.ready = now
        if status.get("phase") in ("Succeeded", "Failed") and life.finished is None:
            life.finished = now
            life.node_lost = status.get("reason") == "NodeLost"
            for state in status.get("containerStatuses") or []:
                code = ((state.get("state") or {}).get("terminated") or {}).get("exitCode")
                if code is not None:
                    life.exit_code = code

    def snapshot(self) -> list[PodLife]:
        with self._lock:
            return [PodLife(**vars(p)) for p in self.pods.values()]
