"""Membership from the pod's downward-API annotations file (Go-quoted), and what a change does."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, strategies as st

from spotguard.hooks.hostfile import Host, read_hostfile
from spotguard.hooks.sidecar.membership import (AnnotationFormatError, parse_downward_annotations, read_membership,
                                                unquote_go)
from spotguard.wire.membership import Membership, MembershipFormatError
from tests.sidecar_helpers import (Publisher, StreamReader, eventually, go_quote, make_notice, running_sidecar,
                                   write_annotations)


@pytest.mark.parametrize("literal, text", [
    (r'""', ""),
    (r'"plain"', "plain"),
    (r'"a\"b\\c"', 'a"b\\c'),
    (r'"\a\b\f\n\r\t\v"', "\a\b\f\n\r\t\v"),
    (r'"\x41\101\u00e9\U0001F600"', "AA\u00e9\U0001F600"),
    (r'"\xc3\xa9"', "\u00e9"),  # bytes that form UTF-8
    ('"caf\u00e9 \u65e5\u672c"', "caf\u00e9 \u65e5\u672c"),  # printable non-ASCII stays literal in Go's %q
])
def test_unquote_go_undoes_strconv_quote(literal, text):
    assert unquote_go(literal) == text


@pytest.mark.parametrize("literal", [
    r'"unterminated', r'noquotes', r'"a"b"', r'"\q"', r'"\x4"', r'"\u12"', r'"\uD800"', r'"\U00110000"',
    r'"\400"', r'"\18"', r'"trailing\"', r'"\xff"', r"'single'", r'"\'"',
])
def test_unquote_go_rejects_what_go_would_not_write(literal):
    with pytest.raises(ValueError):
        unquote_go(literal)


@given(st.text(max_size=200))
def test_quote_unquote_round_trip(text):
    assert unquote_go(go_quote(text)) == text


def test_parse_a_kubelet_annotations_file():
    membership = {"v": 1, "generation": 7, "hosts": ["trainer-0", "trainer-1"], "world_size": 8}
    text = ("kubectl.kubernetes.io/last-applied-configuration=" + go_quote('{"kind":"Pod",\n"x":"\\t"}') + "\n"
            "spotguard.io/membership=" + go_quote(json.dumps(membership)) + "\n"
            'spotguard.io/policy="elastic"\n')
    parsed = parse_downward_annotations(text)
    assert parsed["spotguard.io/policy"] == "elastic"
    assert parsed["kubectl.kubernetes.io/last-applied-configuration"] == '{"kind":"Pod",\n"x":"\\t"}'
    assert Membership.from_json(parsed["spotguard.io/membership"]) == Membership(7, ("trainer-0", "trainer-1"), 8)


@pytest.mark.parametrize("text, where", [
    ('a="1"\nb=2\n', "line 2 (b)"),
    ('a="1"\nno-equals\n', "line 2"),
    ('a="1"\n c="x"\n', "line 2"),
    ('a="\\z"\n', "line 1 (a): unknown escape"),
])
def test_malformed_annotation_files_name_the_line(text, where):
    with pytest.raises(AnnotationFormatError) as info:
        parse_downward_annotations(text)
    assert str(info.value).startswith(where)


@pytest.mark.parametrize("value, field", [
    ("not json", "membership: not JSON"),
    ('{"v": 2, "generation": 1, "hosts": [], "world_size": 0}', "v:"),
    ('{"v": 1, "generation": -1, "hosts": [], "world_size": 0}', "generation"),
    ('{"v": 1, "generation": 1, "hosts": ["a", "a"], "world_size": 2}', "hosts"),
    ('{"v": 1, "generation": 1, "hosts": [""], "world_size": 2}', "hosts"),
    ('{"v": 1, "generation": 1, "hosts": ["a"], "world_size": true}', "world_size"),
])
def test_bad_membership_values_name_the_field(value, field):
    with pytest.raises(MembershipFormatError) as info:
        Membership.from_json(value)
    assert str(info.value).startswith(field)


def membership_line(generation: int, hosts: list[str], world_size: int, drain: str = "") -> str:
    value = {"v": 1, "generation": generation, "hosts": hosts, "world_size": world_size}
    if drain:
        value["drain"] = drain
    return "spotguard.io/membership=" + go_quote(json.dumps(value))


def test_read_membership_from_the_file(tmp_path):
    assert read_membership(str(tmp_path / "annotations")) is None  # no volume yet: no membership
    write_annotations(tmp_path, ['other="x"'])
    assert read_membership(str(tmp_path / "annotations")) is None
    write_annotations(tmp_path, ['other="x"', membership_line(3, ["a"], 2)])
    assert read_membership(str(tmp_path / "annotations")) == Membership(3, ("a",), 2)


async def test_a_membership_change_rewrites_the_hostfile_and_emits_an_event(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=2\nw1 slots=2\nw2 slots=2\n")
    podinfo = tmp_path / "podinfo"
    write_annotations(podinfo, ['app="trainer"'])
    async with Publisher(node="w2") as pub, \
            running_sidecar(tmp_path, pub.url, hostfile=str(hostfile), podinfo_dir=str(podinfo)) as sc, \
            StreamReader(sc.url) as guard:
        assert (await guard.next())[0] == "snapshot"
        assert (await guard.next())[1]["hostfile"] == ["w0", "w1", "w2"]

        write_annotations(podinfo, ['app="trainer"', membership_line(5, ["w1", "w0"], 4)])
        assert await guard.next() == ("membership", {"v": 1, "generation": 5, "revision": 1, "hosts": ["w1", "w0"],
                                                     "world_size": 4, "departing": [], "hostfile": ["w1", "w0"]})
        assert read_hostfile(str(hostfile)) == [Host("w1", 2), Host("w0", 2)]

        # A malformed file is ignored: no event, the hostfile stays, the watcher keeps going.
        write_annotations(podinfo, ['app="trainer"', 'spotguard.io/membership="{\\"v\\": 1, broken"'])
        await guard.quiet(0.4)
        write_annotations(podinfo, ['app=trainer'])
        await guard.quiet(0.3)
        assert read_hostfile(str(hostfile)) == [Host("w1", 2), Host("w0", 2)]

        # Growth: a host the hostfile never listed gets the slots all the others share.
        write_annotations(podinfo, [membership_line(6, ["w0", "w1", "w2", "w3"], 8)])
        event, data = await guard.next()
        assert event == "membership" and data["hostfile"] == ["w0", "w1", "w2", "w3"] and data["generation"] == 6
        assert read_hostfile(str(hostfile))[-1] == Host("w3", 2)

        # A notice for this node (a host of the job) removes it from the hostfile on top of the
        # membership. The event's membership stays the supervisor's (hosts and generation): the
        # other pods of the job, which had no notice, see the same, and the in-place Guard takes
        # the generation as the re-formation's identity.
        await eventually(lambda: pub.connections == 1)
        pub.add(make_notice(node="w2"))
        assert (await guard.next())[0] == "notice"
        assert await guard.next() == ("membership", {"v": 1, "generation": 6, "revision": 3,
                                                     "hosts": ["w0", "w1", "w2", "w3"], "world_size": 8,
                                                     "departing": ["w2"], "hostfile": ["w0", "w1", "w3"]})
        assert [h.name for h in read_hostfile(str(hostfile))] == ["w0", "w1", "w3"]
        # The membership reaches late subscribers too.
        async with StreamReader(sc.url) as late:
            await late.next()
            assert (await late.next())[1]["revision"] == 3


async def test_without_a_hostfile_the_membership_is_relayed(tmp_path):
    podinfo = tmp_path / "podinfo"
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, podinfo_dir=str(podinfo)) as sc, \
            StreamReader(sc.url) as guard:
        assert (await guard.next())[0] == "snapshot"
        await guard.quiet(0.2)  # no annotations file: nothing to say
        write_annotations(podinfo, [membership_line(2, ["a", "b"], 16)])
        assert await guard.next() == ("membership", {"v": 1, "generation": 2, "revision": 0, "hosts": ["a", "b"],
                                                     "world_size": 16, "departing": []})
        assert sc.topology.rewrites == 0

        # This pod's node gets a notice (the in-place case: its rank may be held for a standby).
        # The event lists the departing host under the supervisor's generation, so this pod and
        # the others agree on which membership a push is when the next one comes.
        await eventually(lambda: pub.connections == 1)
        pub.add(make_notice(node="a"))
        assert (await guard.next())[0] == "notice"
        assert await guard.next() == ("membership", {"v": 1, "generation": 2, "revision": 1, "hosts": ["a", "b"],
                                                     "world_size": 16, "departing": ["a"]})
        # The supervisor takes a out: its notice no longer names a host of the job.
        write_annotations(podinfo, [membership_line(3, ["b", "c"], 16)])
        assert await guard.next() == ("membership", {"v": 1, "generation": 3, "revision": 2, "hosts": ["b", "c"],
                                                     "world_size": 16, "departing": []})


async def _events_until_quiet(reader: StreamReader, quiet: float = 0.5) -> list[tuple[str, dict]]:
    events = []
    while True:
        try:
            event, data, *_ = await asyncio.wait_for(reader.events.get(), quiet)
        except TimeoutError:
            return events
        events.append((event, data))


async def test_the_supervisors_drain_request_becomes_a_drain_notice_that_snapshots_keep(tmp_path):
    """A `drain` in the membership (the supervisor returning a job to spot) is a `drain` notice
    for the pod's ranks; the agent's complete snapshots, which never list it, do not withdraw
    it; the membership without it does."""
    podinfo = tmp_path / "podinfo"
    async with Publisher(node="w0") as pub, running_sidecar(tmp_path, pub.url, podinfo_dir=str(podinfo)) as sc, \
            StreamReader(sc.url) as guard:
        assert (await guard.next())[0] == "snapshot"
        write_annotations(podinfo, [membership_line(3, ["w0"], 1, drain="return-7")])
        notices = [d for e, d in await _events_until_quiet(guard) if e == "notice"]
        assert len(notices) == 1
        notice = notices[0]
        assert notice["kind"] == "drain" and notice["source"] == "supervisor.drain"
        assert notice["detail"] == {"request": "return-7"} and notice["deadline"] is None

        before = sc.relay.snapshots
        pub.resync()  # a complete agent snapshot without it: the drain stays
        await eventually(lambda: sc.relay.snapshots > before, what="the agent's snapshot applied")
        assert "withdrawn" not in [e for e, _ in await _events_until_quiet(guard)]
        assert [n.id for n in sc.live.notices()] == [notice["id"]]
        write_annotations(podinfo, [membership_line(3, ["w0"], 1, drain="return-7"), 'other="x"'])
        assert await _events_until_quiet(guard) == []  # the same request read again: nothing new

        write_annotations(podinfo, [membership_line(5, ["w0"], 1)])
        events = await _events_until_quiet(guard)
        assert ("withdrawn", notice["id"]) in [(e, d.get("withdrawn")) for e, d in events]
        assert len(sc.live) == 0


@pytest.mark.parametrize("drain", [5, " x", "y" * 300])
def test_a_bad_drain_request_names_the_field(drain):
    value = {"v": 1, "generation": 1, "hosts": [], "world_size": 0, "drain": drain}
    with pytest.raises(MembershipFormatError) as info:
        Membership.from_wire(value)
    assert str(info.value).startswith("drain")
