"""The dry-run report says which path saved a notice's checkpoint, as the ranks said it (issue 36,
item 6): their termination messages become `left` events (trainer.departures) and each notice's
row carries `saved_by`, the step, the steps the snapshot cost and the margin to the deadline, as
reported, for the boundary's save and for the deadline watchdog's, which logs no event of its
own. The event logs are what the reference trainer writes, trimmed to what the report reads."""
from __future__ import annotations

import json

import pytest

from spotguard.trainer.cluster_log import PodLife
from spotguard.trainer.departures import Message, departure_events, read_messages
from spotguard.trainer.report import InjectedEvent, build_report, render_text
from spotguard.trainer.rounds import rounds

T0 = 1000.0
N = "aws.spot:5d1c"
PROCESS = {"group": "10.0.0.1:29500"}


def ev(t, event, gen, node, rank, world=2, **fields):
    return {"t": T0 + t, "event": event, "generation": gen, "node": node, "rank": rank, "world_size": world,
            **PROCESS, **fields}


def message(t, node, exit_code=83, pod=None, container=1, **fields):
    body = {"v": 1, "notice_id": N, "step": 12, "saved_step": 10, "steps_lost": 2, "checkpoint": "durable",
            "exit_code": exit_code, "saved_by": "watchdog", "margin_seconds": 4.6, "snapshot_steps": 2, **fields}
    return Message(pod or f"train-{node}", node, json.dumps(body), T0 + t, container)


def first_generation():
    """Two ranks complete 13 steps, snapshotting Guard steps 0, 5 and 10 (logged, as every trainer
    event, by completed steps: 1, 6, 11; digest "s<guard step>"), then sit in the long step 13."""
    events = []
    for rank, node in enumerate(("node-0", "node-1")):
        events.append(ev(0.0, "start", 0, node, rank, step=0, digest="d0", pid=10 + rank))
        events += [ev(0.1 * s, "step", 0, node, rank, step=s, samples_per_s=100.0) for s in range(1, 14)]
        events += [ev(0.1 * s, "snapshot", 0, node, rank, step=s, digest=f"s{s - 1}")
                   for s in (1, 6, 11)]
    return events


def resumed_generation(step=11, digest="s11"):
    return [ev(15.0, "start", 1, "node-0", 0, world=1, step=step, digest=digest, pid=20),
            ev(30.0, "finished", 1, "node-0", 0, world=1, step=30, max_step_gap=15.0, pid=20)]


def reclaim(lead=8.0):
    return InjectedEvent("reclaim", "node-1", 4.0, T0 + 4.0, served_at=T0 + 4.0, deadline=T0 + 4.0 + lead,
                         notice_id=N)


def report_of(events, injected, allowed=2):
    relabeled, generations = rounds(events)
    return build_report({"name": "t"}, injected, generations, relabeled, T0, T0 + 40.0, 30, in_place=False,
                        allowed_steps_lost=allowed), generations


def test_a_message_becomes_a_left_event_of_its_ranks_process_as_written():
    events = first_generation()
    [left] = departure_events([message(8.5, "node-1")], events, {N: "reclaim"})
    assert {k: left[k] for k in ("generation", "node", "rank", "world_size", "group")} == \
        {"generation": 0, "node": "node-1", "rank": 1, "world_size": 2, "group": PROCESS["group"]}
    assert (left["t"], left["notice_id"], left["kind"], left["step"], left["saved"]) == (T0 + 8.5, N, "reclaim", 13, 11)
    assert (left["saved_by"], left["margin_seconds"], left["snapshot_steps"]) == ("watchdog", 4.6, 2)
    assert (left["durable"], left["exit_code"], left["container_exit_code"]) == (True, 83, 1)


@pytest.mark.parametrize("text", ["", "not json", "[1]", '{"v": 1, "step": 3}'])
def test_what_is_not_a_guards_departure_is_none(text):
    assert departure_events([Message("p", "node-1", text, T0 + 9, 1)], first_generation(), {}) == []


def test_the_early_exits_message_of_a_process_stopped_in_its_start_up_is_no_departure():
    text = json.dumps({"v": 1, "notice_id": "signal:x", "step": -1, "saved_step": -1, "checkpoint": "durable",
                       "steps_lost": 0, "saved_by": "nothing-new", "exit_code": 83})
    assert departure_events([Message("p", "node-1", text, T0 + 9, 83)], first_generation(), {}) == []


def test_a_message_before_its_node_logged_anything_ties_to_nothing():
    assert departure_events([message(-1.0, "node-1")], first_generation(), {}) == []


def test_read_messages_reads_each_pods_file_with_the_time_it_was_written(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "termination-log").write_text('{"notice_id": "n"}')
    pods = [PodLife("a", "u", 0, 0.0, node="node-1", exit_code=None), PodLife("b", "u", 1, 0.0, node="node-0")]
    [m] = read_messages(tmp_path, pods)
    assert (m.pod, m.node, m.text, m.container_exit_code) == ("a", "node-1", '{"notice_id": "n"}', None)
    assert m.written_at == (tmp_path / "a" / "termination-log").stat().st_mtime


def test_the_watchdogs_departure_is_a_row_saying_watchdog_its_step_cost_and_margin():
    events = first_generation()
    events += departure_events([message(8.4, "node-0", margin_seconds=4.62), message(8.5, "node-1")], events,
                               {N: "reclaim"})
    out, generations = report_of(events + resumed_generation(digest="s10"), [reclaim()])
    assert out["ok"], out["problems"]
    assert generations[0].reason == "drained" and generations[0].exit_codes == {"node-0": 83, "node-1": 83}
    (row,) = out["timeline"]
    assert "agreed" not in row and "durable" not in row
    assert (row["saved_by"], row["checkpoint_step"], row["snapshot_steps"], row["left_margin_s"]) == \
        ("watchdog", 10, 2, 4.6)
    assert (row["drained"], row["exit_codes"], row["path"], row["resumed_step"]) == (8.5, [83], "relaunch", 10)
    assert row["saved_digest"] == "s10" == row["resumed_digest"]  # the snapshot's state, logged when it was taken
    assert "saved by watchdog at step 10 (2 steps trained after it), left 4.60s before the deadline" in \
        render_text(out)


def test_a_resumed_state_other_than_the_snapshots_is_a_problem():
    events = first_generation()
    events += departure_events([message(8.5, n) for n in ("node-0", "node-1")], events, {N: "reclaim"})
    out, _ = report_of(events + resumed_generation(digest="other"), [reclaim()])
    assert "reclaim on node-1: resumed state differs from the saved state" in out["problems"]


def test_ranks_that_saved_by_different_paths_or_left_with_nothing_durable_are_problems():
    events = first_generation()
    events += departure_events([message(8.5, "node-0"), message(8.5, "node-1", saved_by="nothing-new")], events,
                               {N: "reclaim"})
    out, _ = report_of(events + resumed_generation(), [reclaim()])
    assert "reclaim on node-1: ranks saved by different paths ['nothing-new', 'watchdog']" in out["problems"]
    events = first_generation()
    events += departure_events([message(8.5, n, exit_code=84, checkpoint="failed") for n in ("node-0", "node-1")],
                               events, {N: "reclaim"})
    out, generations = report_of(events, [reclaim()], allowed=13)
    assert "reclaim on node-1: the ranks left with nothing durable (watchdog)" in out["problems"]
    assert out["timeline"][0]["exit_codes"] == [84] and generations[0].reason == "crashed"


def test_the_boundarys_departure_adds_how_it_saved_to_the_row_its_events_made():
    events = first_generation()
    for rank, node in enumerate(("node-0", "node-1")):
        events += [ev(4.2, "agreed", 0, node, rank, step=14, notice_id=N, kind="reclaim", detected_at_unix=T0 + 4.1),
                   ev(4.5, "durable", 0, node, rank, step=14, seconds=0.3, snapshot=False, digest="s14"),
                   ev(4.7, "drained", 0, node, rank, step=14, exit_code=83)]
    events += departure_events([message(4.6, n, step=13, saved_step=13, saved_by="boundary", margin_seconds=7.4,
                                        snapshot_steps=0) for n in ("node-0", "node-1")], events, {N: "reclaim"})
    out, _ = report_of(events + resumed_generation(step=14, digest="s14"), [reclaim(lead=12.0)], allowed=0)
    assert out["ok"], out["problems"]
    (row,) = out["timeline"]
    assert (row["agreed_step"], row["checkpoint_step"], row["saved_by"], row["snapshot_steps"]) == \
        (13, 13, "boundary", 0)
    assert (row["left_margin_s"], row["drained"], row["exit_codes"]) == (7.4, 4.7, [83])  # its own drained events
    assert row["saved_digest"] == "s14" == row["resumed_digest"]
