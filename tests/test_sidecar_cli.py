"""`spotguard sidecar` as a real process: flags, environment defaults, serving, clean exit."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys

import aiohttp
import pytest

from spotguard.config import ConfigError
from tests.sidecar_helpers import Publisher, StreamReader, make_notice


async def read_listening_url(proc: asyncio.subprocess.Process, timeout: float = 30.0) -> str:
    async def scan() -> str:
        while True:
            line = await proc.stderr.readline()
            if not line:
                raise AssertionError("sidecar exited before listening")
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == "sidecar listening":
                return entry["url"]

    return await asyncio.wait_for(scan(), timeout)


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    return proc.returncode


async def test_the_sidecar_process_serves_relays_and_stops_on_sigterm(tmp_path):
    token_file = tmp_path / "shared" / "token"
    async with Publisher() as pub:
        notice = make_notice()
        pub.add_silently(notice)
        env = {**os.environ, "SPOTGUARD_TOKEN_FILE": str(token_file),
               "SPOTGUARD_LOCAL_WORLD_SIZE": "1", "SPOTGUARD_PODINFO_DIR": str(tmp_path / "podinfo")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "spotguard", "sidecar", "--listen", "127.0.0.1:0", "--agent-url", pub.url,
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            url = await read_listening_url(proc)
            assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
            async with StreamReader(url) as guard:
                _event, data = await guard.next(10)
                if not data["notices"]:  # connected before the relay's first snapshot
                    _event, data = await guard.next(10)
                    data = {"notices": [data]}
                assert [n["id"] for n in data["notices"]] == [notice.id]
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/healthz") as resp:
                    assert (await resp.json())["agent_connected"] is True
            assert await stop(proc) == 0
        finally:
            await stop(proc)


@pytest.mark.parametrize("flags, env, field", [
    ([], {}, "--agent-url"),
    (["--agent-url", "ftp://x"], {}, "--agent-url"),
    (["--agent-url", "http://127.0.0.1:9"], {}, "--token-file"),
    (["--agent-url", "http://127.0.0.1:9", "--local-world-size", "0"], {"SPOTGUARD_TOKEN_FILE": "/tmp/x"},
     "--local-world-size"),
    (["--agent-url", "http://127.0.0.1:9"], {"SPOTGUARD_TOKEN_FILE": "/tmp/x", "SPOTGUARD_LOCAL_WORLD_SIZE": "two"},
     "--local-world-size"),
    (["--agent-url", "http://127.0.0.1:9", "--listen", "9741"], {"SPOTGUARD_TOKEN_FILE": "/tmp/x"}, "--listen"),
    (["--agent-url", "http://127.0.0.1:9", "--deepspeed-config", "/nonexistent/ds.json"],
     {"SPOTGUARD_TOKEN_FILE": "/tmp/x"}, "--deepspeed-config"),
])
async def test_bad_configuration_exits_2_naming_the_field(flags, env, field, tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    if "SPOTGUARD_TOKEN_FILE" in env:
        env = {**env, "SPOTGUARD_TOKEN_FILE": str(tmp_path / "token")}
    if "--listen" not in flags:
        flags = [*flags, "--listen", "127.0.0.1:0"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotguard", "sidecar", *flags,
        env={**clean, **env}, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    assert proc.returncode == 2, err
    assert f"error: {field}" in err.decode()


def test_defaults_come_from_the_pod_environment(monkeypatch, tmp_path):
    from spotguard.cli import build_parser
    from spotguard.hooks.sidecar.cli import build_config

    for name, value in {"NODE_IP": "10.1.2.3", "TOKEN_FILE": str(tmp_path / "t"), "AGENT_TOKEN_FILE": "/var/sa/token",
                        "PODINFO_DIR": "/etc/pi", "LOCAL_WORLD_SIZE": "4", "POD_NAME": "job-w-1",
                        "POD_NAMESPACE": "team"}.items():
        monkeypatch.setenv(f"SPOTGUARD_{name}", value)
    config = build_config(build_parser().parse_args(["sidecar"]))
    assert (config.agent_url, config.listen_host, config.listen_port) == ("http://10.1.2.3:9740", "127.0.0.1", 9741)
    assert (config.agent_token_file, config.podinfo_dir, config.local_world_size) == ("/var/sa/token", "/etc/pi", 4)
    assert (config.pod, config.namespace, config.token_file) == ("job-w-1", "team", str(tmp_path / "t"))
    assert config.horizon_seconds == 120.0  # the Guard's default
    monkeypatch.setenv("SPOTGUARD_HORIZON_SECONDS", "30")  # the Guard's variable, copied in by the injector
    assert build_config(build_parser().parse_args(["sidecar"])).horizon_seconds == 30.0
    monkeypatch.setenv("SPOTGUARD_HORIZON_SECONDS", "soon")
    with pytest.raises(ConfigError) as info:
        build_config(build_parser().parse_args(["sidecar"]))
    assert info.value.field == "--horizon-seconds (from SPOTGUARD_HORIZON_SECONDS)"


async def test_prestop_command_reports_an_unreachable_sidecar(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotguard", "sidecar", "prestop", "--url", "http://127.0.0.1:9", "--timeout", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    assert proc.returncode == 3 and json.loads(out)["outcome"] == "unreachable"
