"""The agreed-step machine (`hooks/machine`) in one process: every role (a drain, a shrink's
survivor and leaving rank, a grow's survivor, a membership that settles, a joiner) x every phase
x every failure (this rank raises, a peer is lost in the phase's collective, a peer votes no),
on the real executor and table with scripted collectives, session and adapter (the transfer is
the real gather transfer over them, `SPOTGUARD_RESHARD=gather`). `MATRIX` is the literal table
of what each case ends in: the outcome, whether the agreed step is durable, whether this rank
abandoned its groups (never a yes vote again), and the phase at which the failure ended the walk
(a save that fails at `checkpointed` is learnt in `durable`'s vote). Every case also checks the
phases reached, that every rank that leaves wrote its termination message (none that trains on
did), and that the groups got torch's default timeout back. The real multi-process runs are
tests/test_in_place*.py.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import timedelta

import pytest

from spotguard.hooks.agreement.base import Verdict
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, MembershipView
from spotguard.hooks.elastic.rendezvous import ReformError
from spotguard.hooks.elastic.transfer import HeldState, pack
from spotguard.hooks.group_session import GroupSession, Timeouts
from spotguard.hooks.machine.checkpoint import Checkpoint
from spotguard.hooks.machine.departure import ReturnToLoop
from spotguard.hooks.machine.effects import Effects, Hooks
from spotguard.hooks.machine.executor import AgreedStepMachine
from spotguard.hooks.machine.model import Outcome, Phase, Role
from spotguard.hooks.machine.table import TABLE, Row
from spotguard.wire.membership import Membership
from spotguard.wire.notice import Kind, Notice, now_utc

MATRIX = """
role              phase          failure        outcome    durable  abandoned  ends at
drain             agreed         peer-lost      raise      -        yes        agreed
drain             checkpointed   raises         drain      no       no         -
drain             checkpointed   peer-lost      drain      no       no         -
drain             durable        raises         drain      no       no         -
drain             durable        peer-lost      drain      yes      yes        durable
drain             durable        peer-says-no   drain      no       no         -
shrink-survivor   agreed         peer-lost      raise      -        yes        agreed
shrink-survivor   checkpointed   raises         fallback   no       yes        durable
shrink-survivor   checkpointed   peer-lost      fallback   no       yes        durable
shrink-survivor   handover       raises         fallback   yes      yes        handover
shrink-survivor   handover       peer-lost      fallback   yes      yes        handover
shrink-survivor   durable        raises         fallback   no       yes        durable
shrink-survivor   durable        peer-lost      fallback   yes      yes        durable
shrink-survivor   durable        peer-says-no   fallback   no       yes        durable
shrink-survivor   left           raises         fallback   yes      yes        left
shrink-survivor   formed         raises         fallback   yes      yes        formed
shrink-survivor   formed         peer-lost      fallback   yes      yes        formed
shrink-survivor   rebuilt        raises         fallback   yes      yes        rebuilt
shrink-survivor   rebuilt        peer-lost      fallback   yes      yes        rebuilt
shrink-survivor   transferred    raises         fallback   yes      yes        transferred
shrink-survivor   committed      peer-lost      fallback   yes      yes        committed
shrink-survivor   committed      peer-says-no   fallback   yes      yes        committed
shrink-leaving    agreed         peer-lost      raise      -        yes        agreed
shrink-leaving    checkpointed   raises         leave      no       yes        durable
shrink-leaving    checkpointed   peer-lost      leave      no       yes        durable
shrink-leaving    handover       raises         leave      yes      yes        handover
shrink-leaving    handover       peer-lost      leave      yes      yes        handover
shrink-leaving    durable        raises         leave      no       yes        durable
shrink-leaving    durable        peer-lost      leave      yes      yes        durable
shrink-leaving    durable        peer-says-no   leave      no       yes        durable
shrink-leaving    left           raises         leave      yes      yes        left
grow-survivor     agreed         peer-lost      raise      -        yes        agreed
grow-survivor     decided        peer-lost      drain      no       yes        decided
grow-survivor     checkpointed   raises         continue   no       no         -
grow-survivor     handover       raises         fallback   yes      yes        handover
grow-survivor     handover       peer-lost      fallback   yes      yes        handover
grow-survivor     durable        raises         continue   no       no         -
grow-survivor     durable        peer-lost      fallback   yes      yes        durable
grow-survivor     durable        peer-says-no   continue   no       no         -
grow-survivor     left           raises         fallback   yes      yes        left
grow-survivor     formed         raises         fallback   yes      yes        formed
grow-survivor     formed         peer-lost      fallback   yes      yes        formed
grow-survivor     rebuilt        raises         fallback   yes      yes        rebuilt
grow-survivor     rebuilt        peer-lost      fallback   yes      yes        rebuilt
grow-survivor     transferred    raises         fallback   yes      yes        transferred
grow-survivor     transferred    peer-lost      fallback   yes      yes        transferred
grow-survivor     committed      peer-lost      fallback   yes      yes        committed
grow-survivor     committed      peer-says-no   fallback   yes      yes        committed
settle            agreed         peer-lost      raise      -        yes        agreed
settle            decided        peer-lost      drain      no       yes        decided
joiner            transferred    raises         raise      -        yes        transferred
joiner            transferred    peer-lost      raise      -        yes        transferred
joiner            committed      peer-lost      raise      -        yes        committed
joiner            committed      peer-says-no   raise      -        yes        committed
drain             -              -              drain      yes      no         -
shrink-survivor   -              -              continue   yes      no         -
shrink-leaving    -              -              leave      yes      no         -
grow-survivor     -              -              continue   yes      no         -
settle            -              -              settled    -        no         -
joiner            -              -              continue   -        no         -
"""
# Any other (role, phase, failure) cannot happen (the role does not run the phase, or the phase
# makes no collective, no vote, or nothing of this rank's own that can raise): it ends as the
# role's row without a failure.

WALKS = {  # the phases each role's walk reaches, in order, when nothing fails
    "drain": ["agreed", "decided", "checkpointed", "durable", "departed"],
    "shrink-survivor": ["agreed", "decided", "checkpointed", "handover", "durable", "left", "formed", "rebuilt",
                        "transferred", "committed"],
    "shrink-leaving": ["agreed", "decided", "checkpointed", "handover", "durable", "left", "departed"],
    "grow-survivor": ["agreed", "decided", "checkpointed", "handover", "durable", "left", "formed", "rebuilt",
                      "transferred", "committed"],
    "settle": ["agreed", "decided"],
    "joiner": ["transferred", "committed"],
}
ROLES = list(WALKS)
PHASES = [p.value for p in Phase if p is not Phase.DEPARTED]
FAILURES = ("raises", "peer-lost", "peer-says-no")


def expected_cases() -> dict[tuple[str, str, str], tuple[str, str, bool, str]]:
    lines = [line.replace("ends at", "ends").split() for line in MATRIX.strip().splitlines()[1:]]
    return {(role, phase, how): (outcome, durable, abandoned == "yes", ends)
            for role, phase, how, outcome, durable, abandoned, ends in lines}


EXPECTED = expected_cases()


class Injected(RuntimeError):
    pass


class PeerLost(RuntimeError):
    """What a collective raises when a peer died (gloo: connection closed / timeout)."""


@dataclass
class Script:
    """Where this rank's walk fails: (phase, how); `now` is the phase the walk is in."""

    phase: str = ""
    how: str = ""
    now: str = ""

    def here(self, how: str) -> bool:
        return self.phase == self.now and self.how == how


class ScriptedCollectives(Collectives):
    distributed = True

    def __init__(self, rank: int, world: int, script: Script, notice: Notice | None, hosts: tuple[str, ...]):
        self.rank, self.world_size, self.script, self.notice, self.hosts = rank, world, script, notice, hosts
        self.rendezvous: ScriptedRendezvous | None = None

    def _collective(self) -> None:
        if self.script.here("peer-lost"):
            raise PeerLost(f"peer lost in {self.script.now}")

    def broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        self._collective()
        if src == self.rank:
            if self.rendezvous is not None and payload == ScriptedRendezvous.address.encode():
                self.rendezvous.events.append(f"sent:{payload.decode()}")
            return payload
        if self.script.now == "transferred":  # a joiner: the survivor's state
            return pack(HeldState(11, {"model": {"w": 2.0}, "optim": {}}, {"data_pos": 9}))
        return b"127.0.0.1:29400"  # the first survivor's store

    def max(self, values):
        self._collective()
        return [-0.0] if self.script.now == "transferred" else list(values)  # rank 0 holds the state

    def all_ok(self, ok: bool) -> bool:
        self._collective()
        return ok and not self.script.here("peer-says-no")

    def gather_strings(self, value: str) -> list[str]:
        self._collective()
        return list(self.hosts)


class ScriptedRendezvous:
    address, backend, local_rank = "127.0.0.1:29400", "gloo", 0

    def __init__(self) -> None:
        self.events: list[str] = []  # "serve", and "sent:<address>" for a broadcast of this rank's address

    def serve(self, timeout: float) -> None:
        self.events.append("serve")

    def mark_live(self, prefix) -> None:
        pass


class ScriptedSession(GroupSession):
    """The real timeouts and bounds; formations and leaving scripted. `leaves` is the phase of
    every `leave()`: the `left` row's, or the failure path's (this rank abandoned its groups)."""

    def __init__(self, script: Script):
        super().__init__(Timeouts.of(3.0), ScriptedRendezvous())  # type: ignore[arg-type]
        self.script, self.formed, self.leaves = script, None, []

    def reform(self, store_address, prefix, rank, world_size, timeout) -> None:
        if self.script.here("raises") or self.script.here("peer-lost"):
            raise ReformError(f"forming {prefix} (rank {rank} of {world_size}) failed: {self.script.how}")
        self.formed = (store_address, prefix, rank, world_size)

    def leave(self) -> None:
        self.leaves.append(self.script.now)
        if self.script.now == "left" and self.script.here("raises") and self.leaves.count("left") == 1:
            raise Injected("leaving the old groups failed")


class ScriptedAdapter:
    """A resizable adapter whose every step can be made to fail (`hooks.adapters.base` protocol)."""

    resizable = True
    snapshot_step = None

    def __init__(self, script: Script):
        self.script, self.extra, self.loaded, self.rebuilt = script, {}, None, 0

    def _maybe_raise(self) -> None:
        if self.script.here("raises"):
            raise Injected(f"injected failure at {self.script.now}")

    def save_behind(self, step, *, reason, notice=None) -> Future:
        self._maybe_raise()  # at checkpointed: the copy fails (the write fails on every rank)
        write: Future = Future()
        if self.script.phase == "durable" and self.script.how == "raises":
            write.set_exception(Injected("injected failure of the write"))
        else:
            write.set_result(None)
        return write

    def persist_snapshot_behind(self, *, reason, notice=None):
        raise AssertionError("no snapshot is held: the save decision chooses a fresh save")

    def save(self, step, *, reason, notice=None):
        return self.save_behind(step, reason=reason, notice=notice).result()

    def snapshot(self, step): ...

    def persist_snapshot(self, *, reason, notice=None): ...

    def estimate_save_seconds(self):
        return None

    def resume(self):
        return None

    def answered_notice_id(self):
        return None

    def gradient_carrier(self):
        return None

    def close(self): ...

    def extra_state_now(self) -> dict:
        return {"data_pos": 7}

    def full_state(self) -> dict:
        self._maybe_raise()  # at handover
        return {"model": {"w": 1.0}, "optim": {}}

    def rebuild(self) -> None:
        self._maybe_raise()
        self.rebuilt += 1

    def load_full_state(self, state: dict) -> None:
        self._maybe_raise()  # at transferred
        self.loaded = state

    def shard_state(self):  # the peer-to-peer transfer's; these tests take the gathered one
        raise AssertionError("SPOTGUARD_RESHARD=gather: the state is gathered")

    def shard_device(self):
        raise AssertionError("SPOTGUARD_RESHARD=gather: the state is gathered")

    def load_shards(self, manifest, pieces) -> None:
        raise AssertionError("SPOTGUARD_RESHARD=gather: the state is gathered")


@pytest.fixture(autouse=True)
def gathered_transfer(monkeypatch):
    """The transfer's gather path: its collectives are the scripted ones (max, broadcast)."""
    monkeypatch.setenv("SPOTGUARD_RESHARD", "gather")


def tracked(script: Script) -> tuple[Row, ...]:
    """The real table, each action first telling the script which phase the walk is in."""
    def entering(row: Row):
        def action(walk) -> None:
            script.now = row.phase.value
            row.action(walk)
        return action

    return tuple(replace(row, action=entering(row)) for row in TABLE)


def membership_notice(generation: int, hosts: list[str], node: str) -> Notice:
    data = Membership(generation, tuple(hosts), len(hosts), store="10.0.0.4:29400")
    return Notice(f"membership-{generation}", Kind.DRAIN, MEMBERSHIP_SOURCE, node, now_utc(), None,
                  {"membership": data.to_json(), "generation": generation})


SETUPS = {
    # role: (old hosts, this rank's old rank, the hosts after, the agreed notice's maker)
    "drain": (("a", "b", "c"), 1, ("a", "b", "c"), None),
    "shrink-survivor": (("a", "b", "c"), 1, ("b", "c"), "reclaim"),
    "shrink-leaving": (("a", "b", "c"), 0, ("b", "c"), "reclaim"),
    "grow-survivor": (("b", "c"), 0, ("b", "c", "d"), "membership"),
    "settle": (("b", "c"), 0, ("b", "c"), "membership"),
    "joiner": (("b", "c", "d"), 2, ("b", "c", "d"), None),
}


@dataclass
class Scene:
    """One rank, its script and everything the machine reaches, for one walk."""

    role: str
    script: Script
    session: ScriptedSession
    collectives: ScriptedCollectives
    adapter: ScriptedAdapter
    machine: AgreedStepMachine
    notice: Notice | None
    reached: list[str] = field(default_factory=list)


def scene(role: str, script: Script, write: Future | None = None) -> Scene:
    old, rank, after, kind = SETUPS[role]
    node = old[rank]
    if kind == "reclaim":
        notice: Notice | None = Notice("n-1", Kind.RECLAIM, "test", "a", now_utc(), now_utc() + timedelta(seconds=60))
    elif kind == "membership":
        notice = membership_notice(2, list(after), node)
    else:
        notice = Notice("n-1", Kind.RECLAIM, "test", "z", now_utc(), now_utc() + timedelta(seconds=60))
    session, adapter = ScriptedSession(script), ScriptedAdapter(script)
    collectives = ScriptedCollectives(rank, len(old), script, notice, after)
    collectives.rendezvous = session.rendezvous  # type: ignore[assignment]
    view = None
    if role != "drain":
        view = MembershipView(node)
        view.hosts = old
    effects = Effects(lambda: adapter, lambda: collectives, lambda: None, lambda _id: None, lambda: None,  # type: ignore[arg-type,return-value]
                      Hooks())
    machine = AgreedStepMachine(session, effects, view, ReturnToLoop(), table=tracked(script))
    made = Scene(role, script, session, collectives, adapter, machine, notice)
    effects.hooks.phase.append(lambda name, _record: made.reached.append(name))
    return made


def walk(made: Scene):
    """The walk: the record, or the exception it raised."""
    if made.role == "joiner":
        made.session.joined = Membership(2, ("b", "c", "d"), 3, store="127.0.0.1:29400")
        try:
            return made.machine.join()
        except Exception as exc:
            return exc
    notice = made.notice
    assert notice is not None
    if notice.source == MEMBERSHIP_SOURCE:
        verdict = Verdict(None, float("inf"), -1, notice, made.collectives.rank)
    else:
        verdict = Verdict(notice, notice.deadline.timestamp(), made.collectives.rank)
    try:
        made.machine.run(5, verdict)
    except Exception as exc:
        return exc
    return made.machine.last_drain or (made.machine.resizes or [None])[-1]


CASES = [(role, phase, how) for role in ROLES for phase in PHASES for how in FAILURES]


@pytest.mark.parametrize(("role", "phase", "how"), CASES)
def test_every_role_phase_and_failure(role, phase, how, tmp_path, monkeypatch):
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(termination))
    outcome, durable, abandoned, ends = EXPECTED.get((role, phase, how)) or EXPECTED[(role, "-", "-")]
    made = scene(role, Script(phase, how))
    ended = walk(made)
    assert not made.session.bounded_now()  # every end gives torch's default timeout back
    assert (made.session.leaves != [] and made.session.leaves != ["left"]) is abandoned, made.session.leaves
    if outcome == "raise":
        assert isinstance(ended, Exception) and "committed" not in made.reached
        assert not termination.exists()
        return
    assert not isinstance(ended, Exception), ended
    walked = WALKS[role]
    if role == "joiner":
        assert ended == 12 and made.reached == walked and not termination.exists()
        return
    if outcome == "settled":
        assert made.machine.resizes == [] and made.machine.last_drain is None and not termination.exists()
        return
    record = ended
    assert record is not None
    assert (record.outcome.value, {True: "yes", False: "no"}[record.ok]) == \
        ({"continue": "in-place"}.get(outcome, outcome), durable), record.error
    departs = outcome in ("drain", "leave", "fallback")
    reached = [p for p in walked if p != "departed"]
    if ends != "-":
        reached = reached[:reached.index(ends)]
        assert record.error and "fallback" in record.phases
    assert [p for p in record.phases if p not in ("fallback", "departed")] == reached
    assert ("departed" in record.phases) is departs
    if departs:  # every rank that leaves says so, whatever ended its walk
        message = json.loads(termination.read_text())
        assert (message["notice_id"], message["checkpoint"]) == (record.notice.id, "durable" if record.ok else "failed")
        assert record.exit_code == (83 if record.ok else 84)
    else:
        assert not termination.exists() and record.new_rank is not None


def test_the_table_walks_each_role_as_written():
    def walk_of(*roles: Role) -> list[str]:
        return [row.phase.value for row in TABLE if any(r in row.who for r in roles)]

    assert walk_of(Role.UNDECIDED, Role.DRAINING) == WALKS["drain"]
    assert walk_of(Role.UNDECIDED, Role.STAYING) == WALKS["shrink-survivor"]
    assert walk_of(Role.UNDECIDED, Role.LEAVING) == WALKS["shrink-leaving"]
    assert walk_of(Role.UNDECIDED, Role.SETTLED) == WALKS["settle"]
    assert walk_of(Role.JOINING) == WALKS["joiner"]
    # ahead: the checkpoint commits through the old formation's store while the new group forms
    assert walk_of(Role.UNDECIDED, Role.STAYING_AHEAD) == ["agreed", "decided", "checkpointed", "handover", "left",
                                                           "formed", "rebuilt", "transferred", "durable", "committed"]
    assert list(dict.fromkeys(row.phase for row in TABLE)) == list(Phase)
    assert all(callable(row.action) for row in TABLE)


def test_a_survivor_hands_over_and_forms_on_the_first_survivors_store():
    made = scene("shrink-survivor", Script())
    record = walk(made)
    assert (record.outcome, record.new_rank, record.new_world_size) == (Outcome.CONTINUE, 0, 2)
    assert made.reached == ["checkpointed", "handover", "durable", "left", "formed", "rebuilt", "transferred",
                            "committed"]
    assert made.session.formed == ("127.0.0.1:29400", "s5-2/", 0, 2)
    assert made.session.leaves == ["left"] and made.adapter.rebuilt == 1
    assert made.machine.view.hosts == ("b", "c")
    # the first survivor listens before anyone learns where: a client refused by a store that is not
    # listening yet backs off 0.3-0.7 s, and every rank's `formed` waited for it
    assert made.session.rendezvous.events == ["serve", "sent:127.0.0.1:29400"]


def test_a_grow_forms_on_the_store_the_membership_names_and_shares_the_state():
    made = scene("grow-survivor", Script())
    record = walk(made)
    assert record.outcome is Outcome.CONTINUE and record.joiners == 1
    assert made.session.formed == ("127.0.0.1:29400", "m2/", 0, 3)  # leader b is a survivor: its store
    assert made.machine.view.generation == 2


def test_a_joiner_receives_the_state_of_a_live_peer():
    made = scene("joiner", Script())
    assert walk(made) == 12 and made.reached == ["transferred", "committed"]
    assert made.adapter.loaded == {"model": {"w": 2.0}, "optim": {}} and made.adapter.extra == {"data_pos": 9}
    assert made.session.state_received


@pytest.mark.parametrize("phase", ["checkpointed", "handover", "durable", "left", "formed", "rebuilt", "transferred"])
def test_a_phase_hook_that_raises_fails_that_phase(phase):
    """The `on_resize_phase` hooks (timelines, the fault-injecting workers) run inside the phase."""
    made = scene("shrink-survivor", Script())

    def hook(name, _record):
        if name == phase:
            raise Injected(f"injected failure at {name}")

    made.machine.effects.hooks.phase.append(hook)
    record = walk(made)
    assert (record.outcome, record.ok) == (Outcome.FALLBACK, True)  # the write had ended: durable
    assert phase in record.error and made.session.leaves[-1] == phase


def test_a_rank_that_reaches_a_phase_after_the_deadline_departs_at_once(tmp_path, monkeypatch):
    """A rank stopped between two phases (SIGSTOP) for longer than its change may last: its peers
    have given up, so it waits on none of them again."""
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    made = scene("shrink-survivor", Script())
    made.session.timeouts = Timeouts.of(3.0, change=0.2)
    stopped = threading.Event()

    def stop(name, _record):
        if name == "durable":
            stopped.wait(0.4)  # as if stopped: the change's 0.2 s pass

    made.machine.effects.hooks.phase.append(stop)
    record = walk(made)
    assert record.outcome is Outcome.FALLBACK and record.ok and "ChangeExpired" in record.error
    assert "left" not in record.phases and made.session.formed is None
    assert json.loads((tmp_path / "termination-log").read_text())["checkpoint"] == "durable"


class SlowWrite:
    """A write that really runs behind, on its own thread, and ends only once the hand-over has
    begun (so the two overlap by construction): it fails when `fails`. `log` is the order of what
    happened across both threads."""

    def __init__(self, fails: bool):
        self.fails, self.handover_began, self.log = fails, threading.Event(), []

    def future(self) -> Future:
        write: Future = Future()

        def behind() -> None:
            self.handover_began.wait(30)
            self.log.append("write failed" if self.fails else "write durable")
            if self.fails:
                write.set_exception(Injected("the write failed while the state moved"))
            else:
                write.set_result(None)

        threading.Thread(target=behind, daemon=True).start()
        return write


def run_write_behind(role: str, *, write_fails: bool, transfer_fails: bool):
    made = scene(role, Script())
    slow = SlowWrite(write_fails)
    adapter = made.adapter
    adapter.save_behind = lambda step, **_kw: slow.future()  # type: ignore[method-assign]

    def full_state() -> dict:
        slow.log.append("handover began")
        slow.handover_began.set()
        if transfer_fails:
            raise Injected("the transfer failed while the write ran")
        return {"model": {"w": 1.0}, "optim": {}}

    adapter.full_state = full_state  # type: ignore[method-assign]
    leave = made.session.leave

    def logged_leave() -> None:
        slow.log.append("leave")
        leave()

    made.session.leave = logged_leave  # type: ignore[method-assign]
    return walk(made), made, slow


@pytest.mark.parametrize("role", ["shrink-survivor", "shrink-leaving", "grow-survivor"])
def test_the_transfer_fails_while_the_write_runs(role, tmp_path, monkeypatch):
    """The fallback waits for the write in flight, then leaves the groups: exit 83, durable."""
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    record, made, slow = run_write_behind(role, write_fails=False, transfer_fails=True)
    assert slow.log == ["handover began", "write durable", "leave"]
    assert made.reached == ["checkpointed"] and "Injected" in record.error
    assert record.outcome is (Outcome.LEAVE if role == "shrink-leaving" else Outcome.FALLBACK)
    assert (record.ok, record.exit_code) == (True, 83)


@pytest.mark.parametrize("role", ["shrink-survivor", "shrink-leaving", "grow-survivor"])
def test_the_write_fails_while_the_transfer_runs(role, tmp_path, monkeypatch):
    """The hand-over completes beside the failing write; `durable` learns the failure (the vote):
    a shrink departs with 84 before anything leaves the old group; a grow goes on, not durable."""
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    record, made, slow = run_write_behind(role, write_fails=True, transfer_fails=False)
    assert slow.log[:2] == ["handover began", "write failed"]
    assert record.ok is False and record.exit_code == 84
    if role == "grow-survivor":
        assert record.outcome is Outcome.CONTINUE and made.reached == WALKS[role][2:]
    else:
        assert made.reached == ["checkpointed", "handover"] and made.session.formed is None
        assert record.outcome is (Outcome.LEAVE if role == "shrink-leaving" else Outcome.FALLBACK)
        assert slow.log[-1] == "leave" and "NotDurable" in record.error


class HeldWrite:
    """A PlainTorchAdapter's `_write_state` that waits until released (the write still in flight)."""

    def __init__(self):
        self.release, self.entered = threading.Event(), threading.Event()


def held_adapter(tmp_path, held: HeldWrite):
    import torch

    from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter

    class Held(PlainTorchAdapter):
        def _write_state(self, pending, state):
            held.entered.set()
            assert held.release.wait(30)
            super()._write_state(pending, state)

    model = torch.nn.Linear(4, 4)
    return Held(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path)


@pytest.mark.parametrize("for_notice", [True, False])
def test_the_checkpoint_starts_and_finishes_once_durable(tmp_path, for_notice):
    """The checkpoint's two halves on a real adapter: the start returns with the write in flight
    (nothing committed, no @on_reclaim hook yet); `finish` waits for it, commits, runs the hooks
    after it (a notice's checkpoint) and records a durable checkpoint of the agreed step."""
    held, hooked, answered = HeldWrite(), [], []
    adapter = held_adapter(tmp_path, held)
    hooks = Hooks(reclaim=[lambda step, _n: hooked.append(step)])
    effects = Effects(lambda: adapter, Collectives, lambda: None, answered.append, lambda: None, hooks)
    notice = Notice("n-1", Kind.RECLAIM, "test", "a", now_utc(), None)
    checkpoint = Checkpoint(effects, 5, notice, for_notice)
    checkpoint.start()
    assert held.entered.wait(30) and checkpoint.write is not None and not checkpoint.write.done()
    assert adapter.store.resolve() is None and not hooked
    assert checkpoint.abandon(0.05).durable is False  # the write still in flight at its bound
    checkpoint.saved = None
    held.release.set()
    saved = checkpoint.finish(30)
    assert (saved.durable, saved.exit_code, saved.step) == (True, 83, 5) and checkpoint.finish(30) is saved
    assert checkpoint.abandon(30) is saved
    assert adapter.store.resolve().step == 5
    assert hooked == ([5] if for_notice else []) and answered == (["n-1"] if for_notice else [])
    adapter.close()


@pytest.mark.parametrize("role", ["shrink-survivor", "shrink-leaving"])
def test_a_write_a_stopped_peer_holds_counts_as_failed_after_one_reform_timeout(role, tmp_path, monkeypatch):
    """The write's commit protocol waits on a stopped peer once per collective: the change waits
    for it one re-form timeout beyond the adapter's estimate (none here), then departs with 84,
    well inside the change's budget (it used to wait for every one of those collectives)."""
    monkeypatch.setenv("SPOTGUARD_TERMINATION_LOG", str(tmp_path / "termination-log"))
    made = scene(role, Script())
    made.session.timeouts = Timeouts.of(0.3, change=60.0)
    never: Future = Future()  # the write, held forever
    made.adapter.save_behind = lambda step, **_kw: never  # type: ignore[method-assign]
    record = walk(made)
    assert record.outcome is (Outcome.LEAVE if role == "shrink-leaving" else Outcome.FALLBACK)
    assert (record.ok, record.exit_code) == (False, 84) and "NotDurable" in record.error
    assert record.phases["fallback"] < 30  # one re-form timeout, not the change's budget
    assert json.loads((tmp_path / "termination-log").read_text())["checkpoint"] == "failed"
