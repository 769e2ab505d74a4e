"""The stream snapshot (docs/protocols.md) and the one rule every consumer applies to it.

A snapshot is `{"v": 1, "node": ..., "notices": [...], "complete": bool}`. `complete` says
whether the producer's set is authoritative: the agent sets it once every one of its sources
has read at least once since it started, the sidecar once it has applied a complete snapshot
of its agent. A snapshot without the field (a producer older than the field) counts as
complete, which is what consumers assumed before it existed.

`reconcile(held, snapshot)` is the rule, shared by the sidecar's relay and the Guard's
listener so the two never disagree: every notice of the snapshot that is new or changed is
(re)delivered; a held notice the snapshot lacks is withdrawn only when the snapshot is
complete. An incomplete snapshot never withdraws anything: after a restart the producer has
simply not re-read the signal yet. Pure functions, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping

from spotguard.wire.fields import versioned_object
from spotguard.wire.notice import WIRE_VERSION, Notice, NoticeFormatError


@dataclass(frozen=True)
class Snapshot:
    """A parsed snapshot: the producer's node (None when unnamed), its live notices, and
    whether that set is authoritative."""

    node: str | None
    notices: list[Notice]
    complete: bool = True


@dataclass(frozen=True)
class SnapshotDiff:
    """What applying a snapshot to a held set changes: notices to (re)deliver, ids to withdraw."""

    upserts: list[Notice] = field(default_factory=list)
    withdrawn: list[str] = field(default_factory=list)


def snapshot_wire(node: str | None, notices: Iterable[Notice], complete: bool) -> dict[str, Any]:
    """The wire object of a snapshot (also the body of GET /v1/notices)."""
    return {"v": WIRE_VERSION, "node": node, "notices": [n.to_wire() for n in notices], "complete": complete}


def parse_snapshot(obj: Any) -> Snapshot:
    """A snapshot wire object, validated whole: NoticeFormatError names the first bad part, and
    a snapshot with any bad part is refused entirely (a half-read snapshot must not withdraw)."""
    obj = versioned_object(obj, WIRE_VERSION, NoticeFormatError, "snapshot", "wire version")
    notices = obj.get("notices")
    if not isinstance(notices, list):
        raise NoticeFormatError("notices: expected a list")
    complete = obj.get("complete", True)
    if not isinstance(complete, bool):
        raise NoticeFormatError(f"complete: expected true or false, got {complete!r:.20}")
    parsed = []
    for index, item in enumerate(notices):
        try:
            parsed.append(Notice.from_wire(item))
        except NoticeFormatError as exc:
            raise NoticeFormatError(f"notices[{index}]: {exc}") from None
    node = obj.get("node")
    return Snapshot(node if isinstance(node, str) and node else None, parsed, complete)


def reconcile(held: Mapping[str, Notice], snapshot: Snapshot) -> SnapshotDiff:
    """The changes `snapshot` makes to the notices a consumer holds (by id); see the module
    docstring. Notices identical to what is held (`same_event`) are not redelivered."""
    fresh = {n.id: n for n in snapshot.notices}
    upserts = [n for n in fresh.values() if n.id not in held or not held[n.id].same_event(n)]
    withdrawn = [i for i in held if i not in fresh] if snapshot.complete else []
    return SnapshotDiff(upserts, withdrawn)
