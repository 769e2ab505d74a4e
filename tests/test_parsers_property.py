"""Property tests: arbitrary answers thrown at the body parsing of every cloud's sources.

Every source parses one HTTP answer with a pure function (status, headers, body) -> notices.
Whatever comes in, such a function returns notices or raises SourceError, nothing else; a body
that is not a valid answer (wrong status, corrupt, truncated, of the wrong shape) never becomes a
notice; and a valid answer becomes exactly the notices it describes, with ids that change with
the instance they are on. The instance ids those ids take are fuzzed the same way.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, UTC

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from spotguard.agent.sources import alibaba, aws, azure, gcp
from spotguard.agent.sources.base import SourceError
from spotguard.agent.sources.instance import FALLBACK, parse_instance_id
from spotguard.emulator.clouds.gcp import value_etag
from spotguard.emulator.clouds.timefmt import aws_maintenance, iso_z, rfc1123
from spotguard.wire.notice import Kind, Notice, notice_id

NODE = "node-1"
VM = "vmss_vm_1"
INSTANCE = "i-0123456789abcdef0"  # the instance part every parser puts in its ids
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
GOOGLE = {"Metadata-Flavor": "Google", "ETag": "0123abcd"}

fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gcp(parse):
    def run(status, headers, body, instance=INSTANCE):
        return parse(status, headers, body, node=NODE, detected_at=NOW, instance=instance)[1]
    return run


def _azure(status, headers, body, instance=INSTANCE):
    return azure.parse_scheduled_events(status, headers, body, node=NODE, vm_name=VM, now=NOW,
                                        instance=instance).notices


def _plain(parse):
    def run(status, headers, body, instance=INSTANCE):
        return parse(status, headers, body, node=NODE, now=NOW, instance=instance)
    return run


PARSERS = {
    "aws.spot": _plain(aws.parse_instance_action),
    "aws.rebalance": _plain(aws.parse_rebalance),
    "aws.maintenance": _plain(aws.parse_maintenance),
    "aws.asg": _plain(aws.parse_lifecycle),
    "gcp.preempted": _gcp(gcp.parse_preempted),
    "gcp.maintenance": _gcp(gcp.parse_maintenance_event),
    "azure.events": _azure,
    "alibaba.spot": _plain(alibaba.parse_termination_time),
}
JSON_PARSERS = ("aws.spot", "aws.rebalance", "aws.maintenance", "azure.events")


def outcome(name: str, status: int, headers: dict, body: bytes) -> list[Notice] | SourceError:
    """The parser's result, or the SourceError it raised; any other exception fails the test."""
    try:
        result = PARSERS[name](status, headers, body)
    except SourceError as exc:
        assert exc.reason and isinstance(exc.reason, str)
        return exc
    assert isinstance(result, list) and all(isinstance(n, Notice) for n in result), result
    for notice in result:
        assert notice.source == name and notice.node == NODE
        Notice.from_json(notice.to_json())  # every notice survives its own wire form
    return result


# -- strategies ------------------------------------------------------------------------------

times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31),
                     timezones=st.just(UTC)).map(lambda d: d.replace(microsecond=0))
statuses = st.one_of(st.just(200), st.just(404), st.integers(100, 599))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25)
headers = st.one_of(
    st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=4),
    st.builds(lambda extra, etag: {**GOOGLE, "ETag": etag, **extra},
              st.dictionaries(st.sampled_from(["Content-Type", "metadata-flavor", "etag"]),
                              st.text(max_size=20), max_size=2),
              st.text(max_size=40)),
    st.just(GOOGLE))
word_bodies = st.sampled_from([b"TRUE", b"FALSE", b"NONE", b"MIGRATE_ON_HOST_MAINTENANCE",
                               b"TERMINATE_ON_HOST_MAINTENANCE", b"Terminated", b"InService", b"true",
                               b"2015-01-05T18:02:00Z", b"2015-01-05T18:02:00", b"null", b"[]", b"{}"])


def azure_event(event_type, status, resources, when, event_id):
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine", "Resources": resources,
            "EventStatus": status, "NotBefore": "" if when is None else rfc1123(when.timestamp()),
            "Description": "d", "EventSource": "Platform", "DurationInSeconds": -1}


azure_events = st.builds(
    azure_event,
    st.sampled_from(["Preempt", "Terminate", "Reboot", "Redeploy", "Freeze", "LiveMigrate"]),
    st.sampled_from(["Scheduled", "Started"]),
    st.lists(st.sampled_from([VM, "VMSS_VM_1", "vmss_vm_2", "other"]), max_size=3),
    st.none() | times,
    st.uuids().map(str))
azure_docs = st.builds(lambda n, events: {"DocumentIncarnation": n, "Events": events},
                       st.integers(0, 10**6), st.lists(azure_events, max_size=5, unique_by=lambda e: e["EventId"]))
aws_maintenance_events = st.builds(
    lambda when, state, event_id: {"NotBefore": aws_maintenance(when.timestamp()), "Code": "system-reboot",
                                   "Description": "d", "EventId": event_id, "State": state,
                                   "NotAfter": aws_maintenance(when.timestamp() + 600)},
    times, st.sampled_from(["active", "completed", "canceled"]), st.text(min_size=1, max_size=20))

VALID_BODIES = {
    "aws.spot": st.builds(lambda a, t: json.dumps({"action": a, "time": iso_z(t.timestamp())}),
                          st.sampled_from(aws.SPOT_ACTIONS), times),
    "aws.rebalance": times.map(lambda t: json.dumps({"noticeTime": iso_z(t.timestamp())})),
    "aws.maintenance": st.lists(aws_maintenance_events, max_size=4).map(json.dumps),
    "aws.asg": st.sampled_from(aws.LIFECYCLE_STATES),
    "gcp.preempted": st.sampled_from(gcp.PREEMPTED_VALUES),
    "gcp.maintenance": st.sampled_from(gcp.MAINTENANCE_VALUES),
    "azure.events": azure_docs.map(json.dumps),
    "alibaba.spot": times.map(lambda t: iso_z(t.timestamp())),
}


def any_body(name):
    return st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode), word_bodies,
                     json_values.map(lambda v: json.dumps(v).encode()),
                     VALID_BODIES[name].map(str.encode))


# -- properties ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PARSERS))
@fuzz
@given(data=st.data())
def test_anything_in_gives_notices_or_source_error(name, data):
    status = data.draw(statuses, "status")
    result = outcome(name, status, data.draw(headers, "headers"), data.draw(any_body(name), "body"))
    if status != 200:
        assert not (isinstance(result, list) and result), "a non-200 answer became a notice"


@pytest.mark.parametrize("name", sorted(PARSERS))
@fuzz
@given(data=st.data())
def test_truncated_valid_bodies_never_become_notices(name, data):
    body = data.draw(VALID_BODIES[name], "valid body").encode()
    cut = data.draw(st.integers(0, max(len(body) - 1, 0)), "cut")
    result = outcome(name, 200, dict(GOOGLE), body[:cut])
    assert isinstance(result, SourceError), f"{body[:cut]!r} was accepted: {result!r}"


@pytest.mark.parametrize("name", sorted(PARSERS))
@fuzz
@given(data=st.data())
def test_non_200_never_becomes_a_notice(name, data):
    status = data.draw(st.integers(100, 599).filter(lambda s: s not in (200, 404)), "status")
    result = outcome(name, status, dict(GOOGLE), data.draw(VALID_BODIES[name], "body").encode())
    assert isinstance(result, SourceError)


@pytest.mark.parametrize("name", JSON_PARSERS)
@fuzz
@given(value=json_values)
@example(value=[[[["deep"]]]])
def test_json_of_the_wrong_shape_is_malformed(name, value):
    """Random JSON rarely has the right shape; when it does not, the parser says 'malformed'."""
    result = outcome(name, 200, {}, json.dumps(value).encode())
    if isinstance(result, list) and result:
        assert isinstance(value, (dict, list))  # only a document of the right shape yields notices
    if isinstance(result, SourceError):
        assert result.reason == "malformed"


@pytest.mark.parametrize("name", JSON_PARSERS)
@pytest.mark.parametrize("body", [b"[" * 60000, b'{"a":' * 30000, b"1" * 5000, b"\xff\xfe{}", b"NaN"])
def test_pathological_json_is_malformed(name, body):
    result = outcome(name, 200, {}, body)
    assert isinstance(result, SourceError) and result.reason == "malformed"


# -- exact results of valid answers -----------------------------------------------------------

@fuzz
@given(action=st.sampled_from(aws.SPOT_ACTIONS), when=times)
def test_aws_spot_valid(action, when):
    stamp = iso_z(when.timestamp())
    [notice] = outcome("aws.spot", 200, {}, json.dumps({"action": action, "time": stamp}).encode())
    assert notice.kind is Kind.RECLAIM and notice.deadline == when
    assert notice.id == notice_id("aws.spot", NODE, INSTANCE, action, stamp)


@fuzz
@given(events=st.lists(aws_maintenance_events, max_size=4, unique_by=lambda e: e["EventId"]))
def test_aws_maintenance_valid(events):
    notices = outcome("aws.maintenance", 200, {}, json.dumps(events).encode())
    active = [e for e in events if e["State"] == "active"]
    assert [n.id for n in notices] == [notice_id("aws.maintenance", NODE, INSTANCE, e["EventId"]) for e in active]
    assert all(n.kind is Kind.MAINTENANCE for n in notices)


@pytest.mark.parametrize("name, value, kind", [
    ("gcp.preempted", "TRUE", Kind.RECLAIM), ("gcp.preempted", "FALSE", None),
    ("gcp.maintenance", "MIGRATE_ON_HOST_MAINTENANCE", Kind.MAINTENANCE),
    ("gcp.maintenance", "TERMINATE_ON_HOST_MAINTENANCE", Kind.MAINTENANCE), ("gcp.maintenance", "NONE", None)])
@fuzz
@given(extra=st.dictionaries(st.sampled_from(["Content-Type", "Date", "Server"]), st.text(max_size=10)))
def test_gcp_valid_and_flavor_required(name, value, kind, extra):
    etag = value_etag("/x", value)
    answer = {**extra, "Metadata-Flavor": "Google", "ETag": etag}
    notices = outcome(name, 200, answer, value.encode())
    if kind is None:
        assert notices == []
    else:
        [notice] = notices
        assert notice.kind is kind and notice.id == notice_id(name, NODE, INSTANCE, etag)
        assert notice.deadline > notice.detected_at == NOW
    for flavor in (None, "google", "Amazon"):
        wrong = {k: v for k, v in answer.items() if k != "Metadata-Flavor"}
        if flavor is not None:
            wrong["Metadata-Flavor"] = flavor
        result = outcome(name, 200, wrong, value.encode())
        assert isinstance(result, SourceError) and result.reason == "flavor"


@fuzz
@given(doc=azure_docs)
def test_azure_valid_document(doc):
    notices = outcome("azure.events", 200, {}, json.dumps(doc).encode())
    known = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
    mine = [e for e in doc["Events"] if VM.casefold() in (r.casefold() for r in e["Resources"])
            and e["EventType"] in known]
    assert [n.detail["EventId"] for n in notices] == [e["EventId"] for e in mine]
    for notice, event in zip(notices, mine):
        assert notice.id == notice_id("azure.events", NODE, INSTANCE, event["EventId"])
        assert notice.kind is (Kind.RECLAIM if event["EventType"] in ("Preempt", "Terminate") else Kind.MAINTENANCE)
        if event["EventStatus"] == "Started" or not event["NotBefore"]:
            assert notice.deadline == NOW
        else:
            assert rfc1123(notice.deadline.timestamp()) == event["NotBefore"]


@fuzz
@given(doc=azure_docs, field=st.sampled_from(["EventId", "EventStatus", "Resources", "NotBefore", "EventType"]),
       value=json_values)
def test_azure_damaged_event_never_yields_a_wrong_notice(doc, field, value):
    if not doc["Events"]:
        return
    doc["Events"][0][field] = value
    result = outcome("azure.events", 200, {}, json.dumps(doc).encode())
    if isinstance(result, list):
        ids = {e["EventId"] for e in doc["Events"] if isinstance(e["EventId"], str)}
        assert all(n.detail["EventId"] in ids for n in result)
        assert all(n.detail["EventStatus"] in ("Scheduled", "Started") for n in result)


def test_azure_keeps_the_first_deadline_of_a_started_event():
    doc = {"DocumentIncarnation": 3, "Events": [azure_event("Preempt", "Started", [VM], None, "e1")]}
    body = json.dumps(doc).encode()
    first = azure.parse_scheduled_events(200, {}, body, node=NODE, vm_name=VM, now=NOW).notices
    later = azure.parse_scheduled_events(200, {}, body, node=NODE, vm_name=VM, now=NOW + timedelta(seconds=9),
                                         previous={n.id: n for n in first}).notices
    assert later[0].deadline == first[0].deadline == NOW


@fuzz
@given(when=times, zone=st.sampled_from(["Z", "+00:00", "+08:00"]))
def test_alibaba_valid(when, zone):
    text = when.strftime("%Y-%m-%dT%H:%M:%S") + zone
    [notice] = outcome("alibaba.spot", 200, {}, text.encode())
    offset = timedelta(hours=8) if zone == "+08:00" else timedelta(0)
    assert notice.deadline == when - offset and notice.kind is Kind.RECLAIM
    assert outcome("alibaba.spot", 404, {}, b"<html>404</html>") == []


@fuzz
@given(name=st.text(max_size=300).map(str.encode) | st.binary(max_size=300))
def test_azure_vm_name(name):
    try:
        parsed = azure.parse_vm_name(200, {}, name)
    except SourceError:
        return
    assert parsed == parsed.strip() and parsed and " " not in parsed and parsed.isascii()


# -- the instance in the ids, and the instance ids themselves -----------------------------------

@pytest.mark.parametrize("name", sorted(PARSERS))
@fuzz
@given(data=st.data(), other=st.text(min_size=1, max_size=40))
def test_the_same_answer_on_another_instance_has_other_ids(name, data, other):
    """A VM re-created under the same name can serve the very same answer: its notices are the
    same events with new ids; the same instance (or the fallback) always gives the same ids."""
    body = data.draw(VALID_BODIES[name], "valid body").encode()
    mine = PARSERS[name](200, dict(GOOGLE), body)
    assert [n.id for n in PARSERS[name](200, dict(GOOGLE), body)] == [n.id for n in mine]
    for instance in {other, FALLBACK} - {INSTANCE}:
        theirs = PARSERS[name](200, dict(GOOGLE), body, instance=instance)
        assert [n.detail for n in theirs] == [n.detail for n in mine]
        assert not {n.id for n in theirs} & {n.id for n in mine}


INSTANCE_IDS = {  # cloud -> (parse, valid ids, answers that are no id)
    "gcp": (gcp.parse_instance_id_answer, st.integers(0, 2**64 - 1).map(str), [b"", b"-1", b"12 34", b"0x1f"]),
    "aws": (lambda status, headers, body: parse_instance_id(status, headers, body, path="/id",
                                                            pattern=aws.ImdsClient.instance_id_pattern),
            st.sampled_from(["i-0123456789abcdef0", "i-1234abcd"]), [b"", b"i-", b"i-XYZ12345", b"<html>404</html>"]),
    "azure": (azure.parse_vm_id, st.uuids().map(str), [b"", b"vmss_vm_1", b'{"vmId": "x"}', b"not-a-uuid-at-all"]),
    "alibaba": (lambda status, headers, body: parse_instance_id(status, headers, body, path="/id",
                                                                pattern=alibaba.EcsMetadataClient.instance_id_pattern),
                st.sampled_from(["i-bp67acfmxazb4ph3pqx0", "i-2zeabcdef0123"]), [b"", b"i-", b"2015-01-05T18:0"]),
}


@pytest.mark.parametrize("cloud", sorted(INSTANCE_IDS))
@fuzz
@given(data=st.data())
def test_instance_ids_are_read_or_refused(cloud, data):
    """Whatever comes in, an instance id parser returns a stripped, printable id or raises
    SourceError; a non-200 answer and an answer that is no id never pass; valid ids do."""
    parse, valid, garbage = INSTANCE_IDS[cloud]
    status = data.draw(statuses, "status")
    body = data.draw(st.one_of(st.binary(max_size=80), valid.map(str.encode), st.sampled_from(garbage)), "body")
    try:
        value = parse(status, dict(GOOGLE), body)
    except SourceError as exc:
        assert exc.reason
    else:
        assert status == 200 and value and value == value.strip() and value.isprintable()
    good = data.draw(valid, "valid id")
    assert parse(200, dict(GOOGLE), f" {good}\n".encode()) == good.lower()
    for bad in garbage:
        with pytest.raises(SourceError):
            parse(200, dict(GOOGLE), bad)
    with pytest.raises(SourceError):
        parse(data.draw(st.integers(100, 599).filter(lambda s: s != 200)), dict(GOOGLE), good.encode())


def test_gcp_instance_id_needs_the_flavor():
    with pytest.raises(SourceError) as err:
        gcp.parse_instance_id_answer(200, {"ETag": "x"}, b"4520031799277581759")
    assert err.value.reason == "flavor"
