"""The job's effective membership: supervisor membership, minus hosts with a live notice, trimmed
to what the DeepSpeed elasticity config allows; and the hostfile that follows it.

Inputs: the hostfile as found at start (the *base*: each host's slots), the latest
`spotguard.io/membership` annotation (which hosts the supervisor wants, and the world size it
caps), and the live notices. A notice whose `node` names a host of the job marks it departing
once it reads as a departure (`notice_policy.read` with the Guard's horizon,
`SPOTGUARD_HORIZON_SECONDS`, default 120; the Guard's `act_on` narrowing and its replacement
hold are its own): a maintenance announced an hour ahead is held, so its
host stays in the hostfile until the notice comes within the horizon (a timer looks again at
its release; withdrawn before, the host never left); `rebalance` is only a risk and an advisory
only information: neither departs anybody. Output,
on every change: the hostfile is rewritten atomically (in a thread) and `on_membership(wire)`
is called with the event data: the membership as the supervisor wrote it (`{"v": 1,
"generation", "hosts", "world_size"}` and its `store`, `start`, `standby`, `first`, `drain`;
before one, generation 0 with the base hosts and their slots), `revision`, `departing` and
`hostfile` (the hosts written). Every pod of a job sees the same membership under one generation
(a sidecar hears only its own node's notices, so what it writes may differ for a while); an
in-place Guard applies `group_after` with the same rule to the hosts it agreed on.

Rules:
- candidate hosts: the membership's hosts in its order (all base hosts before any membership);
  a host the base does not list gets the slots the base hosts share, or is skipped (logged)
  when their slots differ;
- kept hosts: `hostfile.group_after` (the rule the in-place Guard re-forms by) over the
  candidates without departing hosts, capped by the membership's world_size (when > 0) and the
  elasticity rule; slots are never changed;
- when nothing fits (e.g. fewer slots left than elasticity's min_gpus), the hostfile is left as
  it is and the event's `hostfile` is empty;
- `generation` of the event is the supervisor's membership generation (0 before it wrote one),
  never a number of this sidecar's own: every pod of the job sees the same generation for the
  same membership, and the in-place Guard uses it as the re-formation's identity (its store
  prefix, the agreement's membership field). A notice that only changes `departing` keeps it.
- `revision` counts this sidecar's events: strictly increasing (a notice, a membership, a
  withdrawal that changes the result each add one).
Without a hostfile, only the membership annotation is relayed, with `departing` and no
`hostfile` (nothing is emitted before a membership).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import Any

from spotguard.hooks.hostfile import ElasticRule, Host, group_after, write_hostfile
from spotguard.wire import notice_policy
from spotguard.wire.membership import Membership
from spotguard.wire.notice import Notice, now_utc

log = logging.getLogger(__name__)

class Topology:
    """Keeps the effective membership and the hostfile in step with their inputs."""

    def __init__(self, on_membership: Callable[[dict[str, Any]], Awaitable[None]],
                 hostfile: str | None = None, base_hosts: list[Host] | None = None,
                 rule: ElasticRule | None = None, horizon_seconds: float = notice_policy.HORIZON_SECONDS,
                 clock: Callable[[], datetime] = now_utc):
        if (hostfile is None) != (base_hosts is None):
            raise ValueError("hostfile and base_hosts go together")
        self.on_membership = on_membership
        self.hostfile = hostfile
        self.base = list(base_hosts or [])
        self.rule = rule
        self.horizon_seconds = horizon_seconds
        self.clock = clock
        self.membership: Membership | None = None
        self.notices: tuple[Notice, ...] = ()  # the live notices that announce a departure
        self.departing: tuple[str, ...] = ()
        self.release_at: datetime | None = None  # when a held notice becomes a departure
        self._release_timer: asyncio.Task | None = None
        self._closed = False
        self.current: dict[str, Any] | None = None  # the last event's data
        self.revision = -1
        self.written: list[Host] = list(self.base)
        self.rewrites = 0
        self._lock = asyncio.Lock()

    def _slots_for_new_host(self) -> int | None:
        counts = collections.Counter(h.slots for h in self.base)
        return next(iter(counts)) if len(counts) == 1 else None

    def _candidates(self) -> list[Host]:
        if self.membership is None:
            return list(self.base)
        by_name = {h.name: h for h in self.base}
        hosts = []
        for name in self.membership.hosts:
            if name in by_name:
                hosts.append(by_name[name])
            elif (slots := self._slots_for_new_host()) is not None:
                hosts.append(Host(name, slots))
            else:
                log.error("membership host %s is not in the hostfile and base slots differ: skipped", name)
        return hosts

    def _job_hosts(self) -> set[str]:
        names = {h.name for h in self.base}
        if self.membership is not None:
            names.update(self.membership.hosts)
        return names

    def effective(self) -> tuple[list[Host] | None, dict[str, Any] | None]:
        """(hosts to write or None, event data or None when there is nothing to say)."""
        if self.hostfile is None:
            if self.membership is None:
                return None, None
            return None, {**self.membership.to_wire(), "departing": list(self.departing)}
        cap = self.membership.world_size if self.membership is not None and self.membership.world_size > 0 else None
        kept = group_after(self._candidates(), self.departing, cap=cap, rule=self.rule)
        if self.membership is not None:
            data = self.membership.to_wire()
        else:
            data = {"v": 1, "generation": 0, "hosts": [h.name for h in self.base],
                    "world_size": sum(h.slots for h in self.base)}
        return kept, {**data, "departing": list(self.departing), "hostfile": [h.name for h in kept]}

    async def set_membership(self, membership: Membership) -> None:
        self.membership = membership
        self.departing = self._departing_now()
        await self.update()

    async def set_notices(self, notices: Iterable[Notice]) -> None:
        self.notices = tuple(n for n in notices if notice_policy.announces_departure(n))
        await self.recheck()

    async def recheck(self) -> None:
        """Reads the notices again at the clock's time (the release timer calls it)."""
        departing = self._departing_now()
        if departing != self.departing:
            self.departing = departing
            await self.update()

    def close(self) -> None:
        """Stops the release timer for good: a recheck already running changes nothing more."""
        self._closed = True
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None

    def _departing_now(self) -> tuple[str, ...]:
        """The job's hosts whose notice reads as a departure now; sets the release timer for the
        earliest held one."""
        now, job = self.clock(), self._job_hosts()
        mine = [n for n in self.notices if n.node in job]
        departing = tuple(sorted(notice_policy.departing_nodes(((n.node, n) for n in mine), now,
                                                               horizon_seconds=self.horizon_seconds)))
        release = notice_policy.next_release(mine, now, horizon_seconds=self.horizon_seconds)
        if release != self.release_at or (release is not None and self._release_timer is None):
            self._stop_timer()
            self.release_at = release
            if release is not None and not self._closed:
                self._release_timer = asyncio.create_task(self._wake((release - now).total_seconds()),
                                                          name="topology-release")
        return departing

    async def _wake(self, after_seconds: float) -> None:
        await asyncio.sleep(max(after_seconds, 0.0))
        self._release_timer = None
        try:
            await self.recheck()
        except Exception:  # a topology problem must not go unseen, nor end the sidecar
            log.exception("re-reading the notices at a held notice's release failed")

    async def update(self) -> None:
        """Recomputes; rewrites the hostfile and emits an event when the result changed (nothing
        once closed)."""
        async with self._lock:
            if self._closed:
                return
            kept, data = self.effective()
            if data is None:
                return
            previous = self.current
            if previous is not None and {**previous, "revision": 0} == {**data, "revision": 0}:
                return
            self.revision += 1
            data["revision"] = self.revision
            if kept and self.hostfile is not None and kept != self.written:
                header = (f"written by spotguard sidecar, membership generation {data['generation']}, "
                          f"revision {self.revision}")
                try:
                    await asyncio.to_thread(write_hostfile, self.hostfile, kept, header)
                except OSError as exc:
                    log.error("cannot rewrite hostfile %s: %s (will retry on the next change)", self.hostfile, exc)
                    return
                self.written = kept
                self.rewrites += 1
                log.info("hostfile %s rewritten: %s", self.hostfile, " ".join(f"{h.name}:{h.slots}" for h in kept))
            elif not kept and self.hostfile is not None:
                log.error("no allowed world size fits the surviving hosts; hostfile %s left unchanged", self.hostfile)
            self.current = data
            await self.on_membership(data)
