"""Membership changes in place across real gloo processes, one per host (tests/workers/elastic.py):
DDP and FSDP2 (TorchDCPAdapter), DeepSpeed ZeRO-2 with a client AdamW (fp32, and bf16 parameters over
the fp32 master) and ZeRO-1 with DeepSpeed's AdamW offloaded to the CPU (DeepSpeedAdapter(in_place=True)).

- Shrink: host "a" (rank 0, whose store the job started on) gets SIGTERM; it checkpoints the
  agreed step with the others and exits 83 while "b" and "c" re-form a group of 2 on b's store
  in the same processes. Their state right after the change equals what today's relaunch would
  load from that checkpoint (DeepSpeed: a real relaunch of 2 ranks, which converts the 3 ranks'
  checkpoint to DeepSpeed's universal form and loads it: parameters, fp32 master, Adam moments
  and step, lr, the engine's step count, bit for bit).
- Grow: joiner "d" starts (with the others, to keep the test short) and says it is ready; once
  b and c trained on after the shrink, the membership b, c, d is pushed; at the next agreed step
  the three form a group and d receives the state from a live peer (the survivors save that step
  first, for a fallback; nothing is read for the join).
- Fallback: a failure during a change (a survivor raising after forming or after the transfer,
  a survivor or the joiner dying after it formed the group, a listed host that never comes)
  ends every survivor with 83 and leaves the agreed step durable: a relaunch resumes at that
  step + 1 with the state the survivors held (read here from the newest checkpoint; the FSDP2
  shrink test relaunches real ranks from one).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from dataclasses import dataclass
import pytest
import torch

from tests.workers.hosts import Hosts, checkpoint_steps, newest_checkpoint, restart
from tests.workers.launch import assert_same_state

pytestmark = pytest.mark.slow

LONG = ("--steps", "100000")  # the runs end on the change (--stop-after) or on a failure, never by steps
FAST_FALLBACK = {"SPOTGUARD_REFORM_TIMEOUT": "3"}


@dataclass
class ShrinkThenGrow:
    hosts: Hosts
    codes: dict[str, int]
    pids: dict[str, int]  # host -> the process id it started with
    shrink_ckpt: Path  # the checkpoints as they were after the shrink, before the grow saved its step


RELAUNCHED = ("fsdp2", "deepspeed", "deepspeed-offload", "deepspeed-bf16")  # checked against a real relaunch
SHARDED = RELAUNCHED  # a rank's share of the state changes with the world size
AHEAD = ("ddp", "fsdp2")  # TorchDCPAdapter: a shrink's checkpoint commits through the old store (writes_over_channel)


@pytest.fixture(scope="module", params=["ddp", "fsdp2", "deepspeed", "deepspeed-offload", "deepspeed-bf16"])
def shrink_then_grow(request, tmp_path_factory) -> ShrinkThenGrow:
    """a, b, c; a (rank 0, the store's host) leaves at step 5; then d joins; 3 steps in b, c, d."""
    root = tmp_path_factory.mktemp(f"in-place-{request.param}")
    args = (*LONG, "--signal-at", "5", "--signal-node", "a", "--stop-after", "2", "--tail", "3")
    with Hosts(root / "run", request.param, root / "ckpt", args, env={"SPOTGUARD_REFORM_TIMEOUT": "20"}) as hosts:
        hosts.start(["a", "b", "c"])
        hosts.join("d")
        pids = {host: proc.pid for host, proc in hosts.procs.items()}
        assert hosts.wait(["a"], timeout=240) == {"a": 83}, hosts.tail()
        hosts.wait_for("state-resize-1.pt")
        shutil.copytree(root / "ckpt", root / "ckpt-after-shrink")
        hosts.wait_for("ready-d", timeout=240)
        hosts.push(1, ["b", "c", "d"])
        codes = hosts.wait(["b", "c", "d"], timeout=240)
    return ShrinkThenGrow(hosts, {"a": 83, **codes}, pids, root / "ckpt-after-shrink")


def test_shrink_in_place_when_the_store_host_leaves(shrink_then_grow, tmp_path):
    run = shrink_then_grow
    hosts = run.hosts
    assert run.codes == {"a": 83, "b": 0, "c": 0, "d": 0}, hosts.tail()
    assert [c["outcome"] for c in hosts.changes("a")] == ["leave"]
    step = hosts.changes("a")[0]["step"]
    for host in ("b", "c"):
        shrink = hosts.changes(host)[0]
        assert (shrink["outcome"], shrink["step"], shrink["world"]) == ("in-place", step, 2), shrink
        assert hosts.pid(host) == shrink["pid"] == run.pids[host]  # the same process trained on
        phases = list(shrink["phases"])  # in the order reached
        if hosts.mode in AHEAD:  # the survivors formed, rebuilt and received while the checkpoint committed
            assert phases.index("left") < phases.index("formed") < phases.index("transferred") \
                < phases.index("durable") < phases.index("committed"), phases
        else:
            assert phases.index("durable") < phases.index("left"), phases
    leaver = list(hosts.changes("a")[0]["phases"])
    assert leaver.index("durable") < leaver.index("departed") and hosts.changes("a")[0]["durable"], leaver
    assert [hosts.changes(h)[0]["new_rank"] for h in ("b", "c")] == [0, 1]
    assert checkpoint_steps(run.shrink_ckpt) == [step]  # the notice path still wrote the agreed step
    if hosts.mode in RELAUNCHED:  # a real relaunch of 2 ranks: FSDP2 reshards the 3 ranks' checkpoint as it
        # loads, DeepSpeed converts it to its universal form
        relaunched = restart(hosts.mode, run.shrink_ckpt, tmp_path / "restart", world=2, steps=step + 1)
    else:  # DDP's relaunch loads the replica as saved, bit-exact at another world size (proven with real
        # relaunches in tests/test_adapter_dcp.py, 2 -> 1 -> 2): what the checkpoint holds is what it loads
        relaunched = newest_checkpoint(run.shrink_ckpt)[1]
    assert_same_state(hosts.state("resize-1"), relaunched)


def test_grow_in_place_from_a_live_peer(shrink_then_grow, tmp_path):
    run = shrink_then_grow
    hosts = run.hosts
    assert run.codes == {"a": 83, "b": 0, "c": 0, "d": 0}, hosts.tail()
    shrink_step = hosts.changes("b")[0]["step"]
    grow = [hosts.changes(h)[1] for h in ("b", "c")]
    step = grow[0]["step"]
    assert [(g["outcome"], g["step"], g["world"], g["new_rank"]) for g in grow] == \
        [("in-place", step, 3, 0), ("in-place", step, 3, 1)], grow
    assert [g["pid"] for g in grow] == [run.pids["b"], run.pids["c"]]
    assert hosts.pid("d") == run.pids["d"]
    # Nothing was read for the join: what d holds is the live state, not a checkpoint's. The
    # survivors made the agreed step durable before the change (a fallback's checkpoint).
    assert checkpoint_steps(hosts.ckpt) == [shrink_step, step] and shrink_step < step
    joined = hosts.state("joined")
    assert_same_state(joined, hosts.state("resize-2"))
    assert any(not torch.equal(joined[k], v) for k, v in hosts.state("resize-1").items())
    # The group of three trained its 3 steps together.
    assert [hosts.progress(h) for h in ("b", "c", "d")] == [step + 3] * 3
    if hosts.mode.startswith("deepspeed"):  # what a relaunch of 3 loads from the 2 ranks' checkpoint of that
        # step, through the universal form (a copy: the relaunch adds the converted folder)
        shutil.copytree(hosts.ckpt, tmp_path / "ckpt")
        assert_same_state(hosts.state("resize-2"), restart(hosts.mode, tmp_path / "ckpt", tmp_path / "restart",
                                                           world=3, steps=step + 1))


def test_snapshot_buffers_allocated_at_the_first_step_and_reused_by_the_changes(shrink_then_grow):
    """The worker never calls prepare(): the Guard allocates the buffers at its first step boundary,
    the notice's checkpoint and the grow's reuse them, and after a change that gives a rank another
    shard they are re-sized once, at the first boundary of the new group (every rank alike)."""
    hosts = shrink_then_grow.hosts
    lines = {h: [json.loads(x) for x in (hosts.out / f"buffers-{h}.jsonl").read_text().splitlines()]
             for h in ("a", "b", "c", "d")}
    shrink = hosts.changes("a")[0]["step"]
    grow = hosts.changes("b")[1]["step"]
    for host in ("a", "b", "c"):  # the first boundary (step 0) allocated; the notice's save allocated nothing
        first, reclaim = lines[host][0], next(x for x in lines[host] if x["at"] == "reclaim")
        assert (first["at"], first["step"], first["allocations"]) == ("boundary", 0, 1), lines[host]
        assert (reclaim["step"], reclaim["allocations"], reclaim["nbytes"]) == (shrink, 1, first["nbytes"])
    assert [x["at"] for x in lines["a"]] == ["boundary", "reclaim"], lines["a"]  # the leaver: no other allocation
    joined = lines["d"][0]
    assert (joined["at"], joined["step"], joined["allocations"]) == ("boundary", grow + 1, 1), lines["d"]
    for host in ("b", "c"):
        allocated = [x for x in lines[host] if x["at"] == "boundary"]
        if hosts.mode in SHARDED:  # 3 -> 2 -> 3 shards: re-sized at the first boundary after each change
            assert [(x["step"], x["allocations"]) for x in allocated] == [(0, 1), (shrink + 1, 2), (grow + 1, 3)]
            assert allocated[1]["nbytes"] > max(allocated[0]["nbytes"], allocated[2]["nbytes"]), allocated
        else:  # DDP: the same replica in every group, the same buffers throughout
            assert [(x["step"], x["allocations"]) for x in allocated] == [(0, 1)], allocated


def assert_durable(hosts: Hosts, step: int, held: dict) -> None:
    """The newest complete checkpoint is `step` (a relaunch resumes at step + 1) and holds `held`."""
    saved_step, saved = newest_checkpoint(hosts.ckpt)
    assert saved_step == step
    assert_same_state(held, saved)


@pytest.mark.parametrize("mode, phase", [("ddp", "formed"), ("deepspeed", "rebuilt")])
def test_shrink_falls_back_when_a_survivor_fails_after_forming(mode, phase, tmp_path):
    """The leaving store host is gone, c raises once the group of b and c formed (DeepSpeed: once its
    engine was made again on it): both exit 83 with the agreed step durable, holding what the old
    group held (DeepSpeed: what a relaunch of 2 loads from it)."""
    args = (*LONG, "--signal-at", "3", "--signal-node", "a")
    env = {**FAST_FALLBACK, "FAIL_AT": phase, "FAIL_NODE": "c"}
    with Hosts(tmp_path / "run", mode, tmp_path / "ckpt", args, env=env) as hosts:
        hosts.start(["a", "b", "c"])
        codes = hosts.wait(["a", "b", "c"], timeout=240)
    assert codes == {"a": 83, "b": 83, "c": 83}, hosts.tail()
    step = hosts.changes("a")[0]["step"]
    assert [(c["outcome"], c["step"], c["durable"]) for h in ("b", "c") for c in hosts.changes(h)] == \
        [("fallback", step, True)] * 2
    assert f"injected failure at {phase}" in hosts.changes("c")[0]["error"]
    if mode == "deepspeed":
        assert checkpoint_steps(hosts.ckpt) == [step]
        relaunched = restart(mode, hosts.ckpt, tmp_path / "restart", world=2, steps=step + 1)
        assert_same_state(hosts.state("handover"), relaunched)
    else:
        assert_durable(hosts, step, hosts.state("handover"))
    assert_same_state(hosts.state("save"), hosts.state("handover"))


def test_a_leaving_store_host_that_dies_during_an_ahead_shrink_fails_the_checkpoint_on_every_survivor(tmp_path):
    """DDP (ahead: the checkpoint commits through a's store while b and c re-form): a, the old
    group's rank 0 serving that store, dies at the end of its hand-over. The survivors lose the
    store mid-write: their checkpoint of the step fails alike, nothing of it becomes visible, and
    both depart 84 after they formed the new group (no wait on a's store past the failure)."""
    args = (*LONG, "--signal-at", "3", "--signal-node", "a")
    env = {**FAST_FALLBACK, "FAIL_AT": "handover", "FAIL_NODE": "a", "FAIL_HOW": "exit"}
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args, env=env) as hosts:
        hosts.start(["a", "b", "c"])
        codes = hosts.wait(["a", "b", "c"], timeout=240)
    assert codes == {"a": 1, "b": 84, "c": 84}, hosts.tail()
    changes = [hosts.changes(h)[0] for h in ("b", "c")]
    assert [(c["outcome"], c["durable"]) for c in changes] == [("fallback", False)] * 2, changes
    for change in changes:
        assert "left" in change["phases"] and "NotDurable" in change["error"], change
        assert change["phases"]["fallback"] - change["phases"]["handover"] < 2 * 3.0, change  # FAST_FALLBACK's 3 s
    assert checkpoint_steps(hosts.ckpt) == []  # complete or invisible
    for host in ("b", "c"):
        assert hosts.termination(host)["checkpoint"] == "failed"


def test_a_survivor_dying_while_an_ahead_checkpoint_commits_leaves_one_truth_on_every_rank(tmp_path):
    """DDP (ahead): c dies (exit 1, its write thread with it) once the group of b and c formed,
    while the agreed step's checkpoint may still be committing through a's store. Whether its part
    was committed before it died decides the checkpoint: a and b depart with the same code and
    say the same in their termination messages, and the store holds the step complete (what the
    old group held) or not at all."""
    args = (*LONG, "--signal-at", "3", "--signal-node", "a")
    env = {**FAST_FALLBACK, "FAIL_AT": "formed", "FAIL_NODE": "c", "FAIL_HOW": "exit"}
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args, env=env) as hosts:
        hosts.start(["a", "b", "c"])
        codes = hosts.wait(["a", "b", "c"], timeout=240)
    assert codes["c"] == 1 and codes["a"] == codes["b"] and codes["a"] in (83, 84), hosts.tail()
    a, b = hosts.changes("a")[0], hosts.changes("b")[0]
    assert (a["outcome"], b["outcome"]) == ("leave", "fallback") and a["durable"] == b["durable"], (a, b)
    for host, change in (("a", a), ("b", b)):
        assert hosts.termination(host)["checkpoint"] == ("durable" if change["durable"] else "failed")
    if a["durable"]:
        assert_durable(hosts, a["step"], hosts.state("handover"))
    else:
        assert checkpoint_steps(hosts.ckpt) == []


@pytest.mark.parametrize("noticed, trimmed, stay", [("d", "c", ("a", "b")), ("a", "d", ("b", "c"))],
                         ids=["last-host-noticed", "rank-0-and-store-host-noticed"])
def test_a_shrink_keeps_to_the_world_sizes_the_deepspeed_elasticity_rule_allows(tmp_path, noticed, trimmed, stay):
    """DDP on a, b, c, d with `SPOTGUARD_DEEPSPEED_CONFIG` allowing world sizes 1, 2 and 4 (the
    sidecar trims the hostfile by the same file and the same `group_after`, which keeps the first
    hosts by name): a SIGTERM on one host cannot leave 3, so one more host leaves with it (both 83,
    the agreed step durable) and the other two re-form a group of 2 in their processes, what the
    hostfile would name for a relaunch. Also when the noticed host is rank 0's, the one whose
    store the group met on."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 32,
                                                 "micro_batch_sizes": [4, 8], "min_gpus": 1, "max_gpus": 4}}))
    args = (*LONG, "--signal-at", "3", "--signal-node", noticed, "--stop-after", "1", "--tail", "2")
    env = {"SPOTGUARD_REFORM_TIMEOUT": "20", "SPOTGUARD_DEEPSPEED_CONFIG": str(config)}
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args, env=env) as hosts:
        hosts.start(["a", "b", "c", "d"])
        codes = hosts.wait(["a", "b", "c", "d"], timeout=240)
    assert codes == {**{h: 0 for h in stay}, noticed: 83, trimmed: 83}, hosts.tail()
    step = hosts.changes(noticed)[0]["step"]
    for host in (noticed, trimmed):
        change = hosts.changes(host)[0]
        assert (change["outcome"], change["step"], change["durable"]) == ("leave", step, True), change
        assert hosts.termination(host)["checkpoint"] == "durable"
    for rank, host in enumerate(stay):
        change = hosts.changes(host)[0]
        assert (change["outcome"], change["world"], change["new_rank"]) == ("in-place", 2, rank), change
    assert checkpoint_steps(hosts.ckpt)[0] == step


def test_a_grow_to_a_size_the_elasticity_rule_forbids_waits_for_one_it_allows(tmp_path):
    """a, b train under a rule allowing world sizes 1, 2 and 4. c joins and the supervisor's
    membership lists a, b, c: 3 is not allowed, so a and b keep their group of 2 (the membership
    needs no change) and c, trimmed out as they trim it, keeps waiting. d joins; the membership of
    all four is allowed: c and d join from the live peers in one change and the four train."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 32,
                                                 "micro_batch_sizes": [4, 8], "min_gpus": 1, "max_gpus": 4}}))
    env = {"SPOTGUARD_REFORM_TIMEOUT": "20", "SPOTGUARD_DEEPSPEED_CONFIG": str(config)}
    args = (*LONG, "--stop-after", "1", "--tail", "3")
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args, env=env) as hosts:
        hosts.start(["a", "b"])
        hosts.join("c")
        hosts.wait_for("ready-c", timeout=240)
        hosts.push(1, ["a", "b", "c"])
        settled = "membership 1 needs no change (the elasticity rule keeps the group's own hosts of it)"
        hosts.wait_until(lambda: all(settled in hosts.log(h) for h in ("a", "b")), "a and b to settle membership 1")
        step = max(hosts.progress(h) for h in ("a", "b"))
        hosts.wait_until(lambda: min(hosts.progress(h) for h in ("a", "b")) >= step + 3, "a and b to train on")
        assert hosts.procs["c"].poll() is None and hosts.progress("c") == -1, hosts.tail()  # c still waits
        hosts.join("d")
        hosts.wait_for("ready-d", timeout=240)
        hosts.push(2, ["a", "b", "c", "d"])
        codes = hosts.wait(["a", "b", "c", "d"], timeout=240)
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, hosts.tail()
    grow = [hosts.changes(h) for h in ("a", "b")]
    assert [[(c["outcome"], c["world"], c["new_rank"]) for c in changes] for changes in grow] == \
        [[("in-place", 4, 0)], [("in-place", 4, 1)]], grow
    joined = grow[0][0]["step"]
    assert [hosts.progress(h) for h in ("a", "b", "c", "d")] == [joined + 3] * 4


GROW_FAULTS = {
    "joiner-dies-after-forming": ({"FAIL_AT": "formed-joiner", "FAIL_NODE": "d", "FAIL_HOW": "exit"}, True),
    "store-host-raises-at-transferred": ({"FAIL_AT": "transferred", "FAIL_NODE": "b"}, True),
    "listed-host-never-starts": ({}, False),
}


@pytest.mark.parametrize("fault", GROW_FAULTS)
def test_grow_falls_back_and_loses_nothing(fault, tmp_path):
    """b and c train; the membership b, c, d comes; the change fails: b and c save and exit 83."""
    env, joiner_starts = GROW_FAULTS[fault]
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", LONG, env={**FAST_FALLBACK, **env}) as hosts:
        hosts.start(["b", "c"])
        if joiner_starts:
            hosts.join("d")
            hosts.wait_for("ready-d", timeout=240)
        hosts.wait_step("b", 2)
        hosts.push(1, ["b", "c", "d"])
        codes = hosts.wait(["b", "c"], timeout=240)
        assert codes == {"b": 83, "c": 83}, hosts.tail()
        if joiner_starts:
            assert hosts.wait(["d"], timeout=120)["d"] not in (0, 83), hosts.tail()
    changes = [c for h in ("b", "c") for c in hosts.changes(h)]
    step = changes[0]["step"]
    assert [(c["outcome"], c["step"], c["durable"]) for c in changes] == [("fallback", step, True)] * 2, changes
    assert checkpoint_steps(hosts.ckpt) == [step]  # saved before the change: the fallback needs no save
    assert_durable(hosts, step, hosts.state("handover"))


def test_grow_loses_nothing_when_a_survivor_dies_after_forming(tmp_path):
    """b and c train; the membership b, c, d comes; c dies once the new group formed: b exits 83
    with the agreed step durable (saved before the change: no group of survivors is needed)."""
    env = {**FAST_FALLBACK, "FAIL_AT": "formed", "FAIL_NODE": "c", "FAIL_HOW": "exit"}
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", LONG, env=env) as hosts:
        hosts.start(["b", "c"])
        hosts.join("d")
        hosts.wait_for("ready-d", timeout=240)
        hosts.wait_step("b", 2)
        hosts.push(1, ["b", "c", "d"])
        codes = hosts.wait(["b", "c", "d"], timeout=240)
    assert codes["b"] == 83 and codes["c"] == 1 and codes["d"] not in (0, 83), hosts.tail()
    [change] = hosts.changes("b")
    assert (change["outcome"], change["durable"]) == ("fallback", True), change
    assert checkpoint_steps(hosts.ckpt) == [change["step"]]
    assert_durable(hosts, change["step"], hosts.state("handover"))


def test_start_at_min_trains_with_the_first_membership_and_admits_a_late_host_in_place(tmp_path):
    """Start at min (SPOTGUARD_START_AT_MIN=1, `spotguard launch --nnodes 1:2`): a and b start and
    wait; the first membership (`start`) lists a, which trains alone while b keeps waiting; the
    next one adds b, which joins in place from a live peer."""
    args = (*LONG, "--stop-after", "1", "--tail", "3")
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args,
               env={"SPOTGUARD_START_AT_MIN": "1", "SPOTGUARD_REFORM_TIMEOUT": "20"}) as hosts:
        for host in ("a", "b"):
            hosts.start([host], env={"SPOTGUARD_READY_FILE": str(hosts.out / f"ready-{host}")})
        hosts.wait_for("ready-a", timeout=240)
        hosts.push(1, ["a"], start=True)
        hosts.wait_step("a", 3, timeout=240)
        hosts.wait_for("ready-b", timeout=240)
        assert hosts.progress("b") == -1  # not in the first group: it waits
        hosts.push(2, ["a", "b"])
        codes = hosts.wait(["a", "b"], timeout=240)
    assert codes == {"a": 0, "b": 0}, hosts.tail()
    grow = hosts.changes("a")
    assert [(g["outcome"], g["world"], g["new_rank"]) for g in grow] == [("in-place", 2, 0)]
    assert_same_state(hosts.state("joined"), hosts.state("resize-1"))
    assert [hosts.progress(h) for h in ("a", "b")] == [grow[0]["step"] + 3] * 2


def test_a_host_of_the_first_group_that_reads_only_a_later_membership_still_forms_it(tmp_path):
    """Start at min, a sidecar relaying only the newest membership: the supervisor pushed the
    `start` of a and b and then admitted c. a (and c) read the start; b read only the admission,
    which names the start as its `first`. b forms the first group with a (before: b took the join
    path while a waited for it in the start's rendezvous, and both crashed), and the group admits
    c in place, from a live peer."""
    args = (*LONG, "--stop-after", "1", "--tail", "3")
    with Hosts(tmp_path / "run", "ddp", tmp_path / "ckpt", args,
               env={"SPOTGUARD_START_AT_MIN": "1", "SPOTGUARD_REFORM_TIMEOUT": "20"}) as hosts:
        for host in ("a", "b", "c"):
            only = {"TEST_MEMBERSHIP_FILE": str(hosts.out / "membership-b.json")} if host == "b" else {}
            hosts.start([host], env={"SPOTGUARD_READY_FILE": str(hosts.out / f"ready-{host}"), **only})
        for host in ("a", "b", "c"):
            hosts.wait_for(f"ready-{host}", timeout=240)
        hosts.push(1, ["a", "b"], start=True)
        hosts.wait_until(lambda: "starting with membership 1" in hosts.log("a"), "a read the start")
        for to in ("membership.json", "membership-b.json"):
            hosts.push(2, ["a", "b", "c"], first=(1, ["a", "b"]), to=to)
        codes = hosts.wait(["a", "b", "c"], timeout=240)
    assert codes == {"a": 0, "b": 0, "c": 0}, hosts.tail()
    assert "forming it" in hosts.log("b") and "starting with membership 1 as rank 1 of 2" in hosts.log("b")
    assert "joining membership 2 as rank 2 of 3" in hosts.log("c")
    grow = hosts.changes("a")
    assert [(g["outcome"], g["world"], g["new_rank"]) for g in grow] == [("in-place", 3, 0)]
    assert_same_state(hosts.state("joined"), hosts.state("resize-1"))
