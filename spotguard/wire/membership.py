"""The job's membership, as the supervisor pushes it to every pod (annotation
`spotguard.io/membership`, read by the sidecar from its downward-API file).

Wire form: `{"v": 1, "generation": n, "hosts": [...], "world_size": n}` and optionally
`"drain": "<id>"`, the supervisor asking every member to checkpoint and drain (a return from
on-demand to spot capacity; the sidecar turns it into a `drain` notice), and optionally
`"store": "host:port"`, the rendezvous store of the first host (the group's rank 0) for jobs
that change membership in place: a rank re-forms its process group there, at prefix
`m<generation>/`, when the hosts differ from its group's (hooks/elastic), and optionally
`"start": true`: the job's first group (a start-at-min job: its hosts start training together,
none joins a running group), and optionally `"first": {...}`: that `start` membership (a
whole membership object) on a later one of the same start-at-min job while every pod the start
listed is still a member as it was (supervisor/membership_plan.py `_first`), so that a host of it
that reads only a later membership (a sidecar relays the newest) still forms the first group with
the others (hooks/elastic/join.py `first_to_form`), and optionally `"standby": true`: the supervisor asks for a
replacement (warm standby) at once for a member that gets a reclaim or maintenance notice, so
that rank may keep training until its replacement joins (`hooks/replacement_hold.py`); a
supervisor that cannot place one (no capacity) leaves it out. `Membership.to_json`
writes it (supervisor), `Membership.from_wire`/`from_json` read it (sidecar), rejecting another
version, a negative count, duplicate or empty hosts and a bad drain id with
`MembershipFormatError` naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spotguard.wire.fields import versioned_object, whole

VERSION = 1
MAX_DRAIN_ID = 256


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return (bool(sep) and bool(host) and host == host.strip() and len(text) <= 260 and port.isdigit()
            and 0 < int(port) < 65536)


class MembershipFormatError(ValueError):
    """A membership value is not the versioned JSON object; the message names the field."""


@dataclass(frozen=True)
class Membership:
    """Which hosts make up the job, generation `generation` (larger is newer)."""

    generation: int
    hosts: tuple[str, ...]
    world_size: int
    drain: str = ""  # the supervisor's drain request id ("" when none)
    store: str = ""  # "host:port" of the first host's rendezvous store ("" when not in place)
    start: bool = False  # the job's first group: its hosts start it, none joins a running one
    standby: bool = False  # a noticed member's replacement is asked for at once (warm standby)
    first: Membership | None = None  # start at min: the job's first group this one descends from

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"v": VERSION, "generation": self.generation, "hosts": list(self.hosts),
                                "world_size": self.world_size}
        if self.drain:
            wire["drain"] = self.drain
        if self.store:
            wire["store"] = self.store
        if self.start:
            wire["start"] = True
        if self.standby:
            wire["standby"] = True
        if self.first is not None:
            wire["first"] = self.first.to_wire()
        return wire

    @classmethod
    def from_wire(cls, obj: Any, *, nested: bool = False) -> Membership:
        obj = versioned_object(obj, VERSION, MembershipFormatError, "first" if nested else "membership")
        generation = whole(obj, "generation", 0, MembershipFormatError)
        world_size = whole(obj, "world_size", 0, MembershipFormatError)
        hosts = obj.get("hosts")
        if not isinstance(hosts, list) or any(not isinstance(h, str) or not h or h != h.strip() for h in hosts):
            raise MembershipFormatError("hosts: expected a list of non-empty host names")
        if len(set(hosts)) != len(hosts):
            raise MembershipFormatError("hosts: a host is listed twice")
        drain = obj.get("drain", "")
        if not isinstance(drain, str) or len(drain) > MAX_DRAIN_ID or drain != drain.strip():
            raise MembershipFormatError(f"drain: expected a request id of at most {MAX_DRAIN_ID} characters")
        store = obj.get("store", "")
        if not isinstance(store, str) or (store and not _is_host_port(store)):
            raise MembershipFormatError("store: expected \"host:port\" with a port in 1..65535")
        start = obj.get("start", False)
        if not isinstance(start, bool):
            raise MembershipFormatError("start: expected true or false")
        standby = obj.get("standby", False)
        if not isinstance(standby, bool):
            raise MembershipFormatError("standby: expected true or false")
        first = obj.get("first")
        if first is not None:
            if nested:
                raise MembershipFormatError("first: a first group names no first group of its own")
            try:
                first = cls.from_wire(first, nested=True)
            except MembershipFormatError as exc:
                raise MembershipFormatError(f"first.{exc}") from None
            if not first.start or not first.store or first.generation >= generation:
                raise MembershipFormatError("first: expected an earlier `start` membership with a store")
        return cls(generation, tuple(hosts), world_size, drain, store, start, standby, first)

    def to_json(self) -> str:
        """The annotation value: compact JSON with sorted keys, so equal memberships compare equal as text."""
        return json.dumps(self.to_wire(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Membership:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise MembershipFormatError(f"membership: not JSON ({exc})") from None
        return cls.from_wire(obj)
