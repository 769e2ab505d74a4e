"""A restarted agent never releases a pod early: snapshots say whether they are authoritative.

The whole path over real sockets: emulated AWS metadata -> agent -> sidecar -> the Guard's
listener (a real `NoticeListener` thread) and a pod stream reader, with a `prestop` pending.
The agent restarts while every metadata read fails; its first snapshots are incomplete and
must not withdraw anything anywhere. Once its sources read again, what is really gone is
withdrawn, and what is live never was.
"""
from __future__ import annotations

import asyncio
import threading

import aiohttp

from spotguard.agent.app import Agent
from spotguard.agent.auth import RefuseAll
from spotguard.agent.config import AgentConfig
from spotguard.agent.sources.aws import aws_sources
from spotguard.hooks.notice_listener import NoticeListener
from tests.agent_helpers import make_notice
from tests.sidecar_helpers import StreamReader, eventually, prestop, running_sidecar

FAILING_SECONDS = 10.0  # the goal: metadata failing this long after a restart releases nothing


async def start_agent(metadata_url: str, port: int = 0) -> Agent:
    config = AgentConfig(node="n1", host="127.0.0.1", port=port, kubernetes=False, gpu="off", keepalive=1.0)
    agent = Agent(config, aws_sources("n1", base_url=metadata_url, interval=0.2, maintenance_interval=0.2),
                  authenticator=RefuseAll())
    await agent.start()
    return agent


class ListenerLog:
    """What a Guard's listener was told, collected from its thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.notices: list[str] = []
        self.withdrawn: list[str] = []

    def on_notice(self, notice) -> None:
        with self.lock:
            self.notices.append(notice.id)

    def on_withdrawn(self, notice_id: str) -> None:
        with self.lock:
            self.withdrawn.append(notice_id)


def test_the_shared_snapshot_rule_withdraws_only_on_a_complete_snapshot():
    from spotguard.wire.snapshot import Snapshot, reconcile

    held = {n.id: n for n in (make_notice("a:1"), make_notice("a:2"))}
    kept, new = held["a:1"], make_notice("a:3")
    partial = reconcile(held, Snapshot("n1", [kept, new], complete=False))
    assert [n.id for n in partial.upserts] == ["a:3"] and partial.withdrawn == []
    full = reconcile(held, Snapshot("n1", [kept, new], complete=True))
    assert [n.id for n in full.upserts] == ["a:3"] and full.withdrawn == ["a:2"]


async def test_a_restarted_agent_with_failing_metadata_never_releases_a_pending_prestop(make_emulator, tmp_path):
    emu, control = await make_emulator("aws")
    reclaim = await control.schedule("reclaim", lead=120)
    rebalance = await control.schedule("rebalance")
    agent = await start_agent(emu.url)
    port = int(agent.address.rsplit(":", 1)[1])
    heard = ListenerLog()
    listener: NoticeListener | None = None
    waiting: asyncio.Task | None = None
    try:
        async with running_sidecar(tmp_path, f"http://{agent.address}", local_world_size=1) as sc, \
                StreamReader(sc.url) as pod, aiohttp.ClientSession(trust_env=False) as http:
            await eventually(lambda: len(sc.live) == 2, timeout=10, what="both notices at the sidecar")
            by_kind = {n.kind.value: n.id for n in sc.live.notices()}
            reclaim_id, rebalance_id = by_kind["reclaim"], by_kind["rebalance"]
            at_pod: set[str] = set()
            while at_pod != {reclaim_id, rebalance_id}:  # the pod's stream reader has both too
                event, data = await pod.next(timeout=10)
                at_pod |= {n["id"] for n in data["notices"]} if event == "snapshot" else {data["id"]}
            listener = NoticeListener(sc.url, heard.on_notice, heard.on_withdrawn)
            listener.start()
            await eventually(lambda: set(heard.notices) == {reclaim_id, rebalance_id}, timeout=10,
                             what="both notices at the Guard's listener")
            waiting = asyncio.create_task(prestop(http, sc, 120))

            await control.fault("status", status=503, count=0)  # every metadata read fails from now on
            await control.cancel(rebalance["id"])  # really withdrawn while the agent is down
            await agent.stop()
            agent = await start_agent(emu.url, port)
            await eventually(lambda: sc.relay.connections >= 2, timeout=10, what="the sidecar reconnected")
            async with http.get(f"http://{agent.address}/v1/notices") as resp:
                assert (await resp.json())["complete"] is False  # it says it has not read yet

            loop = asyncio.get_running_loop()
            end = loop.time() + FAILING_SECONDS
            while loop.time() < end:
                assert not waiting.done(), f"prestop released: {waiting.result()}"
                assert {n.id for n in sc.live.notices()} == {reclaim_id, rebalance_id}
                await asyncio.sleep(0.1)
            assert heard.withdrawn == []
            assert sc.relay.snapshots >= 2  # the incomplete snapshot did arrive, and changed nothing

            await control.clear_faults()
            await eventually(lambda: heard.withdrawn == [rebalance_id], timeout=10,
                             what="the notice withdrawn during the restart withdrawn at the listener")
            assert [n.id for n in sc.live.notices()] == [reclaim_id]
            assert not waiting.done()
            # the pod's stream is a connection of its own: the withdrawal may reach it after the listener
            await eventually(lambda: not pod.events.empty(), timeout=10, what="the withdrawal at the pod")
            events = []
            while not pod.events.empty():
                events.append(pod.events.get_nowait())
            # downstream of the sidecar: one withdrawal (the real one), and no notice sent twice
            assert [(e, d.get("withdrawn")) for e, d, _ in events] == [("withdrawn", rebalance_id)]

            await control.cancel(reclaim["id"])  # the reclaim ends for real
            assert (await asyncio.wait_for(waiting, 10))["outcome"] == "withdrawn"
            await eventually(lambda: heard.withdrawn == [rebalance_id, reclaim_id], timeout=10)
    finally:
        if waiting is not None:
            waiting.cancel()
        if listener is not None:
            await asyncio.to_thread(listener.stop, 5.0)
        await agent.stop()


async def test_a_restarted_sidecar_holds_prestop_until_it_has_heard_its_agent(make_emulator, tmp_path):
    """A sidecar that starts (or restarts) while its agent cannot read metadata has no complete
    view: a prestop then waits instead of answering `no-notice`, and keeps waiting for the ranks
    once the agent reads the live reclaim."""
    emu, control = await make_emulator("aws")
    await control.schedule("reclaim", lead=120)
    await control.fault("status", status=503, count=0)
    agent = await start_agent(emu.url)
    waiting: asyncio.Task | None = None
    try:
        async with running_sidecar(tmp_path, f"http://{agent.address}", local_world_size=1, settle=False) as sc, \
                aiohttp.ClientSession(trust_env=False) as http:
            await eventually(lambda: sc.relay.snapshots >= 1, timeout=10, what="the agent's first snapshot")
            assert not sc.live.complete and len(sc.live) == 0
            waiting = asyncio.create_task(prestop(http, sc, 120))
            await asyncio.sleep(3.0)
            assert not waiting.done(), f"prestop released before the sidecar heard its agent: {waiting.result()}"
            await control.clear_faults()
            await eventually(lambda: sc.live.complete and len(sc.live) == 1, timeout=10,
                             what="the reclaim at the sidecar")
            await asyncio.sleep(0.5)
            assert not waiting.done(), f"prestop released with a live notice and no rank done: {waiting.result()}"
    finally:
        if waiting is not None:
            waiting.cancel()
        await agent.stop()
