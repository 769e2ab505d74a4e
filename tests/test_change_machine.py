"""The in-place change as a state machine (`hooks/elastic/reformer.py`), in one process: every
role (a shrink's survivor and leaving rank, a grow's survivor, a joiner) x every phase x every
failure (this rank raises, a peer is lost in the phase's collective, a peer votes no), driven by
scripted collectives, rendezvous and transfer. Each case says where the change ends, whether
the agreed step stays durable, and that a failed rank abandons its groups (never a yes vote)
and gives torch's default timeout back. The real multi-process runs are tests/test_in_place*.py.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.drain import DrainRecord, PendingCheckpoint
from spotguard.hooks.elastic import bound
from spotguard.hooks.elastic.membership_view import Change
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.hooks.elastic.reformer import PHASES, TABLE, End, Outcome, Reformer, Who
from spotguard.hooks.elastic.rendezvous import ReformError
from spotguard.hooks.elastic.transfer import HeldState
from spotguard.wire.notice import Kind, Notice, now_utc


class Injected(RuntimeError):
    pass


class PeerLost(RuntimeError):
    """What a collective raises when a peer died (gloo: connection closed / timeout)."""


@dataclass
class Script:
    """Where this rank's change fails: (phase, how) with how in raises | peer-lost | peer-says-no."""

    phase: str = ""
    how: str = ""

    def at(self, phase: str, how: str) -> bool:
        return self.phase == phase and self.how == how


class ScriptedCollectives(Collectives):
    distributed = True

    def __init__(self, rank: int, world: int, script: Script, phase: list[str]):
        self.rank, self.world_size, self.script, self.phase = rank, world, script, phase
        self.abandoned = self.left = False

    def _collective(self) -> None:
        if self.script.at(self.phase[0], "peer-lost"):
            raise PeerLost(f"peer lost in {self.phase[0]}")

    def broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        self._collective()
        return payload if payload else b"127.0.0.1:29400"

    def all_ok(self, ok: bool) -> bool:
        self._collective()
        return ok and not self.script.at(self.phase[0], "peer-says-no")

    def abandon(self) -> None:
        self.abandoned = True


class ScriptedRendezvous:
    address, timeout = "127.0.0.1:29400", 3.0

    def __init__(self, script: Script):
        self.script, self.formed = script, None

    def serve(self) -> None:
        pass

    def form(self, store: str, prefix: str, rank: int, world: int) -> None:
        if self.script.phase == "formed" and self.script.how in ("raises", "peer-lost"):
            raise ReformError(f"forming {prefix} (rank {rank} of {world}) on {store} failed: {self.script.how}")
        self.formed = (store, prefix, rank, world)


class ScriptedAdapter:
    resizable = True

    def __init__(self, script: Script, phase: list[str]):
        self.script, self.phase, self.extra, self.loaded = script, phase, {}, None

    def _maybe_raise(self, phase: str) -> None:
        if self.script.at(phase, "raises"):
            raise Injected(f"injected failure at {phase}")

    def extra_state_now(self) -> dict:
        return {"data_pos": 7}

    def full_state(self) -> dict:
        self._maybe_raise("handover")
        return {"model": {"w": 1.0}, "optim": {}}

    def rebuild(self) -> None:
        self._maybe_raise("rebuilt")

    def load_full_state(self, state: dict) -> None:
        self._maybe_raise("transferred")
        self.loaded = state


@dataclass
class ScriptedSeam:
    collectives: ScriptedCollectives
    adapter: ScriptedAdapter
    script: Script
    phase: list[str]
    calls: list[str] = field(default_factory=list)

    def start_checkpoint(self, step: int, notice, *, staying: bool, grow: bool) -> PendingCheckpoint:
        """The copy (this rank raises at `checkpointed`; the save decision's vote loses a peer),
        the write behind (it fails when the script says `durable` raises), the vote at `durable`."""
        self.calls.append("checkpoint")
        if self.script.at("checkpointed", "raises"):
            raise Injected("injected failure at checkpointed")
        self.collectives._collective()
        return PendingCheckpoint(step, step, notice, False, 0.0, 0.0, self.write(), self.finish)

    def write(self) -> Future:
        write: Future = Future()
        if self.script.at("durable", "raises"):
            write.set_exception(Injected("injected failure of the write"))
        else:
            write.set_result(None)
        return write

    def finish(self, pending: PendingCheckpoint) -> DrainRecord:
        self.calls.append("durable")
        ok = self.collectives.all_ok(pending.written())
        return DrainRecord(pending.step, pending.step, pending.notice, False, ok, 83 if ok else 84, 0.0, 0.0, 0.0)

    def leave_group(self) -> None:
        self.calls.append("leave")
        if self.script.phase == "left" and self.script.how in ("raises", "peer-lost"):
            raise PeerLost("leaving the old group failed")

    def bind_group(self) -> None:
        self.calls.append("bind")
        self.collectives._collective()  # the host list is a collective over the new group


def scripted_transfer(script: Script, phase: list[str]):
    """`take_state` as the machine sees it: share (peer-lost), load (raises), `loaded`, the vote."""

    def take(collectives, adapter, held, *, share_first, loaded=None):
        if share_first or held is None:
            collectives._collective()
            held = held or HeldState(11, {"model": {"w": 2.0}, "optim": {}}, {"data_pos": 9})
        adapter.load_full_state(held.state)
        if loaded is not None:
            loaded()
        phase[0] = "committed"
        if not collectives.all_ok(True):
            raise RuntimeError("a rank of the new group failed the change")
        return held

    return take


ROLES = {
    # role: (old hosts, target hosts, this rank's old rank)
    "shrink-survivor": (("a", "b", "c"), ("b", "c"), 1),
    "shrink-leaving": (("a", "b", "c"), ("b", "c"), 0),
    "grow-survivor": (("b", "c"), ("b", "c", "d"), 0),
}
FAILURES = ("raises", "peer-lost", "peer-says-no")


def notice_for(role: str) -> Notice:
    return Notice("n-1", Kind.RECLAIM, "test", "a", now_utc(), None, {})


def run_change(role: str, script: Script):
    old, target, rank = ROLES[role]
    plan = ReformPlan.make(old, target)
    change = Change(plan, "s5-2/", "10.0.0.4:29400" if "grow" in role else "", 1, "membership")
    phase = ["checkpointed"]
    collectives = ScriptedCollectives(rank, plan.old_world_size, script, phase)
    seam = ScriptedSeam(collectives, ScriptedAdapter(script, phase), script, phase)
    rendezvous = ScriptedRendezvous(script)
    reached: list[str] = []

    def on_phase(name, record):
        reached.append(name)
        following = PHASES[PHASES.index(name) + 1] if PHASES.index(name) + 1 < len(PHASES) else "done"
        phase[0] = following

    reformer = Reformer(rendezvous, on_phase, transfer=scripted_transfer(script, phase))  # type: ignore[arg-type]
    record = reformer.run(seam, 5, notice_for(role), change)  # type: ignore[arg-type]
    return record, reached, seam, rendezvous


def injectable(role: str, phase: str, how: str) -> bool:
    """Whether `how` can happen at `phase` (a rank that left reaches no phase of the new group)."""
    if role == "shrink-leaving" and phase not in ("checkpointed", "handover", "durable", "left"):
        return False
    if how == "raises":  # this rank's own step of the phase
        return phase != "committed"
    if how == "peer-lost":  # every phase waits on a peer, but a survivor without joiners shares nothing
        return not (phase == "transferred" and role == "shrink-survivor")
    return phase in ("durable", "committed")  # the two votes


def expected(role: str, phase: str, how: str) -> tuple[Outcome, bool, list[str], bool]:
    """(outcome, durable, phases reached, abandoned) for `role` failing at `phase` by `how`."""
    leaving = role == "shrink-leaving"
    rows = [r.phase for r in TABLE if not (leaving and r.who is not Who.OLD)]
    ended = Outcome.LEAVE if leaving else Outcome.FALLBACK
    if not injectable(role, phase, how):
        return (Outcome.LEAVE if leaving else Outcome.CONTINUE), True, rows, False
    if phase == "checkpointed":
        return ended, False, [], False  # DRAIN: every rank departs together, nobody abandons
    if phase == "durable" and how != "peer-lost":  # the write failed (its vote says so on every rank)
        if role.startswith("grow"):  # a grow's failed save goes on, not durable
            return Outcome.CONTINUE, False, rows, False
        return ended, False, rows[:rows.index(phase)], True  # a shrink falls back, 84
    return ended, True, rows[:rows.index(phase)], True


CASES = [(role, phase, how) for role in ROLES for phase in PHASES for how in FAILURES]


@pytest.mark.parametrize(("role", "phase", "how"), CASES)
def test_every_role_phase_and_failure(role, phase, how):
    outcome, durable, reached, abandoned = expected(role, phase, how)
    record, seen, seam, _ = run_change(role, Script(phase, how))
    assert (record.outcome, record.durable) == (outcome, durable), record.error
    assert seen == reached
    assert seam.collectives.abandoned is abandoned
    assert not bound.bounded()  # every end gives torch's default timeout back
    if outcome in (Outcome.FALLBACK, Outcome.LEAVE) and (abandoned or not durable):
        assert "fallback" in record.phases and record.error
    if outcome is Outcome.CONTINUE:
        assert "fallback" not in record.phases and record.new_rank is not None


def test_the_table_reads_in_the_documented_order():
    assert tuple(row.phase for row in TABLE) == PHASES
    assert [row.on_error for row in TABLE] == [End.DRAIN] + [End.FALLBACK] * (len(TABLE) - 1)
    assert [row.phase for row in TABLE if row.joiner] == ["transferred", "committed"]
    assert all(hasattr(Reformer, row.action) for row in TABLE)


def test_a_survivor_hands_over_and_forms_on_the_first_survivors_store():
    record, seen, seam, rendezvous = run_change("shrink-survivor", Script())
    assert (record.outcome, record.new_rank, record.new_world_size) == (Outcome.CONTINUE, 0, 2)
    assert seen == list(PHASES)
    assert rendezvous.formed == ("127.0.0.1:29400", "s5-2/", 0, 2)
    assert seam.calls == ["checkpoint", "durable", "leave", "bind"]


def test_a_grow_forms_on_the_store_the_membership_names_and_shares_the_state():
    record, _, _seam, rendezvous = run_change("grow-survivor", Script())
    assert record.outcome is Outcome.CONTINUE and record.joiners == 1
    assert rendezvous.formed == ("127.0.0.1:29400", "s5-2/", 0, 3)  # leader b is a survivor: its store


@pytest.mark.parametrize("phase", ["transferred", "committed"])
@pytest.mark.parametrize("how", FAILURES)
def test_a_joiner_raises_on_any_failure_and_reaches_nothing_after_it(phase, how):
    script = Script(phase, how)
    current = ["transferred"]
    collectives = ScriptedCollectives(2, 3, script, current)
    seam = ScriptedSeam(collectives, ScriptedAdapter(script, current), script, current)
    reached: list[str] = []
    reformer = Reformer(ScriptedRendezvous(script), lambda name, _r: reached.append(name),  # type: ignore[arg-type]
                        transfer=scripted_transfer(script, current))
    if not injectable("joiner", phase, how):  # a joiner always receives: peer-lost applies at both
        record = reformer.join(seam)  # type: ignore[arg-type]
        assert (record.step, reached) == (11, ["transferred", "committed"])
        return
    with pytest.raises((Injected, PeerLost, RuntimeError)):
        reformer.join(seam)  # type: ignore[arg-type]
    assert "committed" not in reached and collectives.abandoned
    assert not bound.bounded()


@pytest.mark.parametrize("phase", PHASES[1:-1])
def test_a_phase_hook_that_raises_fails_that_phase(phase):
    """The `on_phase` hooks (timelines, the fault-injecting workers) run inside the phase."""
    plan = ReformPlan.make(("a", "b", "c"), ("b", "c"))
    change = Change(plan, "s5-2/", "", -1, "reclaim")
    current = ["checkpointed"]
    script = Script()
    seam = ScriptedSeam(ScriptedCollectives(1, 3, script, current), ScriptedAdapter(script, current), script, current)

    def hook(name, _record):
        if name == phase:
            raise Injected(f"injected failure at {name}")

    reformer = Reformer(ScriptedRendezvous(script), hook, transfer=scripted_transfer(script, current))  # type: ignore[arg-type]
    record = reformer.run(seam, 5, notice_for("shrink-survivor"), change)  # type: ignore[arg-type]
    assert (record.outcome, record.durable) == (Outcome.FALLBACK, True) and phase in record.error
    assert seam.collectives.abandoned and not bound.bounded()


class WriteBehindSeam(ScriptedSeam):
    """A write that really runs behind, on its own thread, and ends only once the hand-over has
    begun (so the two overlap by construction): it fails when `write_fails`. `log` is the order
    of what happened across both threads."""

    def __init__(self, *args, write_fails: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.write_fails, self.handover_began, self.log = write_fails, threading.Event(), []
        self.collectives.abandon = lambda: self.log.append("abandon")  # type: ignore[method-assign]

    def write(self) -> Future:
        write: Future = Future()

        def behind() -> None:
            self.handover_began.wait(30)
            self.log.append("write failed" if self.write_fails else "write durable")
            if self.write_fails:
                write.set_exception(Injected("the write failed while the state moved"))
            else:
                write.set_result(None)

        threading.Thread(target=behind, daemon=True).start()
        return write


class HandOverAdapter(ScriptedAdapter):
    def __init__(self, seam_log: list[str], began: threading.Event, fails: bool):
        super().__init__(Script(), ["checkpointed"])
        self.seam_log, self.began, self.fails = seam_log, began, fails

    def full_state(self) -> dict:
        self.seam_log.append("handover began")
        self.began.set()
        if self.fails:
            raise Injected("the transfer failed while the write ran")
        return super().full_state()


def run_write_behind(role: str, *, write_fails: bool, transfer_fails: bool):
    old, target, rank = ROLES[role]
    plan = ReformPlan.make(old, target)
    change = Change(plan, "s5-2/", "10.0.0.4:29400" if "grow" in role else "", 1, "membership")
    phase, script = ["checkpointed"], Script()
    seam = WriteBehindSeam(ScriptedCollectives(rank, plan.old_world_size, script, phase), None, script, phase,
                           write_fails=write_fails)
    seam.adapter = HandOverAdapter(seam.log, seam.handover_began, transfer_fails)
    reached: list[str] = []
    reformer = Reformer(ScriptedRendezvous(script), lambda name, _r: reached.append(name),  # type: ignore[arg-type]
                        transfer=scripted_transfer(script, phase))
    record = reformer.run(seam, 5, notice_for(role), change)  # type: ignore[arg-type]
    return record, reached, seam


@pytest.mark.parametrize("role", list(ROLES))
def test_the_transfer_fails_while_the_write_runs(role):
    """The fallback waits for the write in flight, then abandons the groups: exit 83, durable."""
    record, reached, seam = run_write_behind(role, write_fails=False, transfer_fails=True)
    assert seam.log == ["handover began", "write durable", "abandon"]
    assert reached == ["checkpointed"] and "Injected" in record.error
    assert record.outcome is (Outcome.LEAVE if role == "shrink-leaving" else Outcome.FALLBACK)
    assert (record.durable, record.drain.ok, record.drain.exit_code) == (True, True, 83)
    assert not bound.bounded()


@pytest.mark.parametrize("role", list(ROLES))
def test_the_write_fails_while_the_transfer_runs(role):
    """The hand-over completes beside the failing write; `durable` learns the failure (the vote):
    a shrink falls back with 84 before anything leaves the old group; a grow goes on, not durable."""
    record, reached, seam = run_write_behind(role, write_fails=True, transfer_fails=False)
    assert seam.log[:2] == ["handover began", "write failed"]
    assert record.durable is False and record.drain.exit_code == 84
    if role == "grow-survivor":
        assert record.outcome is Outcome.CONTINUE and reached == list(PHASES)
    else:
        assert reached == ["checkpointed", "handover"] and "leave" not in seam.calls
        assert record.outcome is (Outcome.LEAVE if role == "shrink-leaving" else Outcome.FALLBACK)
        assert seam.log[-1] == "abandon" and "NotDurable" in record.error
    assert not bound.bounded()


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


@pytest.mark.parametrize("grow", [False, True])
def test_the_change_starts_its_checkpoint_and_finishes_it_once_durable(tmp_path, grow):
    """`start_checkpoint`'s two halves on a real adapter: the start returns with the write in
    flight (nothing committed, no @on_reclaim hook yet); `finish` waits for it, commits, runs
    the hooks after it and records a durable checkpoint of the agreed step."""
    from spotguard.hooks.drain import DrainSequence
    from spotguard.hooks.elastic.in_place import start_save_before_grow

    held, hooked = HeldWrite(), []
    adapter = held_adapter(tmp_path, held)
    notice = notice_for("shrink-survivor")
    if grow:
        pending = start_save_before_grow(Collectives(), adapter, 5, notice)
    else:
        sequence = DrainSequence(Collectives(), adapter, reclaim_hooks=[lambda step, _n: hooked.append(step)])
        pending = sequence.start(5, None, notice=notice, staying=True)
    assert held.entered.wait(30) and not pending.write.done() and adapter.store.resolve() is None and not hooked
    held.release.set()
    record = pending.finish()
    assert (record.ok, record.exit_code, record.step) == (True, 83, 5) and pending.finish() is record
    assert adapter.store.resolve().step == 5
    assert hooked == ([] if grow else [5])
    adapter.close()
