"""The dry-run report over recorded event logs: each row takes its own change, by ids.

The logs below are what the reference trainer writes (`trainer.events`), trimmed to the events
the report reads; the first one is a real in-place `two-reclaims` run (3 -> 2 -> 1 in one
generation). Each test is one wrong output the report used to give (issue 18, item 7).
"""
from __future__ import annotations

from spotguard.trainer.changes import job_changes
from spotguard.trainer.report import (GenerationRecord, InjectedEvent, MembershipRecord, build_report,
                                      render_text)

T0 = 1000.0  # the scenario clock's zero (training started)
SCENARIO = {"name": "recorded"}


def ev(t, event, gen, node, rank, world, **fields):
    return {"t": T0 + t, "event": event, "generation": gen, "node": node, "rank": rank, "world_size": world,
            **fields}


def start(t, gen, node, rank, world, step=0, joined=False, digest="d0", pid=1):
    return ev(t, "start", gen, node, rank, world, step=step, joined=joined, digest=digest, pid=pid)


def agreed(t, gen, node, rank, world, step, notice_id, kind="reclaim", detected=None):
    return ev(t, "agreed", gen, node, rank, world, step=step, notice_id=notice_id, kind=kind,
              detected_at_unix=T0 + (detected if detected is not None else t - 0.1))


def durable(t, gen, node, rank, world, step, digest=None):
    return ev(t, "durable", gen, node, rank, world, step=step, seconds=0.2, snapshot=False, digest=digest)


def drained(t, gen, node, rank, world, step, code=83):
    return ev(t, "drained", gen, node, rank, world, step=step, exit_code=code)


def resized(t, gen, node, rank, world, step, to_world, reason="reclaim", pause=0.08):
    return ev(t, "resized", gen, node, rank, world, step=step, path="in-place", reason=reason, from_world=world,
              to_world=to_world, new_rank=rank, pause=pause)


def steps(gen, node, rank, world, upto, t0, t1, every=10, first=10):
    out = []
    span = max(1, (upto - first) // every)
    for i, step in enumerate(range(first, upto + 1, every)):
        out.append(ev(t0 + (t1 - t0) * i / span, "step", gen, node, rank, world, step=step, samples_per_s=100.0))
    return out


def finished(t, gen, node, rank, world, step, pid=1):
    return ev(t, "finished", gen, node, rank, world, step=step, max_step_gap=0.3, pid=pid)


def reclaim(node, at, notice_id, lead=20.0):
    return InjectedEvent("reclaim", node, at, T0 + at, served_at=T0 + at, deadline=T0 + at + lead,
                         notice_id=notice_id)


def capacity(node, at, membership=None, rescaled=None):
    return InjectedEvent("capacity", node, at, T0 + at, served_at=T0 + at, membership=membership, rescaled=rescaled)


def report(injected, generations, events, total=300, memberships=None, in_place=True, end=60.0):
    return build_report(SCENARIO, injected, generations, events, T0, T0 + end, total, memberships=memberships,
                        in_place=in_place, min_workers=1)


def gen(index, nodes, launched, ended=None, reason=""):
    return GenerationRecord(index, len(nodes), list(nodes), T0 + launched, None if ended is None else T0 + ended,
                            reason=reason)


A, B = "aws.spot:a72b69147e5c8cbd", "aws.spot:01f9e80d392b4e7d"


def two_reclaims_in_one_generation():
    """The recorded run: node-2 reclaimed at 4 s (agreed at step 63), node-1 at 5 s (step 73)."""
    events = [start(-0.6, 0, n, r, 3) for r, n in enumerate(("node-0", "node-1", "node-2"))]
    events += [agreed(4.57, 0, n, r, 3, 63, A, detected=4.44) for r, n in enumerate(("node-0", "node-1", "node-2"))]
    events += [durable(4.77, 0, n, r, 3, 63, digest="s63" if n == "node-2" else None)
               for r, n in enumerate(("node-0", "node-1", "node-2"))]
    events += [drained(4.80, 0, "node-2", 2, 3, 63)]
    events += [resized(4.86, 0, n, r, 3, 63, 2) for r, n in enumerate(("node-0", "node-1"))]
    events += [agreed(5.52, 0, n, r, 2, 73, B, detected=5.44) for r, n in enumerate(("node-0", "node-1"))]
    events += [durable(5.68, 0, n, r, 2, 73) for r, n in enumerate(("node-0", "node-1"))]
    events += [drained(5.71, 0, "node-1", 1, 2, 73), resized(5.74, 0, "node-0", 0, 2, 73, 1, pause=0.05)]
    events += [*steps(0, "node-0", 0, 1, 300, 6.0, 18.0, first=80), finished(18.8, 0, "node-0", 0, 1, 300)]
    injected = [reclaim("node-2", 4.0, A), reclaim("node-1", 5.0, B)]
    return injected, [gen(0, ["node-0", "node-1", "node-2"], -21.7, 26.0, "finished")], events


def test_two_changes_in_one_generation_each_take_their_own_agreement():
    injected, generations, events = two_reclaims_in_one_generation()
    r = report(injected, generations, events)
    assert r["ok"], r["problems"]
    first, second = r["timeline"]
    # the Guard's step numbers (its loop index, the checkpoint folder's): events count 63 and 73 steps done
    assert (first["agreed_step"], second["agreed_step"]) == (62, 72)
    assert (first["checkpoint_step"], second["checkpoint_step"]) == (62, 72)
    assert first["ranks_agreed"] == [0, 1, 2] and second["ranks_agreed"] == [0, 1]
    assert (first["world"], second["world"]) == ("3 -> 2", "2 -> 1")
    assert (first["pause_s"], second["pause_s"]) == (0.08, 0.05)
    assert second["detected"] >= second["served"], second  # was 4.44 < 5.00: the first notice's detection
    assert "relaunched" not in first and "relaunched" not in second
    assert r["steps_lost"] == 0 and r["steps_completed"] == 300


def test_a_margin_is_measured_against_the_notices_own_checkpoint():
    injected, generations, events = two_reclaims_in_one_generation()
    injected[0].deadline = T0 + 5.0  # a short notice on node-2: its checkpoint was durable at 4.77
    r = report(injected, generations, events)
    assert r["timeline"][0]["margin_s"] == 0.23  # not 5.68 (the second change's checkpoint) after the deadline
    assert not [p for p in r["problems"] if "deadline" in p], r["problems"]


def grow_after_shrink(capacity_at=3.0):
    """node-1 reclaimed (2 -> 1 in place at step 40), node-2 back: its joiner grows 1 -> 2 at step 90."""
    events = [start(0.0, 0, "node-0", 0, 2), start(0.0, 0, "node-1", 1, 2)]
    events += [agreed(4.1, 0, n, r, 2, 40, A) for r, n in enumerate(("node-0", "node-1"))]
    events += [durable(4.3, 0, n, r, 2, 40) for r, n in enumerate(("node-0", "node-1"))]
    events += [drained(4.35, 0, "node-1", 1, 2, 40), resized(4.4, 0, "node-0", 0, 2, 40, 1, pause=0.06)]
    events += [start(9.0, 0, "node-2", 1, 2, step=90, joined=True, pid=7),
               resized(9.1, 0, "node-0", 0, 1, 90, 2, reason="membership", pause=0.4)]
    events += [finished(20.0, 0, n, r, 2, 300) for r, n in enumerate(("node-0", "node-2"))]
    memberships = [MembershipRecord(1, ["node-0", "node-1", "node-2"], T0 - 1.0, "relaunch"),
                   MembershipRecord(2, ["node-0"], T0 + 4.5, "left"),
                   MembershipRecord(3, ["node-0", "node-2"], T0 + 8.9, "admitted")]
    injected = [capacity("node-2", capacity_at, membership=3), reclaim("node-1", 4.0, A)]
    return injected, [gen(0, ["node-0", "node-1", "node-2"], -5.0, 21.0, "finished")], events, memberships


def test_a_capacity_row_shows_its_own_grow_not_an_earlier_shrink():
    injected, generations, events, memberships = grow_after_shrink()
    r = report(injected, generations, events, memberships=memberships)
    assert r["ok"], r["problems"]
    capacity_row = r["timeline"][0]
    assert (capacity_row["path"], capacity_row["world"], capacity_row["pause_s"]) == ("in-place", "1 -> 2", 0.4)
    assert capacity_row["joined"] == 9.0 and capacity_row["admitted"] == 8.9
    assert r["timeline"][1]["world"] == "2 -> 1"
    assert [(c["from_world"], c["to_world"], c["path"]) for c in r["membership_changes"]] == \
        [(2, 1, "in-place"), (1, 2, "in-place")]


def test_a_reclaim_handled_in_place_is_not_shown_relaunched_by_a_later_crash():
    injected, generations, events, memberships = grow_after_shrink()
    # the job crashed later (both ranks gone at step 200) and generation 1 resumed at step 40
    events = [e for e in events if e["event"] != "finished"]
    events += steps(0, "node-0", 0, 2, 200, 10.0, 15.0, first=100)
    events += [start(22.0, 1, "node-0", 0, 2, step=40), start(22.0, 1, "node-2", 1, 2, step=40),
               finished(40.0, 1, "node-0", 0, 2, 300)]
    generations = [gen(0, ["node-0", "node-1"], -5.0, 16.0, "crashed"), gen(1, ["node-0", "node-2"], 18.0, 41.0)]
    r = report(injected, generations, events, memberships=memberships)
    reclaim_row = r["timeline"][1]
    assert reclaim_row["path"] == "in-place" and "relaunched" not in reclaim_row, reclaim_row
    assert r["steps_lost"] == 160, r["relaunches"]  # trained to 200, resumed at 40
    assert r["relaunches"] == [{"generation": 0, "reason": "crashed", "trained_step": 199, "next_generation": 1,
                                "resumed_step": 39, "resumed": T0 + 22.0, "resumed_digest": "d0",
                                "steps_lost": 160}]
    assert not r["ok"] and any("160 steps lost" in p for p in r["problems"])


def grow_that_fell_back():
    """node-1 returns; membership 3 admits it; the grow fails and the survivor falls back at
    step 120 (durable), every rank relaunches in generation 1 from step 120."""
    events = [start(0.0, 0, "node-0", 0, 1)]
    events += steps(0, "node-0", 0, 1, 120, 1.0, 9.0)
    events += [agreed(9.5, 0, "node-0", 0, 1, 120, "membership-3", kind="drain"),
               durable(19.5, 0, "node-0", 0, 1, 120, digest="s120"), drained(19.6, 0, "node-0", 0, 1, 120)]
    events += [start(26.0, 1, "node-0", 0, 2, step=120, digest="s120"), start(26.0, 1, "node-1", 1, 2, step=120),
               finished(40.0, 1, "node-0", 0, 2, 300)]
    memberships = [MembershipRecord(1, ["node-0"], T0 - 1.0, "relaunch"),
                   MembershipRecord(3, ["node-0", "node-1"], T0 + 9.4, "admitted"),
                   MembershipRecord(4, ["node-0", "node-1"], T0 + 20.0, "relaunch", launch=1)]
    generations = [gen(0, ["node-0"], -5.0, 19.7, "drained"), gen(1, ["node-0", "node-1"], 20.5, 41.0, "finished")]
    return [capacity("node-1", 5.0, membership=3)], generations, events, memberships


def test_a_fallback_is_a_membership_change_and_its_capacity_row_says_relaunched():
    injected, generations, events, memberships = grow_that_fell_back()
    r = report(injected, generations, events, memberships=memberships)
    assert r["ok"], r["problems"]
    assert [(c["from_world"], c["to_world"], c["path"]) for c in r["membership_changes"]] == [(1, 2, "fallback")]
    row = r["timeline"][0]
    assert (row["path"], row["world"], row["relaunch_world_size"], row["resumed_step"], row["steps_lost"]) == \
        ("fallback", "1 -> 2", 2, 119, 0)
    assert "fallback: world 1 -> 2, relaunched" in render_text(r)


def test_steps_lost_are_counted_when_training_never_resumed():
    """A reclaim checkpointed step 50 in place; the grow at step 180 crashed every rank and the
    relaunch never started training: 130 steps trained since are lost (it used to say 0)."""
    events = [start(0.0, 0, "node-0", 0, 2), start(0.0, 0, "node-1", 1, 2)]
    events += [agreed(3.0, 0, n, r, 2, 50, A) for r, n in enumerate(("node-0", "node-1"))]
    events += [durable(3.2, 0, n, r, 2, 50) for r, n in enumerate(("node-0", "node-1"))]
    events += [drained(3.3, 0, "node-1", 1, 2, 50), resized(3.4, 0, "node-0", 0, 2, 50, 1)]
    events += steps(0, "node-0", 0, 1, 180, 4.0, 12.0, first=60)
    generations = [gen(0, ["node-0", "node-1"], -5.0, 13.0, "crashed"), gen(1, ["node-0", "node-1"], 14.0, 30.0)]
    r = report([reclaim("node-1", 2.0, A)], generations, events)
    assert r["steps_lost"] == 130 and r["steps_completed"] == 180
    assert not r["ok"]
    assert "training stopped after 180 of 300 steps" in r["problems"]
    text = render_text(r).splitlines()[0]
    assert "stopped after 180 of 300 steps" in text and text.endswith(", 130 lost")


def test_a_relaunching_job_counts_its_checkpoint_and_resume():
    """The restart path: a reclaim drains every rank at step 70, generation 1 resumes there; the
    capacity row takes the scale-out drain of generation 1 (a signal notice), not the reclaim."""
    events = [start(0.0, 0, "node-0", 0, 2), start(0.0, 0, "node-1", 1, 2)]
    events += [agreed(3.0, 0, n, r, 2, 70, A) for r, n in enumerate(("node-0", "node-1"))]
    events += [durable(3.2, 0, n, r, 2, 70, digest="s70") for r, n in enumerate(("node-0", "node-1"))]
    events += [drained(3.3, 0, n, r, 2, 70) for r, n in enumerate(("node-0", "node-1"))]
    events += [start(8.0, 1, "node-0", 0, 1, step=70, digest="s70")]
    events += [agreed(12.0, 1, "node-0", 0, 1, 150, "signal:1", kind="drain"),
               durable(12.2, 1, "node-0", 0, 1, 150, digest="s150"), drained(12.3, 1, "node-0", 0, 1, 150)]
    events += [start(16.0, 2, n, r, 2, step=150, digest="s150") for r, n in enumerate(("node-0", "node-1"))]
    events += [finished(30.0, 2, "node-0", 0, 2, 300)]
    generations = [gen(0, ["node-0", "node-1"], -5.0, 3.5, "drained"), gen(1, ["node-0"], 4.0, 12.5, "drained"),
                   gen(2, ["node-0", "node-1"], 13.0, 31.0, "finished")]
    injected = [reclaim("node-1", 2.0, A), capacity("node-1", 9.0, rescaled=1)]
    r = report(injected, generations, events, in_place=False)
    assert r["ok"], r["problems"]
    reclaim_row, capacity_row = r["timeline"]
    assert (reclaim_row["path"], reclaim_row["relaunch_world_size"], reclaim_row["resumed_step"]) == ("relaunch", 1, 69)
    assert (capacity_row["agreed_step"], capacity_row["checkpoint_step"]) == (149, 149)  # the scale-out's drain
    assert (capacity_row["path"], capacity_row["relaunch_world_size"], capacity_row["resumed_step"]) == \
        ("relaunch", 2, 149)
    assert r["steps_lost"] == 0


def test_one_node_that_left_and_joined_again_is_two_processes():
    _injected, _generations, events, _memberships = grow_after_shrink()
    events += [start(12.0, 0, "node-1", 1, 3, step=150, joined=True, pid=9),
               resized(12.1, 0, "node-0", 0, 2, 150, 3, reason="membership")]
    changes = job_changes(events)
    assert [(c.step, c.from_world, c.to_world) for c in changes] == [(40, 2, 1), (90, 1, 2), (150, 2, 3)]


def rank_killed_during_a_shrink():
    """4 ranks; a reclaim on node-3; rank 2 was SIGKILLed by the user during the change, so ranks
    0, 1, 3 agreed and saved step 80; the job relaunched at 3 and resumed from that step."""
    nodes = ("node-0", "node-1", "node-2", "node-3")
    events = [start(0.0, 0, n, r, 4) for r, n in enumerate(nodes)]
    acting = [(r, n) for r, n in enumerate(nodes) if r != 2]
    events += [agreed(3.0, 0, n, r, 4, 80, A) for r, n in acting]
    events += [durable(3.2, 0, n, r, 4, 80, digest="s80") for r, n in acting]
    events += [drained(3.3, 0, n, r, 4, 80) for r, n in acting]
    events += [start(8.0, 1, n, r, 3, step=80, digest="s80") for r, n in enumerate(nodes[:3])]
    return events, [gen(0, list(nodes), -5.0, 3.5, "drained"), gen(1, list(nodes[:3]), 6.0, 31.0, "finished")]


def test_a_rank_that_died_is_a_fact_when_nothing_was_lost():
    """Issue 37 item 9: the job recovered (durable at the agreed step, relaunched, resumed, 0
    lost): the missing rank is reported, the run is not failed for it."""
    events, generations = rank_killed_during_a_shrink()
    events += [finished(30.0, 1, "node-0", 0, 3, 300)]
    r = report([reclaim("node-3", 2.0, A)], generations, events, in_place=False)
    assert r["ok"], r["problems"]
    row = r["timeline"][0]
    assert (row["ranks_agreed"], row["ranks_missing"], row["steps_lost"]) == ([0, 1, 3], [2], 0), row
    assert "ranks [2] did not take part (their process had ended)" in render_text(r)


def test_a_rank_that_died_is_a_failure_when_the_job_did_not_recover():
    events, generations = rank_killed_during_a_shrink()
    r = report([reclaim("node-3", 2.0, A)], generations, events, in_place=False)
    assert not r["ok"]
    assert "reclaim on node-3: only ranks [0, 1, 3] of 4 acted" in r["problems"], r["problems"]
