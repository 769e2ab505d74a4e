"""The node agent end to end: real emulators, `spotguard agent` subprocesses, real HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess

import aiohttp
import pytest

from spotguard.agent.app import Agent
from spotguard.agent.auth import SharedSecretAuth
from spotguard.agent.config import AgentConfig
from spotguard.agent.sources.aws import aws_sources
from spotguard.agent.sources.azure import azure_sources

from tests.agent_helpers import AgentProcess, SSEReader, agent_command, wait_for

SECRET = "e2e-secret-e2e-secret"


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(trust_env=False) as session:
        yield session


@contextlib.asynccontextmanager
async def agent_process(*args: str, env: dict | None = None):
    proc = AgentProcess("--no-kubernetes", "--listen", "127.0.0.1:0", "--gpu", "off", *args, env=env)
    try:
        await proc.started()
        yield proc
    finally:
        proc.kill()


async def collect_ids(reader: SSEReader, ids: set, deliveries: list, want: str, timeout: float = 10.0) -> None:
    """Reads until `want` was delivered (in a snapshot or as a notice event), deduping by id."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while want not in ids:
        event = await reader.next(max(0.01, end - loop.time()))
        assert event is not None, "stream ended"
        notices = event.json()["notices"] if event.event == "snapshot" else \
            [event.json()] if event.event == "notice" else []
        for wire in notices:
            deliveries.append(wire["id"])
            ids.add(wire["id"])


async def test_restart_while_live_brings_the_same_id_back_and_sigterm_closes_streams(make_emulator, http):
    emu, control = await make_emulator("aws")
    await control.schedule("reclaim", lead=120)
    ids: set[str] = set()
    deliveries: list[str] = []
    async with agent_process("--cloud", "aws", "--metadata-url", emu.url, "--node", "n1") as first:
        async with http.get(first.url + "/v1/stream") as resp:
            reader = SSEReader(resp)
            await wait_for(lambda: _live(http, first.url), timeout=10)
            await collect_ids(reader, ids, deliveries, want=next(iter(await _live(http, first.url))))
            code = await asyncio.to_thread(first.terminate, 10)
            assert code == 0
            tail = await reader.next(timeout=5)  # the stream ends cleanly: EOF, not a hang
            assert tail is None
    [notice_id] = ids
    async with agent_process("--cloud", "aws", "--metadata-url", emu.url, "--node", "n1") as second:
        async with http.get(second.url + "/v1/stream") as resp:
            again: set[str] = set()
            await collect_ids(SSEReader(resp), again, deliveries, want=notice_id)
    ids |= again
    assert ids == {notice_id}  # consumers see it once after dedupe
    assert len(deliveries) == 2  # though each agent delivered it


async def _live(http, url) -> set[str]:
    async with http.get(url + "/v1/notices") as resp:
        return {n["id"] for n in (await resp.json())["notices"]}


async def test_withdrawn_maintenance_leaves_table_and_stream(make_emulator, http):
    emu, control = await make_emulator("aws")
    sources = aws_sources("n1", base_url=emu.url, interval=0.2, maintenance_interval=0.2)
    agent = Agent(AgentConfig(node="n1", host="127.0.0.1", port=0, kubernetes=False, gpu="off"), sources,
                  authenticator=SharedSecretAuth(SECRET))
    await agent.start()
    try:
        url = f"http://{agent.address}"
        async with http.get(url + "/v1/stream") as resp:
            reader = SSEReader(resp)
            assert (await reader.next()).event == "snapshot"
            scheduled = await control.schedule("maintenance", lead=3600, code="system-reboot")
            event = await reader.until(lambda e: e.event == "notice")
            assert event.json()["kind"] == "maintenance" and event.json()["source"] == "aws.maintenance"
            await control.cancel(scheduled["id"])
            gone = await reader.until(lambda e: e.event == "withdrawn")
            assert gone.json()["withdrawn"] == event.json()["id"]
            assert int(gone.id) > int(event.id)
        assert await _live(http, url) == set()
    finally:
        await agent.stop()


async def test_azure_event_approved_only_after_an_authenticated_checkpointed_report(make_emulator, http):
    emu, control = await make_emulator("azure")
    agent = Agent(AgentConfig(node="n1", host="127.0.0.1", port=0, kubernetes=False, gpu="off"),
                  azure_sources("n1", base_url=emu.url, interval=0.2), authenticator=SharedSecretAuth(SECRET))
    await agent.start()
    try:
        url = f"http://{agent.address}"
        await control.schedule("reclaim", lead=60)
        [notice_id] = await wait_for(lambda: _live(http, url), timeout=10)
        body = {"v": 1, "notice_id": notice_id, "pod": "p1", "namespace": "ns1", "status": "checkpointed",
                "step": 7, "hook_seconds": {"checkpoint": 0.5}, "steps_lost": 0}
        async with http.post(url + "/v1/reports", json=body) as resp:
            assert resp.status == 401
        async with http.post(
            url + "/v1/reports", json=body, headers={"Authorization": "Bearer not-the-secret"}) as resp:
            assert resp.status == 401
        await asyncio.sleep(0.3)
        assert (await control.notices())[0]["params"]["approved_at"] is None  # nothing approved early
        async with http.post(url + "/v1/reports", json=body, headers={"Authorization": f"Bearer {SECRET}"}) as resp:
            assert resp.status == 202 and (await resp.json())["approved"] is True
        assert (await control.notices())[0]["params"]["approved_at"] is not None
        assert emu.handler.approvals == [(await control.notices())[0]["params"]["event_id"]]
    finally:
        await agent.stop()


async def test_api_server_unreachable_publishing_goes_on(make_emulator, http):
    emu, control = await make_emulator("aws")
    with socket.socket() as s:  # a port with nothing listening: the "API server" is down
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = AgentProcess("--cloud", "aws", "--metadata-url", emu.url, "--node", "n1", "--listen", "127.0.0.1:0",
                        "--gpu", "off", "--kube-host", dead, "--ready-grace", "1")
    try:
        await proc.started()
        async with http.get(proc.url + "/v1/stream") as resp:
            reader = SSEReader(resp)
            await control.schedule("reclaim", lead=120)
            event = await reader.until(lambda e: e.event == "notice", timeout=10)
            assert event.json()["kind"] == "reclaim"
        await wait_for(lambda: _ready(http, proc.url), timeout=10)
        assert await asyncio.to_thread(proc.terminate, 10) == 0
    finally:
        proc.kill()


async def _ready(http, url) -> bool:
    async with http.get(url + "/readyz") as resp:
        return resp.status == 200


async def test_config_file_and_environment_fill_in_for_flags(make_emulator, http, tmp_path):
    emu, _control = await make_emulator("aws")
    config = tmp_path / "agent.yaml"
    config.write_text(f"cloud: aws\nmetadata_url: {emu.url}\nnode: from-file\nlisten: 127.0.0.1:0\n"
                      "kubernetes: false\ngpu: 'off'\n")
    proc = AgentProcess("--config", str(config), "--node", "from-flag",
                        env={"SPOTGUARD_KEEPALIVE": "0.2", "SPOTGUARD_NODE": "from-env"})
    try:
        await proc.started()
        async with http.get(proc.url + "/v1/notices") as resp:
            assert (await resp.json())["node"] == "from-flag"  # the flag beats env and file

        async def complete() -> bool:
            async with http.get(proc.url + "/v1/notices") as resp:
                return (await resp.json())["complete"]
        await wait_for(complete, timeout=10)  # so the stream starts with a complete snapshot, no resync
        async with http.get(proc.url + "/v1/stream") as resp:
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5) == b": keepalive\n\n"  # env value
        assert await asyncio.to_thread(proc.terminate, 10) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("args, env, field", [
    (["--listen", "nonsense"], {}, "--listen"),
    (["--listen", "127.0.0.1:99999"], {}, "--listen"),
    (["--interval", "-1"], {}, "--interval"),
    (["--gpu", "maybe"], {}, "--gpu"),
    ([], {"SPOTGUARD_TIMEOUT": "soon"}, "SPOTGUARD_TIMEOUT"),
    (["--config", "{config}"], {}, "bogus_key"),
    (["--report-token-file", "/nonexistent/token"], {}, "--report-token-file"),
    (["--max-streams", "8", "--max-streams-per-client", "9"], {}, "--max-streams-per-client"),
    ([], {"SPOTGUARD_HEADER_TIMEOUT": "0"}, "SPOTGUARD_HEADER_TIMEOUT"),
])
def test_bad_config_exits_2_naming_the_field(args, env, field, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("cloud: aws\nbogus_key: 1\n")
    args = [a.replace("{config}", str(config)) for a in args]
    proc = subprocess.Popen(agent_command("--cloud", "aws", "--metadata-url", "http://127.0.0.1:9", "--no-kubernetes",
                                          "--listen", "127.0.0.1:0", "--gpu", "off", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2, err.decode()[-2000:]
    assert field in err.decode()
    assert b"listening" not in out


async def test_gpu_policy_end_to_end_with_the_fake_backend(http, tmp_path):
    scenario = tmp_path / "gpus.yaml"
    scenario.write_text(
        "gpus: 2\nsteps:\n  - {at: 0.3, xid: {gpu: 1, xid: 92}}\n  - {at: 0.6, xid: {gpu: 0, xid: 79}}\n")
    proc = AgentProcess("--cloud", "aws", "--metadata-url", "http://127.0.0.1:9", "--no-kubernetes", "--listen",
                        "127.0.0.1:0", "--gpu", f"fake:{scenario}", "--ready-grace", "0.5")
    try:
        await proc.started()
        async with http.get(proc.url + "/v1/stream") as resp:
            reader = SSEReader(resp)
            first = await reader.until(lambda e: e.event == "notice" and e.json().get("severity"), timeout=10)
            advisory = first.json()
            event = await reader.until(lambda e: e.event == "notice" and not e.json().get("severity"), timeout=10)
        notice = event.json()
        assert (advisory["severity"], advisory["detail"]["xid"], advisory["deadline"]) == ("advisory", 92, None)
        assert (notice["kind"], notice["source"], notice["detail"]["xid"]) == ("gpu-fault", "gpu", 79)
        assert notice["deadline"] == notice["detected_at"]  # fatal: deadline now
        async with http.get(proc.url + "/metrics") as resp:
            text = await resp.text()
        assert 'spotguard_gpu_warnings_total{reason="xid_92"} 1' in text  # Xid 92 warns, is no notice
        assert await asyncio.to_thread(proc.terminate, 10) == 0
    finally:
        proc.kill()


async def test_cluster_mode_marks_the_node_and_keeps_marks_over_sigterm(make_emulator, http):
    import kmock
    import kubernetes

    emu, control = await make_emulator("aws")
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        cfg = kubernetes.client.Configuration()
        cfg.host = str(srv.url).rstrip("/")
        api = kubernetes.client.ApiClient(cfg)
        core = kubernetes.client.CoreV1Api(api)
        await asyncio.to_thread(core.create_node, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})

        async def annotation() -> str | None:
            raw = await asyncio.to_thread(core.read_node, "n1", _preload_content=False)
            return (json.loads(raw.data)["metadata"].get("annotations") or {}).get("spotguard.io/notice")

        proc = AgentProcess("--cloud", "aws", "--metadata-url", emu.url, "--node", "n1", "--listen", "127.0.0.1:0",
                            "--gpu", "off", "--kube-host", cfg.host, "--ready-grace", "2")
        try:
            await proc.started()
            scheduled = await control.schedule("reclaim", lead=120)
            marked = await wait_for(annotation, timeout=15, pause=0.1)
            assert json.loads(marked)["kind"] == "reclaim"
            assert await asyncio.to_thread(proc.terminate, 10) == 0
            assert await annotation() == marked  # SIGTERM keeps the marks
        finally:
            proc.kill()
        del scheduled
        await asyncio.to_thread(api.close)
