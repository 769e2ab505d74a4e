"""Hostile clients against both servers (the node agent and the sidecar) over real sockets.

Every request here is one an attacker (or a broken client) can send: deep or broken JSON,
bytes that are not UTF-8 where text is expected, oversized lines, headers and bodies, requests
that never finish, and a client grabbing every stream slot. Neither server may answer 500,
log an error or a traceback, or keep a half-open connection past its header timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest

from spotguard.agent.app import Agent
from spotguard.agent.auth import SharedSecretAuth
from spotguard.agent.config import AgentConfig
from tests.agent_helpers import FedSource, make_notice, wait_for
from tests.sidecar_helpers import hook, read_token, running_sidecar

SECRET = "hostile-secret-0123456789"
HEADER_TIMEOUT = 1.0
CLOSED_WITHIN = 10.0  # a loaded 2-core machine; the timeout is 1 s, without one it is an hour


@pytest.fixture
async def servers(tmp_path):
    """{"agent": (host, port, token, post path), "sidecar": (...)} with 1 s header timeouts."""
    source = FedSource("test.a")
    config = AgentConfig(node="n1", host="127.0.0.1", port=0, kubernetes=False, gpu="off", keepalive=0.5,
                         header_timeout=HEADER_TIMEOUT, max_streams=6, max_streams_per_client=3)
    agent = Agent(config, [source], authenticator=SharedSecretAuth(SECRET))
    await agent.start()
    source.show(make_notice("test.a:1"))
    try:
        async with running_sidecar(tmp_path, f"http://{agent.address}", header_timeout=HEADER_TIMEOUT,
                                   max_streams=2, keepalive=0.5) as sc:
            host, port = agent.address.rsplit(":", 1)
            sidecar_port = int(sc.url.rsplit(":", 1)[1])
            yield {"agent": (host, int(port), SECRET, "/v1/reports", agent),
                   "sidecar": ("127.0.0.1", sidecar_port, read_token(sc), "/v1/hooks", sc)}
    finally:
        await agent.stop()


@pytest.fixture
def no_errors_logged(caplog):
    """Fails the test if anything logged at ERROR or with a traceback."""
    caplog.set_level(logging.INFO)
    yield caplog
    records = caplog.get_records("setup") + caplog.get_records("call")  # caplog.records: teardown's only
    bad = [f"{r.name}: {r.levelname}: {r.getMessage()}" for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], bad


async def exchange(host: str, port: int, data: bytes, *, local_host: str | None = None,
                   wait: float = CLOSED_WITHIN) -> tuple[int | None, bytes, float]:
    """Sends raw bytes, reads until the server closes; (status or None, response, seconds)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port, local_addr=(local_host, 0) if local_host else None)
    try:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            pass  # the server answered and closed before we finished writing
        try:
            response = await asyncio.wait_for(reader.read(), wait)
        except ConnectionError:
            response = b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.") else None
    return status, response, time.monotonic() - started


def post(path: str, body: bytes, token: bytes | str, *extra: bytes) -> bytes:
    token = token.encode() if isinstance(token, str) else token
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: test", b"Authorization: Bearer " + token,
            b"Content-Type: application/json", b"Content-Length: %d" % len(body), b"Connection: close", *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def valid_body(server: str) -> dict:
    if server == "agent":
        return {"v": 1, "notice_id": "test.a:1", "pod": "p", "namespace": "ns", "status": "checkpointed",
                "step": 1, "steps_lost": 0}
    return hook("test.a:1", 0)


DEPTH = 32 * 1024
BODIES = {
    "nested 32k deep (arrays)": b"[" * DEPTH + b"]" * DEPTH,
    "nested deep (objects)": b'{"a":' * 10000 + b"1" + b"}" * 10000,
    "deep inside a string is fine but still not a report": b'"' + b"[" * 60000 + b'"',
    "not UTF-8": b'{"v": 1, "notice_id": "\xff\xfe"}',
    "UTF-16": '{"v": 1}'.encode("utf-16"),
    "not JSON": b"{not json",
    "a 5000-digit number": b'{"v": ' + b"9" * 5000 + b"}",
    "NaN and 1e400": b'{"v": 1, "step": NaN, "seconds": 1e400, "hook_seconds": {"x": Infinity}}',
    "a bare list": b"[1, 2, 3]",
    "empty": b"",
}


@pytest.mark.parametrize("server", ["agent", "sidecar"])
@pytest.mark.parametrize("name", list(BODIES))
async def test_hostile_bodies_get_400_never_500(servers, no_errors_logged, server, name):
    host, port, token, path, _ = servers[server]
    status, response, _ = await exchange(host, port, post(path, BODIES[name], token))
    assert status == 400, response[:300]
    assert b"error" in response


@pytest.mark.parametrize("server", ["agent", "sidecar"])
async def test_hostile_framing_sizes_and_timeouts_of_bodies(servers, no_errors_logged, server):
    host, port, token, path, _ = servers[server]
    big = json.dumps({**valid_body(server), "pad": "x" * 70000}).encode()
    assert (await exchange(host, port, post(path, big, token)))[0] == 413
    chunks = b"".join(b"%x\r\n%s\r\n" % (4096, b"x" * 4096) for _ in range(20)) + b"0\r\n\r\n"
    chunked = post(path, b"", token).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked") + chunks
    assert (await exchange(host, port, chunked))[0] == 413
    broken = post(path, b"", token).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked") + b"zz\r\n{}\r\n"
    status, response, _ = await exchange(host, port, broken)
    assert status == 400, response[:300]
    # A body announced and never sent: 408 once the timeout passes, not a connection held forever.
    status, response, seconds = await exchange(host, port, post(path, b"", token).replace(
        b"Content-Length: 0", b"Content-Length: 100") + b'{"v": 1')
    assert status == 408 and seconds < CLOSED_WITHIN, (status, response[:300])
    # And a good one still works (the agent has no checkpoint report to approve: 202 recorded).
    status, response, _ = await exchange(host, port, post(path, json.dumps(valid_body(server)).encode(), token))
    assert status in (200, 202), response[:300]


@pytest.mark.parametrize("server", ["agent", "sidecar"])
async def test_tokens_that_are_not_utf8_or_absurd_are_refused_with_401(servers, no_errors_logged, server):
    host, port, token, path, _ = servers[server]
    body = json.dumps(valid_body(server)).encode()
    for bad in (b"\xff\xfe\xfd", b"\xc3\x28" + token.encode(), token.encode() + b"\x80", b"\xe2\x82",
                "тóкен".encode(), b"x" * 8000, b""):
        status, response, _ = await exchange(host, port, post(path, body, bad))
        assert status == 401, (bad[:20], response[:300])


@pytest.mark.parametrize("server", ["agent", "sidecar"])
async def test_oversized_and_broken_requests_get_4xx_and_no_traceback(servers, no_errors_logged, server):
    host, port, token, path, _ = servers[server]
    requests = {
        "a 100 KiB header": b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        "a 100 KiB request line": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        "500 headers": b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(500))
                       + b"\r\n",
        "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 200 + b"\r\n\r\n",
        "a bad method": b"G(T / HTTP/1.1\r\nHost: t\r\n\r\n",
        "a path that is not UTF-8": b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        "a header that is not UTF-8": b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-A: \xff\xfe\r\nConnection: close\r\n\r\n",
        "a query that is not UTF-8": b"GET /v1/notices?x=%ff%fe HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        "two content lengths": post(path, b"{}", token, b"Content-Length: 5"),
        "a bad HTTP version": b"GET /healthz HTTP/9.9\r\nHost: t\r\n\r\n",
    }
    for name, data in requests.items():
        status, response, _ = await exchange(host, port, data)
        assert status is None or 200 <= status < 500, (name, response[:300])
        assert status != 200 or name in ("a header that is not UTF-8", "a query that is not UTF-8"), name


async def test_prestop_timeouts_that_are_not_numbers_get_400(servers, no_errors_logged):
    host, port, _, _, _ = servers["sidecar"]
    for value in (b"nan", b"inf", b"-1", b"0", b"1e309", b"%ff", b"9" * 5000, b"1" * 100_000):
        status, response, _ = await exchange(host, port, b"GET /v1/prestop?timeout=" + value
                                             + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert status is not None and 400 <= status < 500, (value[:20], response[:300])


@pytest.mark.parametrize("server", ["agent", "sidecar"])
@pytest.mark.parametrize("opening", [b"", b"GET /v1/notices HTTP/1.1\r\nHost: t\r\n", b"GET /v1/not"])
async def test_half_open_and_idle_connections_are_dropped(servers, no_errors_logged, server, opening):
    host, port, _, _, _ = servers[server]
    _status, response, seconds = await exchange(host, port, opening)
    assert response == b"" and seconds < CLOSED_WITHIN, (response[:200], seconds)


@pytest.mark.parametrize("server", ["agent", "sidecar"])
async def test_an_idle_keepalive_connection_is_closed_but_a_quiet_stream_is_kept(servers, no_errors_logged, server):
    host, port, _, _, _ = servers[server]
    reader, writer = await asyncio.open_connection(host, port)
    stream_reader, stream_writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # keep-alive: no Connection: close
        stream_writer.write(b"GET /v1/stream HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), CLOSED_WITHIN)  # body, then the server closes
        assert b"ok" in rest and time.monotonic() - started < CLOSED_WITHIN
        await asyncio.sleep(3 * HEADER_TIMEOUT)  # the stream reader reads nothing meanwhile
        got = await asyncio.wait_for(stream_reader.read(65536), 5)
        while b"keepalive" not in got:
            more = await asyncio.wait_for(stream_reader.read(65536), 5)
            assert more, "the quiet stream was closed"
            got += more
        assert got.startswith(b"HTTP/1.1 200") and b"event: snapshot" in got
    finally:
        for w in (writer, stream_writer):
            w.close()


async def open_stream(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    return await http.get(url + "/v1/stream", timeout=aiohttp.ClientTimeout(total=None, sock_read=30))


async def test_one_client_cannot_take_every_agent_stream_slot(servers, no_errors_logged):
    host, port, _, _, agent = servers["agent"]
    url = f"http://{host}:{port}"
    # the sidecar already holds one stream from 127.0.0.1: the cap is 3 per client, 6 in all
    async with (
        aiohttp.ClientSession(trust_env=False) as one,
        aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as two,
        aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))) as three,
    ):
        held = [await open_stream(one, url) for _ in range(2)]
        assert [r.status for r in held] == [200, 200]
        refused = await open_stream(one, url)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        refused.release()
        # another client is not locked out
        others = [await open_stream(two, url) for _ in range(3)]
        assert [r.status for r in others] == [200, 200, 200]
        # the total is still bounded: 3 + 3 held, so a third client waits too
        full = await open_stream(three, url)
        assert full.status == 503
        full.release()
        # a slot given back can be taken again
        held.pop().close()
        await wait_for(lambda: agent.server.slots.held_by("127.0.0.1") == 2)
        again = await open_stream(one, url)
        assert again.status == 200
        for resp in [*held, *others, again]:
            resp.close()
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    assert 'spotguard_streams_refused_total{status="429"} 1' in text
    assert 'spotguard_streams_refused_total{status="503"} 1' in text


async def test_the_sidecar_bounds_its_streams(servers, no_errors_logged):
    _, port, _, _, _ = servers["sidecar"]
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(trust_env=False) as http:
        held = [await open_stream(http, url) for _ in range(2)]
        assert [r.status for r in held] == [200, 200]
        refused = await open_stream(http, url)
        assert refused.status == 503
        refused.release()
        for resp in held:
            resp.close()
