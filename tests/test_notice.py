"""The notice model and its wire form."""
from datetime import datetime, timedelta, timezone, UTC

import pytest
from hypothesis import given, strategies as st

from spotguard.wire.notice import WIRE_VERSION, Kind, Notice, NoticeFormatError, notice_id
from spotguard.wire.withdrawal import Withdrawal

T0 = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)


def make(**over):
    fields = dict(id="aws.spot:abc", kind=Kind.RECLAIM, source="aws.spot", node="n1", detected_at=T0,
                  deadline=T0 + timedelta(seconds=120), detail={"action": "terminate", "n": [1, 2.5, None]})
    fields.update(over)
    return Notice(**fields)


def test_round_trip_exact():
    notice = make()
    again = Notice.from_json(notice.to_json())
    assert again == notice
    assert again.to_wire()["v"] == WIRE_VERSION
    assert again.to_wire()["deadline"] == "2026-01-02T03:06:05.123456Z"


def test_no_deadline_round_trips_as_null():
    notice = make(deadline=None)
    assert notice.to_wire()["deadline"] is None
    assert Notice.from_json(notice.to_json()).deadline is None


def test_other_zones_are_normalised_to_utc():
    plus2 = timezone(timedelta(hours=2))
    notice = make(detected_at=T0.astimezone(plus2))
    assert notice.detected_at.tzinfo == UTC
    assert notice.detected_at == T0


@pytest.mark.parametrize("mutate, field", [
    (lambda w: w.update(v=2), "v"),
    (lambda w: w.update(v=True), "v"),
    (lambda w: w.pop("id"), "id"),
    (lambda w: w.update(kind="explode"), "kind"),
    (lambda w: w.update(deadline="2026-01-02T03:04:05"), "deadline"),
    (lambda w: w.update(detected_at=12), "detected_at"),
    (lambda w: w.update(detail=[1]), "detail"),
    (lambda w: w.update(node=""), "node"),
])
def test_bad_wire_objects_name_the_field(mutate, field):
    wire = make().to_wire()
    mutate(wire)
    with pytest.raises(NoticeFormatError, match=field):
        Notice.from_wire(wire)


def test_unknown_extra_fields_are_ignored():
    wire = make().to_wire()
    wire["future_field"] = {"x": 1}
    assert Notice.from_wire(wire) == make()


def test_naive_datetime_rejected():
    with pytest.raises(NoticeFormatError, match="detected_at"):
        make(detected_at=datetime(2026, 1, 1))


def test_ids_are_stable_and_node_scoped():
    assert notice_id("aws.spot", "n1", "terminate", "t") == notice_id("aws.spot", "n1", "terminate", "t")
    assert notice_id("aws.spot", "n1", "terminate", "t") != notice_id("aws.spot", "n2", "terminate", "t")
    assert notice_id("aws.spot", "n1", "terminate", "t").startswith("aws.spot:")


def test_withdrawal_wire():
    assert Withdrawal("x", "aws.maintenance", "n1").to_wire()["withdrawn"] == "x"


@given(st.one_of(st.none(), st.integers(), st.text(max_size=50), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=10), st.one_of(st.text(max_size=20), st.integers(), st.none()),
                                 max_size=8)))
def test_arbitrary_wire_objects_never_crash(obj):
    try:
        Notice.from_wire(obj)
    except NoticeFormatError:
        pass


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data):
    try:
        Notice.from_json(data)
    except NoticeFormatError:
        pass
