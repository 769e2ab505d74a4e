"""The sidecar's relay: agent stream -> live set -> the pod's stream, across reconnects and bad input."""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from spotguard.wire.live import LiveSet
from spotguard.wire.notice import Kind
from spotguard.wire.sse import encode
from spotguard.wire.withdrawal import Withdrawal
from tests.sidecar_helpers import Publisher, StreamReader, eventually, make_notice, running_sidecar


def test_live_set_returns_only_changes():
    live = LiveSet()
    a, b = make_notice(tag="a"), make_notice(tag="b")
    assert [c.notice for c in live.upsert(a)] == [a]
    assert live.upsert(a) == []  # same event again: nothing
    assert live.replace([a, b], "node-a") and [c.notice for c in live.replace([a, b])] == []
    moved = a.with_deadline(None)
    assert [c.notice for c in live.upsert(moved)] == [moved]
    changes = live.replace([b])
    assert [c.withdrawal.notice_id for c in changes] == [a.id]
    assert live.withdraw(Withdrawal("unknown", "s", "n")) == []
    assert [n.id for n in live.notices()] == [b.id] and live.seen(a.id)


async def test_reconnect_mid_notice_keeps_the_notice_without_duplicate_or_withdrawal(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, StreamReader(sc.url) as guard:
        assert await guard.next() == ("snapshot", {"v": 1, "node": "node-a", "notices": [], "complete": True})
        first = make_notice(tag="first")
        await eventually(lambda: pub.connections == 1, what="relay connected")
        pub.add(first)
        assert await guard.next() == ("notice", first.to_wire())

        pub.refuse_next = 2  # the agent drops us and refuses twice before it comes back
        pub.drop_connections()
        await eventually(lambda: pub.connections == 2 and sc.relay.snapshots == 2, timeout=10, what="relay reconnected")
        second = make_notice(tag="second")
        pub.add(second)
        # The very next event is the new notice: the reconnect produced nothing downstream.
        assert await guard.next() == ("notice", second.to_wire())
        async with aiohttp.ClientSession() as http:
            async with http.get(sc.url + "/v1/notices") as resp:
                body = await resp.json()
        assert {n["id"] for n in body["notices"]} == {first.id, second.id}
        assert body["node"] == "node-a"


async def test_changes_missed_while_disconnected_arrive_with_the_next_snapshot(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, StreamReader(sc.url) as guard:
        await guard.next()
        old = make_notice(tag="old")
        await eventually(lambda: pub.connections == 1)
        pub.add(old)
        assert (await guard.next())[0] == "notice"
        pub.refuse_next = 1
        pub.drop_connections()
        await eventually(lambda: not sc.relay.connected, what="relay saw the drop")
        new = make_notice(tag="new", kind=Kind.MAINTENANCE)
        pub.withdraw(old, silently=True)
        pub.add_silently(new)
        got = sorted([await guard.next(), await guard.next()], key=lambda e: e[0])
        assert got == [("notice", new.to_wire()),
                       ("withdrawn", {"v": 1, "withdrawn": old.id, "source": "test.src", "node": "node-a",
                                      "reason": "absent from snapshot"})]
        await guard.quiet(0.3)
        assert [n.id for n in sc.live.notices()] == [new.id]


async def test_an_incomplete_agent_snapshot_withdraws_nothing_and_completion_resyncs_the_pod(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc:
        held, gone = make_notice(tag="held"), make_notice(tag="gone")
        await eventually(lambda: pub.connections == 1)
        pub.add(held)
        pub.add(gone)
        await eventually(lambda: len(sc.live) == 2, what="both relayed")
        # The agent restarts: it has not read its sources yet, so its snapshot is empty and says so.
        pub.live.clear()
        pub.complete = False
        pub.drop_connections()
        await eventually(lambda: sc.relay.snapshots == 2, timeout=10, what="relay reconnected")
        assert {n.id for n in sc.live.notices()} == {held.id, gone.id} and sc.live.complete
        async with StreamReader(sc.url) as pod:
            event, data = await pod.next()
            assert event == "snapshot" and data["complete"] is True and len(data["notices"]) == 2
            # Its sources have read: `held` is live, `gone` really is gone.
            pub.add_silently(held)
            pub.resync()
            assert await pod.next() == ("withdrawn", {"v": 1, "withdrawn": gone.id, "source": "test.src",
                                                      "node": "node-a", "reason": "absent from snapshot"})
            await pod.quiet(0.3)
        assert [n.id for n in sc.live.notices()] == [held.id]


async def test_a_pod_subscribed_before_the_agent_answered_gets_a_complete_snapshot_later(tmp_path):
    async with Publisher() as pub:
        pub.complete = False
        pub.add_silently(make_notice(tag="early"))
        async with running_sidecar(tmp_path, pub.url, settle=False) as sc:
            await eventually(lambda: sc.relay.snapshots == 1, what="relay connected")
            async with StreamReader(sc.url) as pod:
                event, first = await pod.next()
                assert event == "snapshot" and first["complete"] is False and len(first["notices"]) == 1
                pub.resync()
                event, second = await pod.next()
                assert event == "snapshot" and second["complete"] is True and second["notices"] == first["notices"]
                await pod.quiet(0.3)


async def test_withdrawn_propagates(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, StreamReader(sc.url) as guard:
        await guard.next()
        notice = make_notice()
        await eventually(lambda: pub.connections == 1)
        pub.add(notice)
        assert (await guard.next())[0] == "notice"
        pub.withdraw(notice)
        event, data = await guard.next()
        assert event == "withdrawn" and data["withdrawn"] == notice.id and data["v"] == 1
        assert len(sc.live) == 0
        # A late subscriber gets the current state: nothing live.
        async with StreamReader(sc.url) as late:
            assert (await late.next())[1]["notices"] == []


async def test_changed_deadline_is_relayed_and_late_subscribers_get_the_snapshot(tmp_path):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, StreamReader(sc.url) as guard:
        await guard.next()
        notice = make_notice(deadline_in=None)
        await eventually(lambda: pub.connections == 1)
        pub.add(notice)
        pub.add(notice)  # the same event again is deduped
        moved = notice.with_deadline(make_notice(deadline_in=30).deadline)
        pub.add(moved)
        assert await guard.next() == ("notice", notice.to_wire())
        assert await guard.next() == ("notice", moved.to_wire())
        await guard.quiet(0.2)
        async with StreamReader(sc.url) as late:
            assert await late.next() == ("snapshot", {"v": 1, "node": "node-a", "notices": [moved.to_wire()],
                                                      "complete": True})


async def test_malformed_agent_messages_are_logged_ignored_and_the_relay_keeps_running(tmp_path, caplog):
    async with Publisher() as pub, running_sidecar(tmp_path, pub.url) as sc, StreamReader(sc.url) as guard:
        await guard.next()
        held = make_notice(tag="held")
        await eventually(lambda: pub.connections == 1)
        pub.add(held)
        assert (await guard.next())[0] == "notice"
        bad_version = {**make_notice(tag="x").to_wire(), "v": 2}
        no_kind = {k: v for k, v in make_notice(tag="y").to_wire().items() if k != "kind"}
        naive_time = {**make_notice(tag="z").to_wire(), "deadline": "2026-01-01T00:00:00"}
        for frame in (encode("notice", "{not json"), encode("notice", bad_version), encode("notice", no_kind),
                      encode("notice", naive_time), encode("notice", [1, 2]),
                      encode("withdrawn", {"v": 1, "withdrawn": ""}),
                      encode("snapshot", {"v": 1, "notices": [no_kind]}),  # would drop `held` if applied
                      encode("snapshot", {"v": 1, "notices": "x"}), encode("mystery", {"v": 1})):
            pub.send_raw(frame)
        good = make_notice(tag="good")
        pub.add(good)
        assert await guard.next() == ("notice", good.to_wire())  # nothing bad got through
        assert sc.relay.rejected == 8 and sc.relay.connections == 1
        assert {n.id for n in sc.live.notices()} == {held.id, good.id}
        assert "ignoring malformed 'notice' event" in caplog.text

        # Broken framing (a line that is not UTF-8) drops the connection; the reconnect loses nothing.
        pub.send_raw(b"event: notice\ndata: \xff\xfe\n\n")
        await eventually(lambda: sc.relay.connections == 2 and sc.relay.snapshots == 2, timeout=10)
        later = make_notice(tag="later")
        pub.add(later)
        assert await guard.next() == ("notice", later.to_wire())


async def test_a_silent_agent_connection_is_treated_as_dead(tmp_path):
    """No bytes at all (not even keepalives) for the idle timeout -> reconnect."""
    hits = []
    notice = make_notice()

    async def stream(request: web.Request) -> web.StreamResponse:
        hits.append(1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        notices = [notice.to_wire()] if len(hits) > 1 else []
        await resp.write(encode("snapshot", {"v": 1, "node": "n", "notices": notices}, len(hits)))
        await asyncio.sleep(3600)
        return resp

    app = web.Application()
    app.router.add_get("/v1/stream", stream)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with running_sidecar(tmp_path, url, agent_idle_timeout=0.5) as sc:
            await eventually(lambda: len(hits) >= 2 and len(sc.live) == 1, timeout=10, what="reconnect after silence")
    finally:
        await runner.cleanup()


async def test_a_reader_that_falls_behind_is_cut_off_instead_of_buffered():
    from spotguard.hooks.sidecar.broadcast import CLOSED, CUT_OFF, Broadcaster

    hub = Broadcaster(max_queue=3)
    slow, fast = hub.subscribe(), hub.subscribe()
    for n in range(3):
        hub.publish("notice", {"n": n})
        fast.get_nowait()
    hub.publish("notice", {"n": 3})
    assert [slow.get_nowait().data for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert slow.get_nowait() is CUT_OFF and hub.subscriber_count == 1
    assert fast.get_nowait().seq == 4
    hub.close()
    assert fast.get_nowait() is CLOSED and hub.subscriber_count == 0
