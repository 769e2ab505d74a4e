"""DeepSpeed hostfile: strict parsing, atomic rewrite, elasticity trimming; the sidecar keeping it in step."""
from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.hostfile import (ElasticityError, ElasticRule, Host, HostfileError, elastic_rule_from_config,
                                      parse_hostfile, read_hostfile, select_hosts, write_hostfile)
from spotguard.hooks.sidecar.service import Sidecar
from spotguard.hooks.sidecar.topology import Topology
from spotguard.wire.notice import Kind
from tests.sidecar_helpers import Publisher, StreamReader, eventually, make_notice, sidecar_config


def test_parse_keeps_order_and_slots_and_skips_comments():
    text = "# workers\n\nworker-0 slots=4\n  worker-1   slots = 2  # spare\n10.0.0.7 slots=8\n"
    assert parse_hostfile(text) == [Host("worker-0", 4), Host("worker-1", 2), Host("10.0.0.7", 8)]


@pytest.mark.parametrize("text, line, words", [
    ("a slots=1\nb slots=two\n", 2, "expected 'hostname slots=N'"),
    ("a slots=1\n\n# c\nb\n", 4, "expected 'hostname slots=N'"),
    ("a slots=1 extra\n", 1, "expected 'hostname slots=N'"),
    ("a slots=0\n", 1, "slots must be >= 1"),
    ("a slots=1\nb slots=1\na slots=2\n", 3, "already listed on line 1"),
    ("# nothing\n\n", None, "no hosts listed"),
])
def test_malformed_hostfiles_name_the_line(text, line, words):
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "/etc/ds/hostfile")
    assert info.value.line == line and words in str(info.value)
    assert str(info.value).startswith("/etc/ds/hostfile" + (f":{line}" if line else ""))


def test_write_is_atomic_keeps_permissions_and_round_trips(tmp_path):
    path = str(tmp_path / "hostfile")
    write_hostfile(path, [Host("a", 2), Host("b", 4)], header="gen 1")
    os.chmod(path, 0o640)
    write_hostfile(path, [Host("b", 4)])
    assert read_hostfile(path) == [Host("b", 4)]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert os.listdir(tmp_path) == ["hostfile"]  # no temp file left behind
    with pytest.raises(ValueError):
        write_hostfile(path, [])


def test_a_reader_never_sees_a_partial_hostfile(tmp_path):
    path = str(tmp_path / "hostfile")
    versions = [[Host(f"host-{v}-{i}-" + "x" * 40, 8) for i in range(200)] for v in range(2)]
    expected = {tuple(v) for v in versions}
    write_hostfile(path, versions[0])
    stop = threading.Event()
    seen: list[tuple] = []
    problems: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                with open(path) as f:
                    hosts = tuple(parse_hostfile(f.read()))
            except Exception as exc:  # any failure is what we look for
                problems.append(repr(exc))
                continue
            if hosts not in expected:
                problems.append(f"partial content: {len(hosts)} hosts")
            seen.append(hosts)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(150):
            write_hostfile(path, versions[n % 2])
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert problems == [] and len(seen) > 10


def test_elastic_rule_matches_deepspeeds_published_figures():
    # DeepSpeed's own elasticity test: this block gives batch 9792 and 23 valid GPU counts.
    rule = ElasticRule.from_block({"enabled": True, "max_train_batch_size": 10000,
                                   "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32, "max_gpus": 1500,
                                   "min_time": 20, "version": 0.1})
    assert rule.batch_size == 9792 and len(rule.world_sizes) == 23
    for world in rule.world_sizes:
        per_rank = rule.batch_size // world
        assert rule.batch_size % world == 0 and any(per_rank % m == 0 for m in (8, 12, 16, 17))


def test_elastic_rule_prefers_the_batch_size_with_most_world_sizes():
    small = ElasticRule.from_block({"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2],
                                    "max_gpus": 8})
    assert small.batch_size == 12 and small.world_sizes == (1, 2, 3, 6)
    assert small.largest_allowed(5) == 3 and small.largest_allowed(0) is None
    # Two candidates tie on the count of world sizes: prefer_larger_batch picks between them.
    block = {"enabled": True, "max_train_batch_size": 10, "micro_batch_sizes": [3, 5], "max_gpus": 1}
    assert ElasticRule.from_block(block).batch_size == 10  # candidates 6 (3*2) and 10 (5*2)
    assert ElasticRule.from_block({**block, "prefer_larger_batch": False}).batch_size == 6
    assert ElasticRule.from_block({"enabled": False, "max_train_batch_size": "x"}) is None
    assert ElasticRule.from_block(None) is None


@pytest.mark.parametrize("block, key", [
    ({"micro_batch_sizes": []}, "elasticity.micro_batch_sizes"),
    ({"micro_batch_sizes": [2, "4"]}, "elasticity.micro_batch_sizes"),
    ({"micro_batch_sizes": [4000]}, "elasticity.micro_batch_sizes"),
    ({"max_train_batch_size": 0}, "elasticity.max_train_batch_size"),
    ({"max_train_batch_size": None}, "elasticity.max_train_batch_size"),
    ({"max_gpus": None}, "elasticity.max_gpus"),
    ({"min_gpus": 4, "max_gpus": 2}, "elasticity.max_gpus"),
    ({"prefer_larger_batch": "yes"}, "elasticity.prefer_larger_batch"),
    ({"version": 0.2}, "elasticity.version"),
    ({"enabled": "true"}, "elasticity.enabled"),
    ({"min_gpus": 7, "max_gpus": 7, "micro_batch_sizes": [2], "max_train_batch_size": 12}, "elasticity: no world size"),
])
def test_bad_elasticity_blocks_name_the_key(block, key):
    with pytest.raises(ElasticityError) as info:
        ElasticRule.from_block({"enabled": True, **block})
    assert str(info.value).startswith(key)


def test_select_hosts_keeps_slots_and_trims_to_the_largest_allowed_world_size():
    rule = ElasticRule.compute([2], 12, 1, 8)  # allows 1, 2, 3, 6
    hosts = [Host("a", 2), Host("b", 2), Host("c", 1), Host("d", 1)]
    assert select_hosts(hosts, rule=rule) == hosts  # 6 is allowed
    assert select_hosts(hosts[1:], rule=rule) == [Host("b", 2), Host("c", 1)]  # 4 is not: 3
    assert select_hosts(hosts, cap=5, rule=rule) == [Host("a", 2), Host("c", 1)]
    assert select_hosts(hosts, cap=4) == [Host("a", 2), Host("b", 2)]
    assert select_hosts([Host("a", 4), Host("b", 4)], rule=rule) == []  # 4 and 8 are both disallowed


def test_elastic_rule_from_a_deepspeed_config_file(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "elasticity": {"enabled": True, "max_train_batch_size": 12,
                                                 "micro_batch_sizes": [2], "max_gpus": 8}}))
    assert elastic_rule_from_config(str(config)).world_sizes == (1, 2, 3, 6)
    config.write_text(json.dumps({"train_batch_size": 8}))
    assert elastic_rule_from_config(str(config)) is None
    config.write_text("{oops")
    with pytest.raises(ElasticityError, match="is not JSON"):
        elastic_rule_from_config(str(config))


async def test_the_sidecar_drops_a_noticed_host_and_trims_to_the_elastic_world_size(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=2\nh2 slots=2\nh3 slots=1\nh4 slots=1\n")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 12,
                                                    "micro_batch_sizes": [2], "max_gpus": 8}}))
    async with Publisher(node="h1") as pub:
        config = sidecar_config(tmp_path, pub.url, hostfile=str(hostfile), deepspeed_config=str(ds_config))
        async with Sidecar(config) as sc:
            await eventually(lambda: sc.live.complete, what="the agent's complete snapshot")  # no resync later
            async with StreamReader(sc.url) as guard:
                assert (await guard.next())[0] == "snapshot"
                assert await guard.next() == ("membership", {"v": 1, "generation": 0, "revision": 0,
                                                             "hosts": ["h1", "h2", "h3", "h4"],
                                                             "world_size": 6, "departing": [],
                                                             "hostfile": ["h1", "h2", "h3", "h4"]})
                assert sc.topology.rewrites == 0  # 6 was allowed: the file was left alone
                await eventually(lambda: pub.connections == 1)
                notice = make_notice(node="h1")
                pub.add(notice)
                assert (await guard.next())[0] == "notice"
                assert await guard.next() == ("membership", {"v": 1, "generation": 0, "revision": 1,
                                                             "hosts": ["h1", "h2", "h3", "h4"], "world_size": 6,
                                                             "departing": ["h1"], "hostfile": ["h2", "h3"]})
                assert read_hostfile(str(hostfile)) == [Host("h2", 2), Host("h3", 1)]
                pub.add(make_notice(node="h1", kind=Kind.REBALANCE, tag="r"))  # a risk only: nobody departs
                assert (await guard.next())[0] == "notice"
                pub.withdraw(notice)
                assert (await guard.next())[0] == "withdrawn"
                event, data = await guard.next()
                assert event == "membership" and data["hostfile"] == ["h1", "h2", "h3", "h4"] and data["revision"] == 2
                assert read_hostfile(str(hostfile))[0] == Host("h1", 2)


async def test_the_sidecar_keeps_a_held_notices_host_until_its_release(tmp_path):
    """A maintenance announced an hour ahead reads as held (the Guard's rule, with its horizon):
    its host stays in the hostfile and in the membership the ranks see until the notice comes
    within the horizon; then the release timer trims it, with nothing else happening. The
    sidecar's clock is fixed just before the release until the test moves it past."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    async with Publisher(node="h1") as pub:
        config = sidecar_config(tmp_path, pub.url, hostfile=str(hostfile), horizon_seconds=60.0)
        async with Sidecar(config) as sc:
            await eventually(lambda: sc.live.complete, what="the agent's complete snapshot")
            notice = make_notice(node="h1", kind=Kind.MAINTENANCE, deadline_in=3600.0)
            release = notice.deadline - timedelta(seconds=60)
            now = [release - timedelta(seconds=0.3)]
            sc.topology.clock = lambda: now[0]
            async with StreamReader(sc.url) as guard:
                assert (await guard.next())[0] == "snapshot"
                assert (await guard.next())[1]["hostfile"] == ["h1", "h2"]
                await eventually(lambda: pub.connections == 1)
                pub.add(notice)
                assert (await guard.next())[0] == "notice"
                await eventually(lambda: sc.topology.release_at == release, what="the release timer set")
                assert sc.topology.departing == () and read_hostfile(str(hostfile)) == [Host("h1", 1), Host("h2", 1)]
                now[0] = release + timedelta(seconds=0.1)
                assert await guard.next() == ("membership", {"v": 1, "generation": 0, "revision": 1,
                                                             "hosts": ["h1", "h2"], "world_size": 2,
                                                             "departing": ["h1"], "hostfile": ["h2"]})
                assert read_hostfile(str(hostfile)) == [Host("h2", 1)]
                assert sc.topology.release_at is None


async def test_a_held_notice_withdrawn_before_its_release_never_trims_its_host(tmp_path):
    """Withdrawn while held (a maintenance the cloud cancels): the timer stops, and a later look
    past the old release changes nothing; a held notice of a host outside the job is ignored."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    events = []

    async def on_membership(data):
        events.append(data)

    now = [make_notice().detected_at]
    topology = Topology(on_membership, str(hostfile), [Host("h1", 1), Host("h2", 1)], clock=lambda: now[0])
    try:
        await topology.update()
        held = make_notice(node="h1", kind=Kind.MAINTENANCE, deadline_in=3600.0)
        elsewhere = make_notice(node="x9", kind=Kind.MAINTENANCE, deadline_in=1800.0, tag="x")
        await topology.set_notices([held, elsewhere])
        assert topology.release_at == held.deadline - timedelta(seconds=120) and topology.departing == ()
        await topology.set_notices([elsewhere])
        assert topology.release_at is None
        now[0] = held.deadline
        await topology.recheck()
        assert [e["hostfile"] for e in events] == [["h1", "h2"]] and topology.rewrites == 0
        await topology.set_notices([held])  # past its release: a departure at once
        assert events[-1]["hostfile"] == ["h2"] and topology.departing == ("h1",)
    finally:
        topology.close()
    assert read_hostfile(str(hostfile)) == [Host("h2", 1)]
    # closed (the sidecar stopping): a held notice sets no timer, nothing is written or said
    now[0] = held.detected_at
    await topology.set_notices([make_notice(node="h2", kind=Kind.MAINTENANCE, deadline_in=3600.0, tag="late")])
    await topology.set_notices([])
    assert topology._release_timer is None and len(events) == 2
    assert read_hostfile(str(hostfile)) == [Host("h2", 1)]


async def test_a_malformed_hostfile_stops_the_sidecar_at_start_naming_the_line(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=2\nh2 slots=lots\n")
    with pytest.raises(ConfigError) as info:
        async with Sidecar(sidecar_config(tmp_path, "http://127.0.0.1:9", hostfile=str(hostfile))):
            pass
    assert info.value.field == "--hostfile" and f"{hostfile}:2" in str(info.value)
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "spotguard", "sidecar", "--agent-url", "http://127.0.0.1:9",
                           "--token-file", str(tmp_path / "t"), "--hostfile", str(hostfile), "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--hostfile" in proc.stderr and f"{hostfile}:2" in proc.stderr and "slots=lots" in proc.stderr
