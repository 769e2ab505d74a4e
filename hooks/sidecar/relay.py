"""The sidecar's subscription to its node agent's stream, and the live notice set it keeps.

`LiveSet` is the set of live notices by id: a snapshot is applied by the rule every consumer
shares (`agent.snapshot.reconcile`: new or changed notices upserted; held ones it lacks
withdrawn only when the snapshot is complete), a notice upserts, a withdrawal removes. Every
method returns only the *changes* it made, so a reconnect whose snapshot repeats what we hold
changes nothing downstream (no duplicate, no withdrawal); an incomplete snapshot (an agent
whose sources have not all read since it restarted) never withdraws; and a notice withdrawn
while we were disconnected is withdrawn downstream once a complete snapshot lacks it.
`LiveSet.complete` turns true with the first complete snapshot and stays so (the sidecar's own
snapshots say it); that first one also yields a `Change(resync=True)`, telling the sidecar to
send its subscribers a fresh, complete snapshot.

`Relay.run()` keeps one GET /v1/stream open to the agent, reconnecting with backoff (reset
after each good snapshot) and treating a silent connection (no bytes, not even the agent's
10 s keepalive, for `idle_timeout` s) as dead. Malformed input never stops it: a bad event is
logged and ignored (a bad snapshot changes nothing); broken SSE framing drops the connection
and reconnects. Changes go to `on_change(changes)`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import aiohttp

from spotguard.agent.notice import WIRE_VERSION, Notice, NoticeFormatError, Withdrawal
from spotguard.agent.snapshot import Snapshot, parse_snapshot, reconcile
from spotguard.agent.sse import SSEDecoder, SSEError
from spotguard.backoff import Backoff

log = logging.getLogger(__name__)

MAX_ID = 512


@dataclass(frozen=True)
class Change:
    """One change to the live set: a new/changed notice, a withdrawal, or (`resync`) the set
    becoming complete (authoritative) for the first time."""

    notice: Notice | None = None
    withdrawal: Withdrawal | None = None
    resync: bool = False

    def to_event(self) -> tuple[str, dict[str, Any]]:
        """(event, data) of a notice or withdrawal; a resync has no event of its own."""
        if self.notice is not None:
            return "notice", self.notice.to_wire()
        assert self.withdrawal is not None
        return "withdrawn", self.withdrawal.to_wire()


def parse_withdrawal(obj: Any) -> Withdrawal:
    """A withdrawal wire object; NoticeFormatError names the bad field."""
    if not isinstance(obj, Mapping):
        raise NoticeFormatError(f"withdrawal: expected a JSON object, got {type(obj).__name__}")
    if obj.get("v") != WIRE_VERSION or isinstance(obj.get("v"), bool):
        raise NoticeFormatError(f"v: unsupported wire version {obj.get('v')!r:.20}")
    notice_id = obj.get("withdrawn")
    if not isinstance(notice_id, str) or not notice_id or len(notice_id) > MAX_ID:
        raise NoticeFormatError(f"withdrawn: expected a notice id, got {notice_id!r:.80}")
    fields = {}
    for name, default in (("source", "unknown"), ("node", "unknown"), ("reason", "withdrawn")):
        value = obj.get(name, default)
        if not isinstance(value, str) or not value:
            raise NoticeFormatError(f"{name}: expected a non-empty string, got {value!r:.80}")
        fields[name] = value
    return Withdrawal(notice_id, **fields)


class LiveSet:
    """Live notices by id. Every mutation returns the list of changes it made."""

    def __init__(self, remember: int = 1024) -> None:
        self._notices: dict[str, Notice] = {}
        self.node: str | None = None
        self.remember = remember
        self._seen: dict[str, None] = {}  # ids ever live, oldest first, at most `remember`
        self.complete = False  # a complete snapshot has been applied
        self._local: set[str] = set()  # ids of notices raised in this pod (set_local), not the agent's

    def seen(self, notice_id: str) -> bool:
        """True if the notice is or was live (among the last `remember` ids)."""
        return notice_id in self._seen

    def notices(self) -> list[Notice]:
        """Live notices, most urgent first (earliest deadline; none sorts last)."""
        return sorted(self._notices.values(),
                      key=lambda n: (n.deadline is None, n.deadline.timestamp() if n.deadline else 0.0, n.id))

    def get(self, notice_id: str) -> Notice | None:
        return self._notices.get(notice_id)

    def __len__(self) -> int:
        return len(self._notices)

    def upsert(self, notice: Notice) -> list[Change]:
        held = self._notices.get(notice.id)
        if held is not None and held.same_event(notice):
            return []
        self._notices[notice.id] = notice
        self._seen[notice.id] = None
        if len(self._seen) > self.remember:
            del self._seen[next(iter(self._seen))]
        return [Change(notice=notice)]

    def withdraw(self, withdrawal: Withdrawal) -> list[Change]:
        if self._notices.pop(withdrawal.notice_id, None) is None:
            return []
        return [Change(withdrawal=withdrawal)]

    def apply_snapshot(self, snapshot: Snapshot) -> list[Change]:
        """Applies a snapshot by the shared rule (module docstring)."""
        if snapshot.node:
            self.node = snapshot.node
        diff = reconcile({k: n for k, n in self._notices.items() if k not in self._local}, snapshot)
        changes = []
        for notice_id in diff.withdrawn:
            held = self._notices.pop(notice_id)
            changes.append(Change(withdrawal=Withdrawal(notice_id, held.source, held.node, "absent from snapshot")))
        for notice in diff.upserts:
            changes.extend(self.upsert(notice))
        if snapshot.complete and not self.complete:
            self.complete = True
            changes.append(Change(resync=True))
        return changes

    def set_local(self, notices: list[Notice], reason: str = "request withdrawn") -> list[Change]:
        """Makes the pod-local notices (not the agent's: e.g. the supervisor's drain request)
        equal to `notices`. Agent snapshots never withdraw them; only this call does."""
        changes: list[Change] = []
        wanted = {n.id: n for n in notices}
        for notice_id in sorted(self._local - wanted.keys()):
            held = self._notices.pop(notice_id, None)
            if held is not None:
                changes.append(Change(withdrawal=Withdrawal(notice_id, held.source, held.node, reason)))
        self._local = set(wanted)
        for notice in notices:
            changes.extend(self.upsert(notice))
        return changes

    def replace(self, notices: list[Notice], node: str | None = None) -> list[Change]:
        """Makes the set equal to the notices of a complete snapshot."""
        return self.apply_snapshot(Snapshot(node, notices, complete=True))


class Relay:
    """Follows `<agent_url>/v1/stream` into `live`; reports changes to `on_change`."""

    def __init__(self, agent_url: str, on_change: Callable[[list[Change]], Awaitable[None]],
                 live: LiveSet | None = None, idle_timeout: float = 35.0, connect_timeout: float = 5.0,
                 backoff: Backoff | None = None, max_event_bytes: int = 1 << 20):
        self.stream_url = agent_url.rstrip("/") + "/v1/stream"
        self.on_change = on_change
        self.live = live if live is not None else LiveSet()
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff(base=0.2, cap=5.0)
        self.max_event_bytes = max_event_bytes
        self.connected = False
        self.connections = 0  # successful connections so far
        self.snapshots = 0  # good snapshots applied so far
        self.rejected = 0  # malformed events ignored so far

    async def run(self) -> None:
        """Runs until cancelled; never raises for anything the agent or network does."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.idle_timeout)
        async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
            while True:
                try:
                    await self._follow(session)
                except asyncio.CancelledError:
                    raise
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    log.warning("agent stream %s: %s: %s", self.stream_url, type(exc).__name__, exc)
                except SSEError as exc:
                    log.error("agent stream %s: broken framing (%s); reconnecting", self.stream_url, exc)
                except Exception:  # noqa: BLE001 - the relay must outlive any bug in one event
                    log.exception("agent stream %s: unexpected failure; reconnecting", self.stream_url)
                finally:
                    self.connected = False
                await asyncio.sleep(self.backoff.next_delay())

    async def _follow(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self.stream_url, headers={"Accept": "text/event-stream"}) as resp:
            if resp.status != 200:
                log.warning("agent stream %s: HTTP %s", self.stream_url, resp.status)
                return
            self.connected = True
            self.connections += 1
            log.info("agent stream connected: %s", self.stream_url)
            decoder = SSEDecoder(max_line=self.max_event_bytes)
            async for chunk in resp.content.iter_any():
                for event in decoder.feed(chunk):
                    await self.handle(event.event, event.data)
            log.warning("agent stream %s: closed by the agent", self.stream_url)

    async def handle(self, event: str, data: str) -> list[Change]:
        """Applies one stream event; a malformed one is logged and changes nothing."""
        try:
            obj = json.loads(data)
            if event == "snapshot":
                changes = self.live.apply_snapshot(parse_snapshot(obj))
                self.snapshots += 1
                self.backoff.reset()
            elif event == "notice":
                changes = self.live.upsert(Notice.from_wire(obj))
            elif event == "withdrawn":
                changes = self.live.withdraw(parse_withdrawal(obj))
            else:
                log.info("agent stream: ignoring unknown event type %r", event[:40])
                return []
        except (ValueError, TypeError) as exc:  # NoticeFormatError, JSONDecodeError are ValueErrors
            self.rejected += 1
            log.error("agent stream: ignoring malformed %r event: %s", event[:40], exc)
            return []
        if changes:
            await self.on_change(changes)
        return changes
