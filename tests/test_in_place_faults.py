"""In-place changes under faults, across real gloo processes (issue 18).

- FSDP2 grow with the reference trainer (`spotguard.trainer.train`): the joiner used to gather
  the full state for its `start` event's digest, a collective the survivor (already training)
  never made: gloo aborted with a collective mismatch. Both now train on as a group of two.
- A joiner dying after the new group formed (FSDP2: the survivors then wait in a new group's
  creation): the survivors take the fallback within the re-form timeout (it was torch's 30 min).
- A launcher SIGKILLed while its worker is blocked in such a change: the worker is gone within
  its grace, long before the re-form timeout.
- A survivor stopped (SIGSTOP) during a shrink: the others wait for it at most one re-form
  timeout (it was two: once in the old group's last agreement, again forming the new group),
  the leaving rank leaves once its checkpoint is durable, and the stopped rank, woken after its
  change's deadline, leaves at once (it sat in TCPStore's connect loop); every rank writes its
  termination message.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.workers.hosts import Hosts, checkpoint_steps
from tests.workers.sidecar_stub import SidecarStub

pytestmark = pytest.mark.slow

LONG = ("--steps", "100000")


def wait_until(check, what: str, timeout: float, hosts: Hosts | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{hosts.tail()}" if hosts else ""))


def events(out: Path, host: str) -> list[dict]:
    """Every event the reference trainer on `host` logged (its rank's file, whichever rank)."""
    found = []
    for path in sorted(out.glob(f"events-{host}*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return found


def steps_in_group_of(out: Path, host: str, world: int) -> int:
    return sum(1 for e in events(out, host) if e.get("event") == "step" and e.get("world_size") == world)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) is gone as far as work goes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_fsdp2_grow_with_the_reference_trainer_trains_on(tmp_path):
    out = tmp_path / "run"
    trainer = ["-m", "spotguard.trainer.train", "--framework", "fsdp2", *LONG, "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--global-batch", "8", "--micro-batch", "4", "--step-seconds", "0.05",
               "--log-every", "1"]
    with SidecarStub() as sidecar, Hosts(out, "fsdp2", tmp_path / "ckpt", worker=trainer,
                                         env={"SPOTGUARD_SIDECAR_URL": sidecar.url,
                                              "SPOTGUARD_REFORM_TIMEOUT": "20"}) as hosts:
        hosts.start(["a"], env={"SPOTGUARD_EVENT_LOG": str(out / "events-a.jsonl")})
        hosts.join("b", env={"SPOTGUARD_EVENT_LOG": str(out / "events-b.jsonl")})
        hosts.wait_for("ready-b", timeout=240)
        wait_until(lambda: steps_in_group_of(out, "a", 1) >= 3, "a training alone", 240, hosts)
        sidecar.push_membership({"v": 1, "generation": 1, "hosts": ["a", "b"], "world_size": 2,
                                 "store": f"127.0.0.1:{hosts.port('a')}"})
        wait_until(lambda: min(steps_in_group_of(out, h, 2) for h in ("a", "b")) >= 5,
                   "a and b training as a group of two", 240, hosts)
        assert {h: p.poll() for h, p in hosts.procs.items()} == {"a": None, "b": None}, hosts.tail()
        resized = [e for e in events(out, "a") if e.get("event") == "resized"]
        assert [(r["path"], r["from_world"], r["to_world"]) for r in resized] == [("in-place", 1, 2)]
        start_b = next(e for e in events(out, "b") if e.get("event") == "start")
        assert start_b["joined"] and start_b["step"] == resized[0]["step"]


def test_a_joiner_dying_after_forming_costs_the_fsdp2_survivors_at_most_the_reform_timeout(tmp_path):
    env = {"SPOTGUARD_REFORM_TIMEOUT": "4", "FAIL_AT": "formed-joiner", "FAIL_NODE": "d", "FAIL_HOW": "exit"}
    with Hosts(tmp_path / "run", "fsdp2", tmp_path / "ckpt", LONG, env=env) as hosts:
        hosts.start(["b", "c"])
        hosts.join("d")
        hosts.wait_for("ready-d", timeout=240)
        hosts.wait_step("b", 2)
        hosts.push(1, ["b", "c", "d"])
        assert hosts.wait(["d"], timeout=240) == {"d": 1}
        died = time.monotonic()
        codes = hosts.wait(["b", "c"], timeout=240)
        stalled = time.monotonic() - died
    assert codes == {"b": 83, "c": 83}, hosts.tail()
    changes = [c for h in ("b", "c") for c in hosts.changes(h)]
    step = changes[0]["step"]
    assert [(c["outcome"], c["step"], c["durable"]) for c in changes] == [("fallback", step, True)] * 2, changes
    assert checkpoint_steps(hosts.ckpt) == [step]
    # The change's stall before the fallback: the re-form timeout (+ the phases before the wait
    # and a loaded machine's slack); then the fallback's own group and save before the exit.
    assert all(c["phases"]["fallback"] < 4 + 5 for c in changes), changes
    assert stalled < 4 + 60, stalled


def test_no_worker_outlives_a_launcher_killed_while_it_is_blocked_in_a_change(tmp_path):
    """The survivors wait in the change (re-form timeout 120 s) for a joiner that hangs after
    forming (alive, so its connections stay open: a joiner that exits can make their next
    collective fail at once instead); b's launcher is SIGKILLed: b's worker leaves within its
    grace (2 s, plus slack)."""
    env = {"SPOTGUARD_REFORM_TIMEOUT": "120", "SPOTGUARD_GRACE_SECONDS": "2", "FAIL_AT": "formed-joiner",
           "FAIL_NODE": "d", "FAIL_HOW": "hang"}
    with Hosts(tmp_path / "run", "fsdp2", tmp_path / "ckpt", LONG, env=env, launched=True) as hosts:
        hosts.start(["b", "c"])
        hosts.join("d")
        hosts.wait_for("ready-d", timeout=240)
        hosts.wait_step("b", 2)
        worker_b = hosts.pid("b")
        hosts.push(1, ["b", "c", "d"])
        hosts.wait_for("hung-d", timeout=240)  # d's worker hangs after the group formed: b and c wait in the change
        assert hosts.procs["b"].poll() is None and alive(worker_b), hosts.tail()
        hosts.procs["b"].kill()
        hosts.procs["b"].wait(10)
        killed = time.monotonic()
        wait_until(lambda: not alive(worker_b), "b's worker to leave after its launcher died", 60, hosts)
        assert time.monotonic() - killed < 60  # the re-form timeout is 120 s


def member(generation: int, hosts: list[str], store: str | None) -> str:
    """A membership as the sidecar relays it (`store` None: it names none)."""
    data = {"v": 1, "generation": generation, "hosts": hosts, "world_size": len(hosts)}
    return json.dumps({**data, "store": store} if store else data)


@pytest.fixture(scope="module", params=[["a", "b", "c", "d"], ["a", "b"]], ids=["names-the-leaver", "is-the-new-group"])
def shrink_with_pending(request, tmp_path_factory) -> tuple[Hosts, dict[str, int]]:
    """a, b, c (DDP); c gets SIGTERM at step 4, when the membership `request.param` (generation 1)
    is pending on every rank; a and b train 4 steps after the change. After it, at steps 6, 7
    and 8, every rank of the new group is offered the confirmation of its hosts (generation 5),
    then a membership naming a host twice and one that changes the hosts without a store, then
    one of generation 3. The exit codes."""
    tmp_path = tmp_path_factory.mktemp("pending")
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", env={"SPOTGUARD_REFORM_TIMEOUT": "5"}) as hosts:
        store = f"127.0.0.1:{hosts.port('a')}"
        offers = [f"4:{member(1, request.param, store)}", f"6:{member(5, ['a', 'b'], store)}",
                  f"7:{member(6, ['a', 'b', 'b'], store)}", f"7:{member(6, ['a', 'c'], None)}",
                  f"8:{member(3, ['a', 'c'], store)}"]
        hosts.start(["a", "b", "c"], args=(*LONG, "--signal-at", "4", "--signal-node", "c",
                                            *(f"--offer={o}" for o in offers), "--stop-after", "1", "--tail", "4"))
        codes = hosts.wait(["a", "b", "c"], timeout=240)
    return hosts, codes


def test_a_membership_pending_at_a_shrink_is_rechecked_against_the_new_group(shrink_with_pending):
    """The shrink goes first (a real notice wins). Afterwards the membership asks nothing: it
    named c, which just left (it used to re-add c: a stall, then the fallback), or it is the new
    group itself (it used to make every rank drain). a and b train on and finish."""
    hosts, codes = shrink_with_pending
    assert codes == {"a": 0, "b": 0, "c": 83}, hosts.tail()
    assert [(c["outcome"], c["world"]) for h in ("a", "b") for c in hosts.changes(h)] == [("in-place", 2)] * 2
    step = hosts.changes("a")[0]["step"]
    assert [hosts.progress(h) for h in ("a", "b")] == [step + 4] * 2  # the 4 steps after the change


def test_bad_memberships_are_refused_in_one_line_naming_the_field_and_training_goes_on(shrink_with_pending):
    """The group a, b (generation 5 confirmed) is offered a membership naming a host twice, one
    that changes the hosts without a store, and one of generation 3: each is refused with one line
    naming its field, on every rank, and the job trains all its steps as it was (no change but the
    shrink before them). They come in the run of the pending membership's test, after its change:
    a group that formed in place takes them as one that started so."""
    hosts, codes = shrink_with_pending
    assert codes["a"] == codes["b"] == 0, hosts.tail()
    step = hosts.changes("a")[0]["step"]
    assert step < 6, step  # the offers came to the group of two
    for host in ("a", "b"):
        assert hosts.progress(host) == step + 4 and len(hosts.changes(host)) == 1
        refused = [line for line in (hosts.out / f"log-{host}").read_text().splitlines() if "refused" in line]
        assert len(refused) == 3, refused
        for line, field in zip(refused, ("hosts:", "store:", "generation:")):
            assert field in line and "training goes on" in line, line


def test_a_joiner_waiting_for_its_membership_does_not_outlive_its_launcher(tmp_path):
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", LONG, launched=True) as hosts:
        hosts.join("d")
        hosts.wait_for("ready-d", timeout=240)  # it waits for a membership naming it
        worker = hosts.pid("d")
        hosts.procs["d"].kill()
        hosts.procs["d"].wait(10)
        wait_until(lambda: not alive(worker), "the joiner to leave after its launcher died", 10, hosts)


@pytest.mark.parametrize("phase", ["handover", "durable"])
def test_a_peer_stopped_during_a_change_costs_the_others_at_most_one_reform_timeout(phase, tmp_path):
    """a leaves at step 3 (SIGTERM); c stops itself (SIGSTOP) as its `phase` ends, and is woken
    once its change's deadline (3 re-form timeouts) has passed. b's fallback starts within one
    re-form timeout of that phase (before: two when c stopped after `durable`, in `left` then in
    `formed`); a waits on nobody after its checkpoint's vote; c leaves at once when woken. The
    re-form timeout is the unit of every bound here: 5 s (8 before) tells one from two as well (b's
    fallback came 8.00 s after `handover` with 8 s), and the test waits 3 of them for c's deadline."""
    reform = 5.0
    env = {"SPOTGUARD_REFORM_TIMEOUT": f"{reform:g}", "FAIL_AT": phase, "FAIL_NODE": "c", "FAIL_HOW": "stop"}
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", env=env) as hosts:
        hosts.start(["a", "b", "c"], args=(*LONG, "--signal-at", "3", "--signal-node", "a"))
        hosts.wait_for("stopped-c", timeout=240)
        stopped = time.monotonic()
        codes = hosts.wait(["a", "b"], timeout=240)
        assert hosts.procs["c"].poll() is None, hosts.tail()  # still stopped
        time.sleep(max(0.0, stopped + 3 * reform + 2 - time.monotonic()))  # past c's change's deadline
        os.kill(hosts.pid("c"), signal.SIGCONT)
        codes.update(hosts.wait(["c"], timeout=120))
        a, b, c = (hosts.changes(h)[0] for h in ("a", "b", "c"))
        messages = {h: hosts.termination(h) for h in ("a", "b", "c")}
    assert set(codes.values()) <= {83, 84} and codes["a"] == codes["b"], (codes, hosts.tail())
    assert (a["outcome"], b["outcome"], c["outcome"]) == ("leave", "fallback", "fallback"), (a, b, c)
    for host, change in (("a", a), ("b", b), ("c", c)):
        assert codes[host] == (83 if change["durable"] else 84), (host, change)
        assert messages[host] is not None and messages[host]["checkpoint"] == \
            ("durable" if change["durable"] else "failed"), (host, messages)
    assert b["phases"]["fallback"] - b["phases"][phase] < 1.5 * reform, b  # one re-form timeout
    assert a["phases"]["departed"] - a["phases"][phase] < 1.5 * reform, a
    if phase == "durable":  # every part committed before c stopped: a waits on nobody
        assert a["durable"] and a["phases"]["departed"] - a["phases"]["durable"] < reform / 2, a
    assert "ChangeExpired" in c["error"], c  # woken after the deadline: no wait on the peers that had gone
