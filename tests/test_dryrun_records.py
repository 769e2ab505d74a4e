"""What the dry-run derives from what ran (pure): its generations from the trainers' events
(trainer/rounds.py), and the supervisor's decisions and memberships from its decision record
on the Job (trainer/cluster_log.py SupervisorLog)."""
from __future__ import annotations

from spotguard.kube.api import JOBS, PODS
from spotguard.supervisor.record import Record
from spotguard.trainer.cluster_log import SupervisorLog
from spotguard.trainer.rounds import rounds
from spotguard.wire import names


def ev(t: float, event: str, node: str, epoch: int = 0, group: str = "127.0.0.1:100", **extra) -> dict:
    return {"t": t, "event": event, "node": node, "generation": epoch, "group": group, "rank": 0, "step": 0,
            **extra}


def test_in_place_the_launch_and_its_joiners_are_one_generation():
    events = [ev(1, "start", "node-0", world_size=2), ev(1.1, "start", "node-1", world_size=2),
              ev(3, "drained", "node-1", exit_code=83), ev(8, "start", "node-1", joined=True, world_size=2),
              ev(20, "finished", "node-0"), ev(20.1, "finished", "node-1")]
    relabeled, generations = rounds(events, [("node-0", 0.4), ("node-1", 0.5), ("node-1", 7.0)])
    (only,) = generations
    assert (only.index, only.world_size, only.nodes, only.launched_at, only.ended_at, only.reason) == \
        (0, 2, ["node-0", "node-1"], 0.5, 20.1, "finished")
    assert {e["generation"] for e in relabeled} == {0}


def test_a_relaunch_is_a_new_generation_and_a_torchrun_restart_inside_the_pods_is_one_too():
    events = [ev(1, "start", "node-0", world_size=2), ev(1, "start", "node-1", world_size=2),
              ev(4, "drained", "node-0", exit_code=83), ev(4, "drained", "node-1", exit_code=83),
              # the Job controller's new pods: a new epoch, one node (the supervisor scaled to 1)
              ev(9, "start", "node-0", epoch=1, group="localhost:200", world_size=1),
              # torchrun restarted its worker to take node-1 in: a new group, same epoch
              ev(15, "drained", "node-0", epoch=1, group="localhost:200", exit_code=83),
              ev(17, "start", "node-0", epoch=1, group="localhost:300", world_size=2),
              ev(17.1, "start", "node-1", epoch=1, group="localhost:300", world_size=2),
              ev(30, "finished", "node-0", epoch=1, group="localhost:300")]
    relabeled, generations = rounds(events, [("node-0", 0.2), ("node-1", 0.1), ("node-0", 7.5),
                                                ("node-1", 16.0)])
    assert [(g.index, g.world_size, g.nodes, g.launched_at, g.reason) for g in generations] == [
        (0, 2, ["node-0", "node-1"], 0.2, "drained"), (1, 1, ["node-0"], 7.5, "drained"),
        (2, 2, ["node-0", "node-1"], 16.0, "finished")]
    assert [e["generation"] for e in relabeled if e["event"] == "start"] == [0, 0, 1, 2, 2]


def test_a_group_that_ended_without_a_drain_crashed():
    _, generations = rounds([ev(1, "start", "node-0", world_size=1), ev(2, "step", "node-0")])
    assert generations[0].reason == "crashed"


def job_with(record: Record) -> dict:
    return {"metadata": {"name": "train", "annotations": {names.ANN_STATUS: record.to_json()}}}


def test_the_supervisor_log_follows_decisions_and_names_each_memberships_cause():
    log = SupervisorLog("train", first_group=["node-0", "node-1"])
    steps = [Record(key="k1", event=names.EVENT_LEAVING_IN_PLACE, reason="NoticeLeavingInPlace", message="left",
                    generation=1, members=("node-0",), member_pods=("a/0",)),
             Record(key="k1", generation=2, members=("node-0", "node-1"), member_pods=("a/0", "b/0")),
             Record(key="k2", event=names.EVENT_SCALED, reason="CapacityReturned", replicas=2, message="scale",
                    generation=2, members=("node-0", "node-1"), member_pods=("a/0", "b/0")),
             Record(key="k2", generation=3, members=("node-0", "node-1"), member_pods=("c/0", "d/0")),
             Record(key="k2", generation=4, members=("node-0", "node-1"), member_pods=("e/0", "f/0"),
                    start_generation=4)]
    for record in steps:
        log("MODIFIED", str(JOBS), job_with(record))
    log("MODIFIED", str(PODS), job_with(Record(key="ignored")))  # not the Job
    log("MODIFIED", str(JOBS), {"metadata": {"name": "other", "annotations": {names.ANN_STATUS: "x"}}})
    decisions, memberships, record = log.snapshot()
    assert [(d["action"], d["reason"]) for d in decisions] == [("record", "NoticeLeavingInPlace"),
                                                               ("scale", "CapacityReturned")]
    assert [(m.generation, m.hosts, m.cause) for m in memberships] == [
        (1, ["node-0"], "left"), (2, ["node-0", "node-1"], "admitted"), (3, ["node-0", "node-1"], "relaunch"),
        (4, ["node-0", "node-1"], "start")]
    assert record.generation == 4


def test_a_group_relaunched_while_an_old_container_still_ran_is_a_new_generation():
    """In place, every launch uses one launcher address, and a joiner still running when the
    group fell back keeps the epoch: the relaunched group resumes at a later step, and that tells
    it apart."""
    events = [ev(1, "start", "node-0", world_size=2), ev(1, "start", "node-1", world_size=2),
              ev(3, "drained", "node-1", exit_code=83),
              ev(9, "drained", "node-0", exit_code=83, step=120),  # the fallback
              ev(12, "start", "node-0", world_size=2, step=120), ev(12.2, "start", "node-1", world_size=2, step=120),
              ev(30, "finished", "node-0")]
    relabeled, generations = rounds(events, [("node-0", 0.5), ("node-1", 0.5), ("node-1", 5.0), ("node-0", 10.5),
                                             ("node-1", 11.0)])
    assert [(g.index, g.nodes, g.reason) for g in generations] == [(0, ["node-0", "node-1"], "drained"),
                                                                   (1, ["node-0", "node-1"], "finished")]
    assert (generations[0].launched_at, generations[1].launched_at) == (0.5, 11.0)
    assert [e["generation"] for e in relabeled if e["event"] == "start"] == [0, 0, 1, 1]
