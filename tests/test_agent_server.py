"""The agent's HTTP API over real sockets: notices, the SSE stream, metrics, readiness, reports.

Sources here are `FedSource`s (real Sources fed from a queue) so each test controls exactly
what every source reads; the emulator-backed paths are in test_agent_e2e.py.
"""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import kmock
import kubernetes
import pytest

from spotguard.agent.app import Agent
from spotguard.agent.auth import RefuseAll, SharedSecretAuth, TokenReviewAuth
from spotguard.agent.config import AgentConfig
from spotguard.wire.notice import Notice

from tests.agent_helpers import ApprovingSource, FedSource, SSEReader, make_notice, parse_exposition, wait_for

SECRET = "s3cret-s3cret-s3cret"


@pytest.fixture
async def start_agent():
    """`agent, url = await start_agent(sources, authenticator=..., **config)`; stopped after."""
    agents: list[Agent] = []

    async def start(sources, authenticator=None, **overrides):
        settings = dict(node="n1", host="127.0.0.1", port=0, kubernetes=False, gpu="off", ready_grace=30.0,
                        keepalive=10.0)
        settings.update(overrides)
        agent = Agent(AgentConfig(**settings), sources, authenticator=authenticator or SharedSecretAuth(SECRET),
                      api_client=overrides.get("api_client_obj"))
        agents.append(agent)
        await agent.start()
        return agent, f"http://{agent.address}"

    yield start
    for agent in agents:
        await agent.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(trust_env=False) as session:
        yield session


@contextlib.asynccontextmanager
async def stream(http: aiohttp.ClientSession, url: str):
    async with http.get(url + "/v1/stream") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        yield SSEReader(resp)


async def test_stream_snapshot_then_changes_with_increasing_ids(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a])
    a.show()
    await wait_for(lambda: agent.table.complete)  # the one source has read: the table is authoritative
    async with stream(http, url) as s:
        snap = await s.next()
        assert snap.event == "snapshot" and snap.json() == {"v": 1, "node": "n1", "notices": [], "complete": True}
        x = make_notice("test.a:x", deadline_in=120)
        a.show(x)
        new = await s.next()
        assert new.event == "notice" and new.json()["id"] == "test.a:x"
        a.show(x.with_deadline(x.deadline.replace(year=x.deadline.year + 1)))  # moved deadline
        moved = await s.next()
        assert moved.event == "notice" and Notice.from_wire(moved.json()).deadline.year == x.deadline.year + 1
        a.show()
        gone = await s.next()
        assert gone.event == "withdrawn" and gone.json()["withdrawn"] == "test.a:x"
        ids = [int(e.id) for e in (snap, new, moved, gone)]
        assert ids == sorted(ids) and len(set(ids)) == 4
    async with http.get(url + "/v1/notices") as resp:
        assert (await resp.json())["notices"] == []


async def test_snapshots_say_whether_every_source_has_read_and_the_stream_resyncs_when_it_has(start_agent, http):
    a, b = FedSource("test.a"), FedSource("test.b")
    _agent, url = await start_agent([a, b], ready_grace=0.0)  # readiness by grace never makes it complete
    async with stream(http, url) as s:
        first = await s.next()
        assert first.event == "snapshot" and first.json()["complete"] is False
        x = make_notice("test.a:x")
        a.show(x)
        assert (await s.next()).json()["id"] == x.id
        async with http.get(url + "/v1/notices") as resp:
            assert (await resp.json())["complete"] is False
        b.show()
        resync = await s.next()
        assert resync.event == "snapshot" and resync.json()["complete"] is True
        assert [n["id"] for n in resync.json()["notices"]] == [x.id] and int(resync.id) > int(first.id)
        a.show()
        assert (await s.next()).event == "withdrawn"
    async with http.get(url + "/v1/notices") as resp:
        assert (await resp.json())["complete"] is True


async def test_same_id_from_two_sources_is_published_once_earliest_deadline(start_agent, http):
    a, b = FedSource("test.a"), FedSource("test.b")
    agent, url = await start_agent([a, b])
    late, early = make_notice("shared:1", deadline_in=300), make_notice("shared:1", deadline_in=60)
    a.show()
    b.show()
    await wait_for(lambda: agent.table.complete)
    async with stream(http, url) as s:
        await s.next()  # snapshot
        a.show(late)
        first = await s.next()
        assert Notice.from_wire(first.json()).deadline == late.deadline
        b.show(early)
        second = await s.next()
        assert Notice.from_wire(second.json()).deadline == early.deadline
        b.show()  # b withdraws: a's later deadline comes back, the notice stays live
        third = await s.next()
        assert third.event == "notice" and Notice.from_wire(third.json()).deadline == late.deadline
        a.show()
        assert (await s.next()).event == "withdrawn"
    async with http.get(url + "/v1/notices") as resp:
        assert (await resp.json())["notices"] == []


async def test_reconnect_mid_notice_gets_the_snapshot_again(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a])
    x = make_notice("test.a:x", deadline_in=120)
    a.show(x)
    seen: dict[str, dict] = {}  # a consumer that dedupes by id
    deliveries = 0
    async with stream(http, url) as s:
        snap = await s.until(lambda e: e.event == "notice" or (e.event == "snapshot" and e.json()["notices"]))
        for wire in (snap.json()["notices"] if snap.event == "snapshot" else [snap.json()]):
            seen[wire["id"]] = wire
            deliveries += 1
    await wait_for(lambda: agent.table.subscriber_count == 0)  # the server noticed the disconnect
    moved = x.with_deadline(x.deadline.replace(year=x.deadline.year + 1))
    a.show(moved)  # changes while disconnected
    await wait_for(lambda: agent.table.get(x.id).deadline == moved.deadline)
    async with stream(http, url) as s:
        again = await s.next()
        assert again.event == "snapshot"
        notices = again.json()["notices"]
        assert [n["id"] for n in notices] == [x.id]  # same id
        assert Notice.from_wire(notices[0]).deadline == moved.deadline  # nothing lost
        for wire in notices:
            deliveries += 1
            seen[wire["id"]] = wire
    assert deliveries == 2 and list(seen) == [x.id]  # delivered twice, seen once after dedupe


async def test_keepalive_and_clean_end_of_stream_on_stop(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a], keepalive=0.1)
    async with http.get(url + "/v1/stream") as resp:
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert b"event: snapshot" in first
        keepalive = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert keepalive == b": keepalive\n\n"
        await agent.stop()
        rest = await asyncio.wait_for(resp.content.read(), 5)  # EOF, not a hang or reset
        assert b"event:" not in rest


async def test_slow_subscriber_is_cut_and_recovers_by_reconnecting(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a])
    agent.table.max_backlog = 2
    sub = agent.table.subscribe()  # a subscriber that never reads
    for i in range(4):
        agent.table.apply("manual", make_notice(f"m:{i}"))
    assert sub.overflowed
    async with stream(http, url) as s:
        assert len((await s.next()).json()["notices"]) == 4


async def test_subscriber_with_too_much_unsent_is_cut_off_over_http(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a])
    async with http.get(url + "/v1/stream") as resp:
        reader = SSEReader(resp)
        assert (await reader.next()).event == "snapshot"
        agent.server.max_buffered = -1  # every byte counts as too much: this subscriber is "slow"
        agent.table.apply("manual", make_notice("m:1"))
        with pytest.raises((aiohttp.ClientError, ConnectionError)):
            assert await reader.next() is None
            raise ConnectionError("ended")
    agent.server.max_buffered = 1 << 20
    assert agent.metrics.dropped.value() == 1
    async with stream(http, url) as s:  # reconnecting gets everything back
        assert [n["id"] for n in (await s.next()).json()["notices"]] == ["m:1"]


async def test_metrics_parse_and_count(start_agent, http):
    a, b = FedSource("test.a"), FedSource("test.b")
    agent, url = await start_agent([a, b])
    a.show(make_notice("test.a:x", deadline_in=90))
    b.fail("http_5xx")
    b.show()
    await wait_for(lambda: agent.table.get("test.a:x") is not None and b.stats.successes == 1)
    async with stream(http, url) as s:
        await s.next()
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = parse_exposition(await resp.text())
    assert samples['spotguard_notices{kind="reclaim",source="test.a"}'] == 1
    assert samples['spotguard_notice_changes_total{event="new",kind="reclaim",source="test.a"}'] == 1
    assert samples['spotguard_source_errors_total{source="test.b",reason="http_5xx"}'] == 1
    assert samples['spotguard_subscribers'] == 1
    assert samples['spotguard_detection_latency_seconds_count{source="test.a"}'] == 1
    assert samples['spotguard_notice_lead_seconds_bucket{kind="reclaim",le="60"}'] == 0
    assert samples['spotguard_notice_lead_seconds_bucket{kind="reclaim",le="120"}'] == 1
    assert samples["spotguard_ready"] == 1
    assert samples['spotguard_source_polls_total{source="test.b"}'] >= 2


async def test_readyz_waits_for_every_source_or_the_grace(start_agent, http):
    a, b = FedSource("test.a"), FedSource("test.b")
    _agent, url = await start_agent([a, b])
    a.show()
    await wait_for(lambda: a.stats.successes == 1)
    async with http.get(url + "/readyz") as resp:
        assert resp.status == 503 and (await resp.json())["pending_sources"] == ["1:test.b"]
    b.show()
    await wait_for(lambda: b.stats.successes == 1)
    async with http.get(url + "/readyz") as resp:
        assert resp.status == 200
    c = FedSource("test.c")  # never answers, but the grace is short
    _, url2 = await start_agent([c], ready_grace=0.2)
    async with http.get(url2 + "/healthz") as resp:
        assert resp.status == 200
    await asyncio.sleep(0.3)
    async with http.get(url2 + "/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["pending_sources"] == ["0:test.c"]


def report(notice_id: str, status: str = "checkpointed", pod: str = "p1", namespace: str = "ns1") -> dict:
    return {"v": 1, "notice_id": notice_id, "pod": pod, "namespace": namespace, "status": status, "step": 120,
            "hook_seconds": {"checkpoint": 1.2, "drain": 0.1}, "steps_lost": 0}


async def post(http, url, body, token: str | None = SECRET) -> tuple[int, dict]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with http.post(url + "/v1/reports", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_reports_need_the_shared_secret(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a])
    a.show(make_notice("test.a:x"))
    await wait_for(lambda: agent.table.get("test.a:x"))
    assert (await post(http, url, report("test.a:x"), token=None))[0] == 401
    assert (await post(http, url, report("test.a:x"), token="wrong-wrong-wrong"))[0] == 401
    async with http.post(url + "/v1/reports", json=report("test.a:x"), headers={"Authorization": "Basic abc"}) as r:
        assert r.status == 401
    assert agent.reports.reports_for("test.a:x") == []
    status, body = await post(http, url, {**report("test.a:x"), "status": "done"})
    assert status == 400 and body["error"].startswith("status:")
    status, body = await post(http, url, {**report("test.a:x"), "step": -1})
    assert status == 400 and body["error"].startswith("step:")
    async with http.post(url + "/v1/reports", data=b"{not json", headers={"Authorization": f"Bearer {SECRET}"}) as r:
        assert r.status == 400
    assert (await post(http, url, report("nope:1")))[0] == 404
    status, body = await post(http, url, report("test.a:x"))
    assert status == 202 and body == {"recorded": True, "approved": False}
    [recorded] = agent.reports.reports_for("test.a:x")
    assert (recorded.pod, recorded.step, recorded.caller) == ("p1", 120, "local")
    async with http.get(url + "/metrics") as resp:
        samples = parse_exposition(await resp.text())
    assert samples['spotguard_reports_total{result="accepted"}'] == 1
    assert samples['spotguard_reports_total{result="auth_401"}'] == 3


async def test_reports_refused_without_configured_authentication(start_agent, http):
    a = FedSource("test.a")
    agent, url = await start_agent([a], authenticator=RefuseAll())
    a.show(make_notice("test.a:x"))
    await wait_for(lambda: agent.table.get("test.a:x"))
    assert (await post(http, url, report("test.a:x")))[0] == 403
    assert agent.reports.reports_for("test.a:x") == []


async def test_early_approval_only_after_an_authenticated_checkpointed_report(start_agent, http):
    az = ApprovingSource()
    agent, url = await start_agent([az])
    az.show(make_notice("az:1", source=az.name, detail={"EventId": "E-1"}))
    await wait_for(lambda: agent.table.get("az:1"))
    assert (await post(http, url, report("az:1"), token="wrong-wrong-wrong"))[0] == 401
    status, body = await post(http, url, report("az:1", status="failed"))
    assert status == 202 and body["approved"] is False
    assert az.approved == []
    status, body = await post(http, url, report("az:1"))  # the same pod now checkpointed
    assert status == 202 and body["approved"] is True
    assert az.approved == ["E-1"]
    await post(http, url, report("az:1"))
    assert az.approved == ["E-1"]  # never twice


# -- cluster mode: TokenReview against a Kubernetes API over real HTTP (kmock) ---------------

@contextlib.asynccontextmanager
async def kube_api():
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        reviews: list[dict] = []

        def review(request):
            # TokenReview is a virtual resource on a real API server (nothing is stored); kmock
            # stores every create, so a second nameless review would conflict: forget it.
            for key in list(km.objects):
                if "tokenreviews" in str(key[0]):
                    del km.objects[key]
            spec = request.data["spec"]
            reviews.append(spec)
            token = spec["token"]
            ok = token.startswith("pod:")  # "pod:<ns>:<pod>" tokens are valid in this cluster
            ns, _, pod = token[4:].partition(":")
            status = {"authenticated": ok, "audiences": spec.get("audiences") or []}
            if ok:
                status["user"] = {"username": f"system:serviceaccount:{ns}:trainer",
                                  "extra": {"authentication.kubernetes.io/pod-name": [pod]}}
            return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec, "status": status}

        km["post /apis/authentication.k8s.io/v1/tokenreviews"] << review
        cfg = kubernetes.client.Configuration()
        cfg.host = str(srv.url).rstrip("/")
        api = kubernetes.client.ApiClient(cfg)
        try:
            yield api, reviews
        finally:
            await asyncio.to_thread(api.close)


async def create_pod(api, ns: str, name: str, node: str, inject: bool = True) -> None:
    core = kubernetes.client.CoreV1Api(api)
    labels = {"spotguard.io/inject": "true"} if inject else {}
    await asyncio.to_thread(core.create_namespaced_pod, ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"}})


async def test_token_review_authenticates_pods_and_caches(http):
    async with kube_api() as (api, reviews):
        auth = TokenReviewAuth(api)
        caller = await auth.authenticate("Bearer pod:ns1:p1")
        assert (caller.namespace, caller.pod) == ("ns1", "p1")
        assert caller.may_report_for("ns1", "p1") and not caller.may_report_for("ns1", "p2")
        await auth.authenticate("Bearer pod:ns1:p1")
        assert len(reviews) == 1 and reviews[0]["audiences"] == ["spotguard"]  # cached
        from spotguard.agent.auth import AuthError
        with pytest.raises(AuthError) as err:
            await auth.authenticate("Bearer forged")
        assert err.value.status == 401
    down = TokenReviewAuth(api, request_timeout=1.0)  # the API server is gone now
    with pytest.raises(AuthError) as err:
        await down.authenticate("Bearer pod:ns1:p1")
    assert err.value.status == 503


async def test_cluster_mode_approval_waits_for_every_opted_in_pod(start_agent, http):
    async with kube_api() as (api, _reviews):
        core = kubernetes.client.CoreV1Api(api)
        await asyncio.to_thread(core.create_node, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        await create_pod(api, "ns1", "p1", "n1")
        await create_pod(api, "ns1", "p2", "n1")
        await create_pod(api, "ns1", "other-node", "n2")  # kmock ignores field selectors; we filter too
        await create_pod(api, "ns1", "not-opted-in", "n1", inject=False)
        az = ApprovingSource()
        agent = Agent(AgentConfig(node="n1", host="127.0.0.1", port=0, kubernetes=True, gpu="off"), [az],
                      api_client=api, authenticator=TokenReviewAuth(api))
        await agent.start()
        try:
            url = f"http://{agent.address}"
            az.show(make_notice("az:1", source=az.name, detail={"EventId": "E-1"}))
            await wait_for(lambda: agent.table.get("az:1"))
            status, _ = await post(http, url, report("az:1", pod="p2"), token="pod:ns1:p1")
            assert status == 403  # p1's token cannot speak for p2
            status, body = await post(http, url, report("az:1", pod="p1"), token="pod:ns1:p1")
            assert status == 202 and body["approved"] is False and "1 pod" in body["approval_pending"]
            assert az.approved == []
            status, body = await post(http, url, report("az:1", pod="p2"), token="pod:ns1:p2")
            assert status == 202 and body["approved"] is True
            assert az.approved == ["E-1"]
        finally:
            await agent.stop()
