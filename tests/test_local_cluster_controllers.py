"""The dry-run's Job controller and scheduler (trainer/cluster/jobs.py, scheduler.py) over the
local API: what the real ones do for the supervisor (tests/test_k8s_in_place.py,
tests/test_k8s_fallback.py), one pass at a time, with pod statuses written as a kubelet would."""
from __future__ import annotations

import time

import pytest

from spotguard.kube.api import JOBS, NODES, PODS, ApiError
from spotguard.trainer.cluster.job_pods import INDEX_KEY, index_of
from spotguard.trainer.cluster.jobs import JobController
from spotguard.trainer.cluster.kube import LocalKube, rfc3339
from spotguard.trainer.cluster.scheduler import Scheduler
from spotguard.trainer.job_manifest import JobShape, job_manifest
from spotguard.trainer.scenario import parse_scenario

NS = "default"
SPOT = {"karpenter.sh/capacity-type": "spot"}


def node(name: str, *, ready: bool = True, labels: dict | None = None, taints: list | None = None) -> dict:
    return {"metadata": {"name": name, "labels": labels if labels is not None else dict(SPOT)},
            "spec": {"taints": taints or []},
            "status": {"allocatable": {"nvidia.com/gpu": "1", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def indexed_job(completions: int = 2, **spec) -> dict:
    return {"metadata": {"name": "train", "labels": {"spotguard.io/managed": "true"}}, "spec": {
        "completionMode": "Indexed", "completions": completions, "parallelism": completions,
        "backoffLimitPerIndex": 1, "maxFailedIndexes": completions,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [83]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "template": {"spec": {"restartPolicy": "Never", "nodeSelector": dict(SPOT), "containers": [
            {"name": "trainer", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}, **spec}}


def pods_of(kube: LocalKube) -> list[dict]:
    return sorted(kube.list(PODS, NS)[0], key=lambda p: (index_of(p), p["metadata"]["creationTimestamp"]))


def live(kube: LocalKube) -> list[dict]:
    return [p for p in pods_of(kube) if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]


def finish(kube: LocalKube, pod: dict, code: int, conditions: list | None = None) -> None:
    """What a kubelet writes when the pod's container exits with `code` (restartPolicy Never)."""
    kube.patch(PODS, NS, pod["metadata"]["name"], {"status": {
        "phase": "Succeeded" if code == 0 else "Failed", "conditions": conditions or [],
        "containerStatuses": [{"name": "trainer", "restartCount": 0,
                               "state": {"terminated": {"exitCode": code, "finishedAt": rfc3339()}}}]}}, status=True)


def settle(*controllers) -> None:
    for _ in range(4):
        for c in controllers:
            c.sync()


def test_an_indexed_job_gets_one_pod_per_index_with_the_index_and_its_owner():
    kube = LocalKube()
    kube.create(JOBS, NS, indexed_job())
    JobController(kube).sync()
    pods = pods_of(kube)
    assert [index_of(p) for p in pods] == [0, 1]
    first = pods[0]
    assert first["metadata"]["labels"][INDEX_KEY] == "0" and first["metadata"]["labels"]["job-name"] == "train"
    owner = first["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "Job" and owner["controller"]
    assert owner["uid"] == kube.get(JOBS, NS, "train")["metadata"]["uid"]
    assert {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}} in first["spec"]["containers"][0]["env"]
    assert first["spec"]["hostname"] == "train-0"
    assert kube.get(JOBS, NS, "train")["status"]["startTime"]


def test_the_scheduler_binds_only_where_the_pod_fits():
    kube = LocalKube()
    kube.create(NODES, None, node("a-not-ready", ready=False))
    kube.create(NODES, None, node("b-tainted", taints=[{"key": "spotguard.io/reclaim", "value": "reclaim",
                                                        "effect": "NoSchedule"}]))
    kube.create(NODES, None, node("c-on-demand", labels={"karpenter.sh/capacity-type": "on-demand"}))
    kube.create(NODES, None, node("d-spot"))
    kube.create(JOBS, NS, indexed_job())
    settle(JobController(kube), Scheduler(kube))
    first, second = pods_of(kube)
    assert first["spec"]["nodeName"] == "d-spot"  # the only node that fits
    assert "nodeName" not in second["spec"]  # d-spot's one GPU is taken
    assert {"type": "PodScheduled", "status": "False"}.items() <= next(
        c for c in second["status"]["conditions"] if c["type"] == "PodScheduled").items()
    kube.patch(NODES, None, "b-tainted", {"spec": {"taints": None}})
    Scheduler(kube).sync()
    assert pods_of(kube)[1]["spec"]["nodeName"] == "b-tainted"


def test_a_gated_pod_waits_for_its_gate_to_go():
    kube = LocalKube()
    kube.create(NODES, None, node("n"))
    job = indexed_job(completions=1)
    job["spec"]["template"]["spec"]["schedulingGates"] = [{"name": "spotguard.io/capacity"}]
    kube.create(JOBS, NS, job)
    settle(JobController(kube), Scheduler(kube))
    (pod,) = pods_of(kube)
    assert "nodeName" not in pod["spec"]
    kube.patch(PODS, NS, pod["metadata"]["name"], {"spec": {"schedulingGates": None}})
    Scheduler(kube).sync()
    assert pods_of(kube)[0]["spec"]["nodeName"] == "n"


def test_a_drained_pod_is_replaced_after_the_backoff_and_counts_against_nothing():
    kube = LocalKube()
    controller = JobController(kube, failure_backoff=0.3)
    kube.create(JOBS, NS, indexed_job())
    controller.sync()
    leaver = pods_of(kube)[1]
    finish(kube, leaver, 83)
    assert controller.sync() is not None  # the backoff: nothing yet, look again soon
    assert [index_of(p) for p in live(kube)] == [0]
    time.sleep(0.35)
    controller.sync()
    assert sorted(index_of(p) for p in live(kube)) == [0, 1]
    preempted = next(p for p in live(kube) if index_of(p) == 1)
    finish(kube, preempted, 137, [{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}])
    controller.sync()
    time.sleep(0.35)
    controller.sync()
    assert sorted(index_of(p) for p in live(kube)) == [0, 1]  # Ignore twice: backoffLimitPerIndex 1 not reached
    assert not any(c["type"] == "Failed" for c in kube.get(JOBS, NS, "train")["status"].get("conditions", []))


def test_crashes_count_per_index_and_too_many_failed_indexes_fail_the_job():
    kube = LocalKube()
    controller = JobController(kube, failure_backoff=0.0)
    job = indexed_job()
    job["spec"]["maxFailedIndexes"] = 0
    kube.create(JOBS, NS, job)
    controller.sync()
    finish(kube, pods_of(kube)[1], 1)
    controller.sync()  # one failure: within backoffLimitPerIndex 1, re-created
    assert sorted(index_of(p) for p in live(kube)) == [0, 1]
    finish(kube, next(p for p in live(kube) if index_of(p) == 1), 1)
    controller.sync()
    conditions = {c["type"]: c["status"] for c in kube.get(JOBS, NS, "train")["status"]["conditions"]}
    assert conditions.get("Failed") == "True"
    assert live(kube) == [] or all(p["metadata"].get("deletionTimestamp") for p in live(kube))


def test_suspend_deletes_the_pods_then_clears_the_start_time_and_a_resume_uses_the_new_template():
    kube = LocalKube()
    controller = JobController(kube)
    kube.create(NODES, None, node("n0"))
    kube.create(NODES, None, node("n1"))
    kube.create(JOBS, NS, indexed_job())
    settle(controller, Scheduler(kube))
    kube.patch(JOBS, NS, "train", {"spec": {"suspend": True}})
    controller.sync()
    assert all(p["metadata"].get("deletionTimestamp") for p in pods_of(kube))  # bound: their kubelets stop them
    assert kube.get(JOBS, NS, "train")["status"]["startTime"]  # not before the pods are gone
    on_demand = {"spec": {"template": {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"}}}}}
    with pytest.raises(ApiError):
        kube.patch(JOBS, NS, "train", on_demand)
    for pod in pods_of(kube):
        kube.delete(PODS, NS, pod["metadata"]["name"], grace_seconds=0)  # what the kubelet does when stopped
    controller.sync()
    status = kube.get(JOBS, NS, "train")["status"]
    assert "startTime" not in status and any(c["type"] == "Suspended" for c in status["conditions"])
    kube.patch(JOBS, NS, "train", {"spec": {"suspend": False, **on_demand["spec"]}})
    controller.sync()
    assert [p["spec"]["nodeSelector"] for p in pods_of(kube)] == [{"karpenter.sh/capacity-type": "on-demand"}] * 2


def test_a_scale_down_deletes_the_newest_pod_and_completion_ends_the_job():
    kube = LocalKube()
    controller = JobController(kube)
    kube.create(JOBS, NS, indexed_job(completions=3))
    controller.sync()
    kube.patch(JOBS, NS, "train", {"spec": {"parallelism": 2}})
    controller.sync()
    assert sorted(index_of(p) for p in live(kube) if not p["metadata"].get("deletionTimestamp")) == [0, 1]
    for pod in live(kube):
        finish(kube, pod, 0)
    controller.sync()
    assert sorted(index_of(p) for p in live(kube)) == [2]
    finish(kube, live(kube)[0], 0)
    controller.sync()
    status = kube.get(JOBS, NS, "train")["status"]
    assert {c["type"] for c in status["conditions"]} >= {"Complete", "SuccessCriteriaMet"}


RESTART_PATH = parse_scenario("name: restart-path\nworkers: 2\npolicy: elastic\nmin_workers: 1\nmembership: restart\n"
                              "steps: 10\nevents: []\n")


@pytest.mark.parametrize("policy", [True, False], ids=["success-policy", "without-it"])
def test_a_restart_path_job_scaled_down_completes_when_its_training_finishes(policy):
    """The dry-run's restart-path Job (trainer/job_manifest.py) after a drain and the supervisor's
    scale to 1: its pod finishes the training (exit 0) while index 1 never ran. Its
    `successPolicy` completes the Job then; without it Kubernetes needs every index to succeed and
    makes index 1's pod, which would train again (checked on kube-apiserver v1.36.2 too:
    tests/test_k8s_restart_path.py)."""
    manifest = job_manifest(RESTART_PATH, JobShape(["-m", "train"]))
    assert manifest["spec"]["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    if not policy:
        del manifest["spec"]["successPolicy"]
    kube = LocalKube()
    controller = JobController(kube, failure_backoff=0.0)
    kube.create(JOBS, NS, manifest)
    controller.sync()
    for pod in live(kube):
        finish(kube, pod, 83)  # both ranks drained at the agreed step
    kube.patch(JOBS, NS, "train", {"spec": {"parallelism": 1}})  # the supervisor's scale-down
    controller.sync()
    (relaunched,) = live(kube)
    finish(kube, relaunched, 0)  # torchrun: the training finished
    controller.sync()
    conditions = {c["type"]: c["reason"] for c in kube.get(JOBS, NS, "train")["status"].get("conditions", [])}
    index_1 = [p for p in pods_of(kube) if index_of(p) == 1]
    if policy:
        assert index_of(relaunched) == 0
        assert conditions == {"SuccessCriteriaMet": "SuccessPolicy", "Complete": "SuccessPolicy"}
        assert live(kube) == [] and len(index_1) == 1  # the drained one only
    else:
        assert "Complete" not in conditions
        assert [index_of(p) for p in live(kube)] == [1] and len(index_1) == 2
