"""The sidecar's API for the pod: hook reports (auth, validation) and the preStop wait."""
from __future__ import annotations

import asyncio
import json
import os
import stat
import sys

import aiohttp
import pytest

from spotguard.wire.notice import Kind, Severity

from tests.sidecar_helpers import (Publisher, eventually, hook, live_notice, post_hook, prestop, read_token,
                                   running_sidecar)


async def test_token_file_is_private_and_fresh_each_start(tmp_path):
    async with Publisher() as pub:
        async with running_sidecar(tmp_path, pub.url) as sc:
            first = read_token(sc)
            assert stat.S_IMODE(os.stat(sc.config.token_file).st_mode) == 0o600
            assert len(first) >= 32 and first == sc.token
        async with running_sidecar(tmp_path, pub.url) as sc:
            assert read_token(sc) != first


async def test_hooks_need_the_bearer_token(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        body = hook(notice.id, 0)
        for token in (None, "wrong", read_token(sc) + "x", ""):
            status, answer = await post_hook(http, sc, body, token=token)
            assert status == 401 and "token" in answer["error"]
        basic = {"Authorization": "Basic " + read_token(sc)}
        async with http.post(sc.url + "/v1/hooks", json=body, headers=basic) as r:
            assert r.status == 401
        assert sc.book.progress(notice.id).ranks == {}
        status, answer = await post_hook(http, sc, body)
        assert status == 200 and answer["done_ranks"] == [0] and answer["complete"] is False


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not JSON"),
    ([1, 2], "expected a JSON object"),
    ({"v": 2}, "v: unsupported version"),
    ({"notice_id": ...}, "notice_id"),
    ({"notice_id": ""}, "notice_id"),
    ({"rank": True}, "rank"),
    ({"rank": -1}, "rank"),
    ({"rank": 2}, "rank: 2 is not below world_size 2"),
    ({"world_size": 0}, "world_size"),
    ({"step": "7"}, "step"),
    ({"phase": "saved"}, "phase: expected one of checkpoint-durable, drained, failed"),
    ({"seconds": -1}, "seconds"),
    (b'{"v": 1, "notice_id": "n", "rank": 0, "world_size": 1, "step": 1, "phase": "drained", "seconds": NaN}',
     "seconds"),
    ({"steps_lost": -3}, "steps_lost"),
])
async def test_malformed_hook_bodies_get_400_with_a_message_and_change_nothing(tmp_path, body, message):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=1) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        if isinstance(body, dict):  # overrides of a valid report; ... removes the field
            body = {k: v for k, v in {**hook(notice.id, 0), **body}.items() if v is not ...}
        status, answer = await post_hook(http, sc, body)
        assert status == 400
        assert message in answer["error"]
        assert sc.book.progress(notice.id).ranks == {}
        assert (await prestop(http, sc, 0.2))["outcome"] == "timeout"  # still waiting for rank 0


async def test_oversized_hook_body_is_refused(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        async with http.post(sc.url + "/v1/hooks", data=b"x" * 100_000,
                             headers={"Authorization": f"Bearer {read_token(sc)}"}) as resp:
            assert resp.status == 413


async def test_prestop_without_a_live_notice_returns_at_once(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        answer = await prestop(http, sc, 30)
        assert answer["outcome"] == "no-notice" and answer["waited_seconds"] < 5


async def test_prestop_with_only_an_advisory_live_returns_no_notice_at_once(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        advisory = await live_notice(pub, sc, kind=Kind.GPU_FAULT, deadline_in=None, severity=Severity.ADVISORY)
        assert sc.live.get(advisory.id).advisory  # relayed as an advisory
        answer = await prestop(http, sc, 30)
        assert answer["outcome"] == "no-notice" and answer["waited_seconds"] < 5


async def test_prestop_blocks_until_every_rank_reported_and_returns_early_when_they_do(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=2) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        waiting = asyncio.create_task(prestop(http, sc, 60))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert (await post_hook(http, sc, hook(notice.id, 1)))[0] == 200
        await asyncio.sleep(0.3)
        assert not waiting.done()  # one of two ranks is not enough
        assert (await post_hook(http, sc, hook(notice.id, 0, phase="drained")))[0] == 200
        answer = await asyncio.wait_for(waiting, 5)
        assert answer["outcome"] == "done" and answer["notice_id"] == notice.id
        assert answer["done_ranks"] == [0, 1] and answer["expected_ranks"] == 2
        assert answer["waited_seconds"] < 30


async def test_prestop_takes_the_rank_count_from_the_first_report_when_unconfigured(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        for rank in range(3):
            await post_hook(http, sc, hook(notice.id, rank, world_size=4))
        assert (await prestop(http, sc, 0.3))["outcome"] == "timeout"
        await post_hook(http, sc, hook(notice.id, 3, world_size=4))
        answer = await prestop(http, sc, 30)
        assert answer["outcome"] == "done" and answer["expected_ranks"] == 4


async def test_prestop_times_out(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=2) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        await post_hook(http, sc, hook(notice.id, 0))
        answer = await prestop(http, sc, 0.5)
        assert answer["outcome"] == "timeout" and answer["done_ranks"] == [0]
        assert 0.5 <= answer["waited_seconds"] < 10


async def test_prestop_gives_up_at_the_notice_deadline(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=2) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc, deadline_in=1.0)
        answer = await prestop(http, sc, 60)
        assert answer["outcome"] == "deadline" and answer["notice_id"] == notice.id
        assert answer["waited_seconds"] < 30


async def test_prestop_stops_waiting_when_a_rank_failed_or_the_notice_is_withdrawn(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=2) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        await post_hook(http, sc, hook(notice.id, 0, phase="failed"))
        waiting = asyncio.create_task(prestop(http, sc, 60))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # rank 1 may still succeed
        await post_hook(http, sc, hook(notice.id, 1))
        answer = await asyncio.wait_for(waiting, 5)
        assert answer["outcome"] == "failed" and answer["failed_ranks"] == [0]

        other = await live_notice(pub, sc, tag="other", deadline_in=None)
        pub.withdraw(notice)
        await eventually(lambda: sc.live.get(notice.id) is None)
        waiting = asyncio.create_task(prestop(http, sc, 60))
        await asyncio.sleep(0.2)
        pub.withdraw(other)
        answer = await asyncio.wait_for(waiting, 5)
        assert answer["outcome"] == "withdrawn"


@pytest.mark.parametrize("timeout", ["abc", "0", "-1", "1e9", "nan"])
async def test_prestop_rejects_a_bad_timeout(tmp_path, timeout):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, aiohttp.ClientSession() as http:
        async with http.get(sc.url + "/v1/prestop", params={"timeout": timeout}) as resp:
            assert resp.status == 400 and "timeout" in (await resp.json())["error"]


async def test_prestop_command_blocks_then_exits_by_outcome(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url, local_world_size=1) as sc, \
            aiohttp.ClientSession() as http:
        notice = await live_notice(pub, sc)
        cmd = [sys.executable, "-m", "spotguard", "sidecar", "prestop", "--url", sc.url, "--timeout", "30"]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            await asyncio.sleep(1.0)
            assert proc.returncode is None
            await post_hook(http, sc, hook(notice.id, 0, world_size=1))
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
            assert proc.returncode == 0 and json.loads(out)["outcome"] == "done"
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10)
        await live_notice(pub, sc, tag="other")
        proc = await asyncio.create_subprocess_exec(*cmd[:-1], "0.3", stdout=asyncio.subprocess.PIPE)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10)
        # The first notice is done, so preStop does not wait for the second.
        assert proc.returncode == 0 and json.loads(out)["outcome"] == "done"
