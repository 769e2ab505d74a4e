"""The live-notice set every consumer of a notice stream keeps: pure, no I/O.

`LiveSet` is the set of live notices by id: a snapshot is applied by the rule every consumer
shares (`wire.snapshot.reconcile`: new or changed notices upserted; held ones it lacks
withdrawn only when the snapshot is complete), a notice upserts, a withdrawal removes. Every
method returns only the *changes* it made, so a reconnect whose snapshot repeats what we hold
changes nothing downstream (no duplicate, no withdrawal); an incomplete snapshot (a producer
whose sources have not all read since it restarted) never withdraws; and a notice withdrawn
while the consumer was disconnected is withdrawn downstream once a complete snapshot lacks it.
`LiveSet.complete` turns true with the first complete snapshot and stays so; that first one
also yields a `Change(resync=True)`. Used by the sidecar's relay (hooks/sidecar/relay.py) and
the Guard's listener (hooks/notice_listener.py). Not thread-safe: one owner at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotguard.wire.notice import Notice
from spotguard.wire.snapshot import Snapshot, reconcile
from spotguard.wire.urgency import most_urgent_first
from spotguard.wire.withdrawal import Withdrawal


@dataclass(frozen=True)
class Change:
    """One change to the live set: a new/changed notice, a withdrawal, or (`resync`) the set
    becoming complete (authoritative) for the first time."""

    notice: Notice | None = None
    withdrawal: Withdrawal | None = None
    resync: bool = False

    def to_event(self) -> tuple[str, dict[str, Any]]:
        """(event, data) of a notice or withdrawal; a resync has no event of its own."""
        if self.notice is not None:
            return "notice", self.notice.to_wire()
        assert self.withdrawal is not None
        return "withdrawn", self.withdrawal.to_wire()


class LiveSet:
    """Live notices by id. Every mutation returns the list of changes it made."""

    def __init__(self, remember: int = 1024) -> None:
        self._notices: dict[str, Notice] = {}
        self.node: str | None = None
        self.remember = remember
        self._seen: dict[str, None] = {}  # ids ever live, oldest first, at most `remember`
        self.complete = False  # a complete snapshot has been applied
        self._local: set[str] = set()  # ids of notices raised in this pod (set_local), not the agent's

    def seen(self, notice_id: str) -> bool:
        """True if the notice is or was live (among the last `remember` ids)."""
        return notice_id in self._seen

    def notices(self) -> list[Notice]:
        """Live notices, most urgent first (`wire.urgency`)."""
        return most_urgent_first(self._notices.values())

    def get(self, notice_id: str) -> Notice | None:
        return self._notices.get(notice_id)

    def __len__(self) -> int:
        return len(self._notices)

    def upsert(self, notice: Notice) -> list[Change]:
        held = self._notices.get(notice.id)
        if held is not None and held.same_event(notice):
            return []
        self._notices[notice.id] = notice
        self._seen[notice.id] = None
        if len(self._seen) > self.remember:
            del self._seen[next(iter(self._seen))]
        return [Change(notice=notice)]

    def withdraw(self, withdrawal: Withdrawal) -> list[Change]:
        if self._notices.pop(withdrawal.notice_id, None) is None:
            return []
        return [Change(withdrawal=withdrawal)]

    def apply_snapshot(self, snapshot: Snapshot) -> list[Change]:
        """Applies a snapshot by the shared rule (module docstring)."""
        if snapshot.node:
            self.node = snapshot.node
        diff = reconcile({k: n for k, n in self._notices.items() if k not in self._local}, snapshot)
        changes = []
        for notice_id in diff.withdrawn:
            held = self._notices.pop(notice_id)
            changes.append(Change(withdrawal=Withdrawal(notice_id, held.source, held.node, "absent from snapshot")))
        for notice in diff.upserts:
            changes.extend(self.upsert(notice))
        if snapshot.complete and not self.complete:
            self.complete = True
            changes.append(Change(resync=True))
        return changes

    def set_local(self, notices: list[Notice], reason: str = "request withdrawn") -> list[Change]:
        """Makes the pod-local notices (not the agent's: e.g. the supervisor's drain request)
        equal to `notices`. Agent snapshots never withdraw them; only this call does."""
        changes: list[Change] = []
        wanted = {n.id: n for n in notices}
        for notice_id in sorted(self._local - wanted.keys()):
            held = self._notices.pop(notice_id, None)
            if held is not None:
                changes.append(Change(withdrawal=Withdrawal(notice_id, held.source, held.node, reason)))
        self._local = set(wanted)
        for notice in notices:
            changes.extend(self.upsert(notice))
        return changes

    def replace(self, notices: list[Notice], node: str | None = None) -> list[Change]:
        """Makes the set equal to the notices of a complete snapshot."""
        return self.apply_snapshot(Snapshot(node, notices, complete=True))
