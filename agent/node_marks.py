"""The marks a Node should carry for the live notices, as pure functions (no I/O, no clock).

`plan_marks(node, desired, ...)` compares the Node as read with the desired live notices and
returns a `MarkPlan`: the patch that brings the Node there (None: nothing to change, or a
removal held back), the id of the notice it marks (None: it unmarks) and when to look again.
The rules (annotation, taint, cordon, boot id, restart grace, maintenance reboot) are those of
`agent/node_marker.py`'s module docstring; `NodeMarker` applies the plan.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.wire import names, notice_policy
from spotguard.wire.notice import Kind, Notice, NoticeFormatError, format_time





@dataclass(frozen=True)
class MarkPlan:
    """One pass's plan: `patch` None = leave the Node as it is; `marked` the notice id the patch
    marks (None: it unmarks); `adopted` a notice id found marked already as wanted (it becomes
    ours); `recheck_in` seconds until a held-back removal is due."""

    patch: dict | None = None
    marked: str | None = None
    adopted: str | None = None
    recheck_in: float | None = None


def rebooted_past(current: Notice | None, marked_boot: str | None, boot_id: str | None,
                  desired: list[Notice] | None, mine: set[str], now: datetime) -> bool:
    """The maintenance-reboot rule: a foreign maintenance mark past its deadline, not live, on
    a Node whose bootID differs from the one recorded at marking (or either is unknown)."""
    if current is None or current.kind is not Kind.MAINTENANCE or current.id in mine:
        return False
    if current.deadline is None or current.deadline > now:
        return False
    if desired is not None and any(n.id == current.id for n in desired):
        return False
    return not (marked_boot and boot_id and marked_boot == boot_id)


def plan_marks(node: dict, desired: list[Notice] | None, *, mine: set[str], cordon: bool, grace_left: float,
               now: datetime) -> MarkPlan:
    """The plan for `node` (see the module docstring). `mine`: notice ids this process marked;
    `grace_left`: seconds the restart grace still holds a foreign mark; `now`: the wall clock."""
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    spec = node.get("spec") or {}
    taints = list(spec.get("taints") or [])
    boot_id = ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID") or None
    current_text = annotations.get(names.ANN_NOTICE)
    current = parse_notice(current_text)
    urgent = marked_notice(desired or ())

    if urgent is not None:
        want_marked = True
    elif current_text is None and names.ANN_CORDONED not in annotations and not our_taints(taints):
        return MarkPlan()  # nothing of ours on the Node
    elif rebooted_past(current, annotations.get(names.ANN_NOTICE_BOOT_ID), boot_id, desired, mine, now):
        want_marked = False
    elif desired is None:
        return MarkPlan()  # no view of the live notices yet: keep what is there
    elif current is None or current.id in mine:
        want_marked = False
    elif grace_left > 0:
        return MarkPlan(recheck_in=grace_left)
    else:
        want_marked = False

    changes: dict[str, Any] = {}
    spec_changes: dict[str, Any] = {}
    others = [t for t in taints if t.get("key") != names.TAINT_RECLAIM]
    mark = urgent if want_marked else None  # want_marked is set only with a live urgent notice
    if mark is not None:
        text = mark.to_json()
        if current_text != text:
            changes[names.ANN_NOTICE] = text
        if boot_id and annotations.get(names.ANN_NOTICE_BOOT_ID) != boot_id:
            changes[names.ANN_NOTICE_BOOT_ID] = boot_id
        ours = our_taints(taints)
        wanted = {"key": names.TAINT_RECLAIM, "value": str(mark.kind), "effect": names.TAINT_EFFECT}
        if len(ours) != 1 or {k: ours[0].get(k) for k in wanted} != wanted:
            spec_changes["taints"] = [*others, wanted]
        if cordon and not spec.get("unschedulable") and names.ANN_CORDONED not in annotations:
            spec_changes["unschedulable"] = True
            changes[names.ANN_CORDONED] = "true"
    else:
        for key in (names.ANN_NOTICE, names.ANN_NOTICE_BOOT_ID, names.ANN_CORDONED):
            if key in annotations:
                changes[key] = None
        if len(others) != len(taints):
            spec_changes["taints"] = others
        if annotations.get(names.ANN_CORDONED) == "true" and spec.get("unschedulable"):
            spec_changes["unschedulable"] = False
    if not changes and not spec_changes:
        return MarkPlan(adopted=mark.id if mark is not None else None)
    patch: dict[str, Any] = {"metadata": {}}
    if meta.get("resourceVersion"):
        patch["metadata"]["resourceVersion"] = meta["resourceVersion"]
    if changes:
        patch["metadata"]["annotations"] = changes
    if spec_changes:
        patch["spec"] = spec_changes
    return MarkPlan(patch=patch, marked=mark.id if mark is not None else None)


def marked_notice(notices: Iterable[Notice]) -> Notice | None:
    """The notice the Node's mark shows: the first to depart whatever a job's horizon
    (`notice_policy.departure_order`: a GPU fault with no deadline outranks a maintenance an hour
    out, and a maintenance outranks an advisory due sooner, so a job whose horizon reaches the
    maintenance sees it). None when there is none."""
    return min(notices, key=notice_policy.departure_order, default=None)


def our_taints(taints: list[dict]) -> list[dict]:
    return [t for t in taints if t.get("key") == names.TAINT_RECLAIM]


def parse_notice(text: str | None) -> Notice | None:
    """The notice in an annotation value; None when absent or not ours to read (a foreign
    mark, replaced or removed)."""
    if not text:
        return None
    try:
        return Notice.from_json(text)
    except NoticeFormatError:
        return None


def notice_message(notice: Notice) -> str:
    """The Event message that explains a notice."""
    deadline = "no deadline" if notice.deadline is None else f"deadline {format_time(notice.deadline)}"
    return f"{notice.kind} notice from {notice.source} ({deadline}); id {notice.id}"
