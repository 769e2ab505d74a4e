"""The wire layer: one urgency order, one membership codec, and the layer rules it exists for."""
from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

from spotguard.supervisor.membership import membership_json
from spotguard.wire.live import LiveSet
from spotguard.wire.membership import Membership, MembershipFormatError
import json

import pytest

from spotguard.wire.notice import Kind, Notice, NoticeFormatError, Severity, now_utc
from spotguard.wire.urgency import most_urgent, most_urgent_first

ROOT = Path(__file__).resolve().parent.parent
UPPER = ("spotguard.agent", "spotguard.hooks", "spotguard.supervisor", "spotguard.injector",
         "spotguard.trainer", "spotguard.emulator")


def _notice(name: str, deadline_s: float | None, detected_s: float = 0.0) -> Notice:
    base = now_utc()
    deadline = None if deadline_s is None else base + timedelta(seconds=deadline_s)
    return Notice(name, Kind.RECLAIM, "test", "node-1", base + timedelta(seconds=detected_s), deadline)


def test_severity_round_trips_and_is_on_the_wire_only_when_advisory():
    act = _notice("a", 30)
    advisory = Notice("g", Kind.GPU_FAULT, "gpu", "node-1", now_utc(), None, {"signal": "xid_63", "cordon": True},
                      severity=Severity.ADVISORY)
    assert act.severity is Severity.ACT and not act.advisory and "severity" not in act.to_wire()
    assert advisory.advisory and advisory.to_wire()["severity"] == "advisory"
    for notice in (act, advisory):
        again = Notice.from_json(notice.to_json())
        assert again == notice and again.severity is notice.severity
    legacy = act.to_wire()  # an older writer: no severity field -> act
    assert Notice.from_wire(legacy).severity is Severity.ACT
    assert not advisory.same_event(Notice(**{**advisory.__dict__, "severity": Severity.ACT}))


@pytest.mark.parametrize("value", ["urgent", "", 1, None, ["advisory"]])
def test_an_unknown_severity_is_refused_naming_the_field(value):
    wire = {**_notice("a", 30).to_wire(), "severity": value}
    with pytest.raises(NoticeFormatError, match=r"^severity: "):
        Notice.from_json(json.dumps(wire))


def _imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(a.name for a in node.names)
    return modules


def test_most_urgent_first_orders_by_deadline_then_detection_then_id():
    late, early, none = _notice("a", 60), _notice("b", 10), _notice("c", None)
    tie_old, tie_new = _notice("z", 30, detected_s=-5), _notice("y", 30)
    tie_id_b = _notice("m-b", 45)
    tie_id_a = Notice("m-a", Kind.RECLAIM, "test", "node-1", tie_id_b.detected_at, tie_id_b.deadline)
    ordered = most_urgent_first([none, late, tie_id_b, tie_new, early, tie_id_a, tie_old])
    assert [n.id for n in ordered] == ["b", "z", "y", "m-a", "m-b", "a", "c"]
    assert most_urgent([none, late]) is late and most_urgent([]) is None


def test_live_set_lists_notices_in_the_urgency_order():
    live = LiveSet()
    notices = [_notice("x", None), _notice("w", 20, detected_s=1), _notice("v", 20)]
    for notice in notices:
        live.upsert(notice)
    assert live.notices() == most_urgent_first(notices)


def test_membership_written_by_the_supervisor_reads_back_in_the_sidecar():
    text = membership_json(7, ["h2", "h1"], 3, drain="ret-1")
    assert Membership.from_json(text) == Membership(7, ("h2", "h1"), 3, "ret-1")
    assert membership_json(1, ["h"], 1) == '{"generation":1,"hosts":["h"],"v":1,"world_size":1}'
    first = membership_json(2, ["h"], 1, store="10.0.0.1:29411", start=True)
    assert Membership.from_json(first).start and '"start":true' in first
    with pytest.raises(MembershipFormatError, match="start"):
        Membership.from_json(first.replace("true", '"yes"'))


def test_a_later_membership_names_the_first_group_it_descends_from():
    start = Membership(2, ("a", "b"), 2, store="10.0.0.1:29411", start=True)
    later = membership_json(3, ["a", "b", "c"], 3, store="10.0.0.1:29411", first=start)
    assert Membership.from_json(later).first == start
    wire = json.loads(later)
    bad = {"hosts": ["a", "a"]}, {"start": False}, {"generation": 3}, {"store": ""}, {"first": wire["first"]}
    for change in bad:
        with pytest.raises(MembershipFormatError, match=r"^first"):
            Membership.from_wire({**wire, "first": {**wire["first"], **change}})


def test_wire_imports_no_part_above_it():
    offenders = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / "spotguard" / "wire").glob("*.py"))
                 for m in _imports(p) if m.startswith(UPPER)]
    assert offenders == []


def test_hooks_supervisor_and_injector_never_import_the_agent():
    offenders = [f"{p.relative_to(ROOT)}: {m}" for part in ("hooks", "supervisor", "injector")
                 for p in sorted((ROOT / part).rglob("*.py")) for m in _imports(p)
                 if m == "spotguard.agent" or m.startswith("spotguard.agent.")]
    assert offenders == []
