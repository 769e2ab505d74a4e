"""The dry-run's local API server (trainer/cluster/kube.py): the semantics the supervisor and the
node agent rely on, checked the way they use them (and, for the informer, with the supervisor's
own `Informer` over it)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spotguard.kube.api import (EVENTS, JOBS, JSON_PATCH, NODES, PODS, PYTORCHJOBS, STRATEGIC_MERGE_PATCH,
                                ApiError, Conflict, NotFound)
from spotguard.kube.conflict import retry_on_conflict
from spotguard.supervisor.informer import Informer
from spotguard.trainer.cluster.kube import LocalKube

NS = "default"


def pod(name: str, node: str | None = None, **labels: str) -> dict:
    spec = {"containers": [{"name": "trainer", "image": "x"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels}, "spec": spec}


def job(name: str = "train", suspend: bool = False) -> dict:
    return {"metadata": {"name": name}, "spec": {
        "suspend": suspend, "parallelism": 2, "completions": 2, "completionMode": "Indexed",
        "template": {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                              "containers": [{"name": "trainer", "image": "x"}]}}}}


def test_writes_stamp_increasing_versions_and_names_are_unique():
    kube = LocalKube()
    first = kube.create(PODS, NS, pod("a"))
    second = kube.create(PODS, NS, pod("b"))
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert first["metadata"]["uid"] != second["metadata"]["uid"] and first["metadata"]["namespace"] == NS
    with pytest.raises(Conflict):
        kube.create(PODS, NS, pod("a"))
    with pytest.raises(NotFound):
        kube.get(PODS, NS, "c")
    generated = kube.create(EVENTS, NS, {"metadata": {"generateName": "ev-"}})
    assert generated["metadata"]["name"].startswith("ev-") and len(generated["metadata"]["name"]) > 3


def test_a_stale_resource_version_is_a_409_that_changes_nothing():
    kube = LocalKube()
    created = kube.create(NODES, None, {"metadata": {"name": "n"}})
    stale = created["metadata"]["resourceVersion"]
    kube.patch(NODES, None, "n", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(Conflict) as caught:
        kube.patch(NODES, None, "n", {"metadata": {"resourceVersion": stale, "labels": {"a": "2"}}})
    assert caught.value.status == 409
    assert kube.get(NODES, None, "n")["metadata"]["labels"] == {"a": "1"}
    fresh = kube.get(NODES, None, "n")["metadata"]["resourceVersion"]
    done = kube.patch(NODES, None, "n", {"metadata": {"resourceVersion": fresh, "labels": {"a": "2"}}})
    assert done["metadata"]["labels"] == {"a": "2"}


def test_the_product_retry_re_reads_and_writes_after_a_conflict():
    kube = LocalKube()
    kube.create(NODES, None, {"metadata": {"name": "n", "annotations": {"count": "0"}}})
    attempts = []

    def bump() -> dict:
        node = kube.get(NODES, None, "n")
        if not attempts:  # someone else writes between our read and our write, once
            kube.patch(NODES, None, "n", {"metadata": {"annotations": {"other": "x"}}})
        attempts.append(1)
        count = int(node["metadata"]["annotations"]["count"]) + 1
        return kube.patch(NODES, None, "n", {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"],
                                                          "annotations": {"count": str(count)}}})

    assert retry_on_conflict(bump)["metadata"]["annotations"] == {"count": "1", "other": "x"}
    assert len(attempts) == 2


def test_merge_patch_merges_maps_replaces_lists_and_null_deletes():
    kube = LocalKube()
    kube.create(NODES, None, {"metadata": {"name": "n", "annotations": {"keep": "1", "drop": "2"}},
                              "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}})
    new = kube.patch(NODES, None, "n", {"metadata": {"annotations": {"drop": None, "add": "3"}},
                                        "spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}})
    assert new["metadata"]["annotations"] == {"keep": "1", "add": "3"}
    assert new["spec"]["taints"] == [{"key": "b", "effect": "NoSchedule"}]
    cleared = kube.patch(NODES, None, "n", {"spec": {"taints": None}})
    assert "taints" not in cleared["spec"]


def test_strategic_merge_on_a_node_replaces_the_taints_and_is_refused_on_a_custom_resource():
    kube = LocalKube(served=(NODES, PODS, PYTORCHJOBS))
    kube.create(NODES, None, {"metadata": {"name": "n"}, "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}})
    new = kube.patch(NODES, None, "n", {"spec": {"taints": [{"key": "spotguard.io/reclaim", "value": "reclaim",
                                                             "effect": "NoSchedule"}], "unschedulable": True}},
                     content_type=STRATEGIC_MERGE_PATCH)
    assert [t["key"] for t in new["spec"]["taints"]] == ["spotguard.io/reclaim"] and new["spec"]["unschedulable"]
    with pytest.raises(ApiError) as directive:
        kube.patch(NODES, None, "n", {"spec": {"$patch": "replace"}}, content_type=STRATEGIC_MERGE_PATCH)
    assert directive.value.status == 400
    kube.create(PYTORCHJOBS, NS, {"metadata": {"name": "pt"}, "spec": {}})
    with pytest.raises(ApiError) as refused:
        kube.patch(PYTORCHJOBS, NS, "pt", {"spec": {"x": 1}}, content_type=STRATEGIC_MERGE_PATCH)
    assert refused.value.status == 415


def test_a_json_patch_applies_its_operations_or_none_of_them():
    kube = LocalKube()
    kube.create(NODES, None, {"metadata": {"name": "n"}, "spec": {}})
    added = kube.patch(NODES, None, "n", [
        {"op": "add", "path": "/metadata/annotations", "value": {"x": "1"}},
        {"op": "add", "path": "/metadata/annotations/spotguard.io~1y", "value": "2"},
        {"op": "add", "path": "/spec/taints", "value": [{"key": "a"}]},
        {"op": "add", "path": "/spec/taints/-", "value": {"key": "b"}}], content_type=JSON_PATCH)
    assert added["metadata"]["annotations"] == {"x": "1", "spotguard.io/y": "2"}
    assert [t["key"] for t in added["spec"]["taints"]] == ["a", "b"]
    with pytest.raises(ApiError) as failed:
        kube.patch(NODES, None, "n", [{"op": "remove", "path": "/metadata/annotations/x"},
                                      {"op": "test", "path": "/metadata/annotations/spotguard.io~1y", "value": "3"}],
                   content_type=JSON_PATCH)
    assert failed.value.status == 400
    assert kube.get(NODES, None, "n")["metadata"]["annotations"] == {"x": "1", "spotguard.io/y": "2"}


def test_a_resource_not_served_is_404_everywhere():
    kube = LocalKube()
    for call in (lambda: kube.list(PYTORCHJOBS, NS), lambda: kube.get(PYTORCHJOBS, NS, "x"),
                 lambda: kube.watch(PYTORCHJOBS, NS, ""), lambda: kube.create(PYTORCHJOBS, NS, {"metadata": {}})):
        with pytest.raises(NotFound):
            call()


def test_the_status_subresource_writes_only_status():
    kube = LocalKube()
    kube.create(PODS, NS, pod("a"))
    main = kube.patch(PODS, NS, "a", {"metadata": {"annotations": {"x": "1"}}, "status": {"phase": "Running"}})
    assert main["metadata"]["annotations"] == {"x": "1"} and "status" not in main
    status = kube.patch(PODS, NS, "a", {"metadata": {"annotations": {"x": "2"}}, "status": {"phase": "Running"}},
                        status=True)
    assert status["status"] == {"phase": "Running"} and status["metadata"]["annotations"] == {"x": "1"}


def test_label_and_field_selectors():
    kube = LocalKube()
    kube.create(PODS, NS, pod("a", node="n1", app="x"))
    kube.create(PODS, NS, pod("b", node="n2", app="x"))
    kube.create(PODS, "other", pod("c", node="n1", app="y"))
    names = lambda items: sorted(i["metadata"]["name"] for i in items[0])  # noqa: E731
    assert names(kube.list(PODS, None, label_selector={"app": "x"})) == ["a", "b"]
    assert names(kube.list(PODS, None, field_selector="spec.nodeName=n1")) == ["a", "c"]
    assert names(kube.list(PODS, NS, field_selector="spec.nodeName=n1")) == ["a"]
    assert names(kube.list(PODS, None, field_selector="spec.nodeName!=n1,metadata.name==b")) == ["b"]
    with pytest.raises(ApiError):
        kube.list(PODS, None, field_selector="nonsense")


def test_a_watch_replays_from_its_version_then_delivers_live_and_maps_selector_exits():
    kube = LocalKube()
    kube.create(PODS, NS, pod("a", app="x"))
    _, version = kube.list(PODS, NS)
    kube.patch(PODS, NS, "a", {"metadata": {"annotations": {"k": "1"}}})  # between the list and the watch
    stream = kube.watch(PODS, NS, version, label_selector={"app": "x"}, timeout_seconds=30)
    kube.create(PODS, NS, pod("b", app="x"))
    kube.create(PODS, NS, pod("ignored", app="y"))
    kube.patch(PODS, NS, "b", {"metadata": {"labels": {"app": "y"}}})  # leaves the selection
    kube.delete(PODS, NS, "a")
    seen = []
    for event in stream:
        seen.append((event["type"], event["object"]["metadata"]["name"]))
        if len(seen) == 4:
            stream.close()
    assert seen == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "b"), ("DELETED", "a")]


def test_a_watch_from_nothing_starts_with_the_objects_and_close_ends_it_from_another_thread():
    kube = LocalKube()
    kube.create(NODES, None, {"metadata": {"name": "n"}})
    stream = kube.watch(NODES, None, "", timeout_seconds=300)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(e["type"] for e in stream))
    reader.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    stream.close()
    reader.join(5)
    assert not reader.is_alive() and seen == ["ADDED"]


def test_a_watch_ends_at_its_timeout_and_one_too_old_gets_410():
    kube = LocalKube(history=2)
    for name in ("a", "b", "c", "d"):
        kube.create(NODES, None, {"metadata": {"name": name}})
    started = time.monotonic()
    assert list(kube.watch(NODES, None, "4", timeout_seconds=1)) == []
    assert 0.5 < time.monotonic() - started < 10
    (error,) = list(kube.watch(NODES, None, "1", timeout_seconds=30))
    assert error["type"] == "ERROR" and error["object"]["code"] == 410


def test_a_job_template_changes_only_its_directives_and_only_suspended_before_it_started():
    kube = LocalKube()
    kube.create(JOBS, NS, job())
    on_demand = {"spec": {"template": {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"}}}}}
    with pytest.raises(ApiError) as running:
        kube.patch(JOBS, NS, "train", on_demand)
    assert running.value.status == 422
    kube.patch(JOBS, NS, "train", {"status": {"startTime": "2026-01-01T00:00:00Z"}}, status=True)
    with pytest.raises(ApiError) as started:
        kube.patch(JOBS, NS, "train", {**on_demand, "spec": {**on_demand["spec"], "suspend": True}})
    assert started.value.status == 422
    kube.patch(JOBS, NS, "train", {"spec": {"suspend": True}})
    kube.patch(JOBS, NS, "train", {"status": {"startTime": None}}, status=True)
    moved = kube.patch(JOBS, NS, "train", {"spec": {"suspend": False, "template": on_demand["spec"]["template"]}})
    assert moved["spec"]["template"]["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    with pytest.raises(ApiError) as image:
        kube.patch(JOBS, NS, "train", {"spec": {"suspend": True, "template": {"spec": {"containers": []}}}})
    assert image.value.status == 422


def test_a_pod_loses_gates_and_gains_a_node_selector_only_while_gated():
    kube = LocalKube()
    gated = pod("a")
    gated["spec"]["schedulingGates"] = [{"name": "spotguard.io/capacity"}, {"name": "other"}]
    kube.create(PODS, NS, gated)
    with pytest.raises(ApiError):
        kube.patch(PODS, NS, "a", {"spec": {"schedulingGates": [{"name": "new"}]}})
    placed = kube.patch(PODS, NS, "a", {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                                                 "schedulingGates": [{"name": "other"}]}})
    assert placed["spec"]["schedulingGates"] == [{"name": "other"}]
    kube.patch(PODS, NS, "a", {"spec": {"schedulingGates": None}})
    for change in ({"nodeSelector": {"x": "y"}}, {"containers": []}, {"nodeName": "n"}):
        with pytest.raises(ApiError) as refused:
            kube.patch(PODS, NS, "a", {"spec": change})
        assert refused.value.status == 422
    assert kube.bind(NS, "a", "n")["spec"]["nodeName"] == "n"
    with pytest.raises(Conflict):
        kube.bind(NS, "a", "m")


def test_deleting_a_running_pod_marks_it_until_its_kubelet_finishes():
    kube = LocalKube()
    kube.create(PODS, NS, {**pod("a", node="n"), "spec": {**pod("a", node="n")["spec"],
                                                            "terminationGracePeriodSeconds": 7}})
    kube.delete(PODS, NS, "a")
    marked = kube.get(PODS, NS, "a")
    assert marked["metadata"]["deletionTimestamp"] and marked["metadata"]["deletionGracePeriodSeconds"] == 7
    kube.delete(PODS, NS, "a", grace_seconds=0)
    with pytest.raises(NotFound):
        kube.get(PODS, NS, "a")
    kube.create(PODS, NS, pod("pending"))
    kube.delete(PODS, NS, "pending")  # not bound: nothing runs it, it goes at once
    assert kube.list(PODS, NS)[0] == []


async def test_the_supervisors_informer_syncs_and_follows_the_local_api():
    kube = LocalKube()
    kube.create(NODES, None, {"metadata": {"name": "n0"}})
    events: list[tuple[str, object]] = []
    informer = Informer(kube, NODES, None, lambda kind, payload: events.append((kind, payload)),
                        asyncio.get_running_loop())
    informer.start()
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        kube.create(NODES, None, {"metadata": {"name": "n1"}})
        kube.patch(NODES, None, "n0", {"metadata": {"annotations": {"spotguard.io/notice": "{}"}}})
        deadline = time.monotonic() + 10
        while len(events) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await asyncio.to_thread(informer.stop)
    assert events[0][0] == "SYNC" and [n["metadata"]["name"] for n in events[0][1]] == ["n0"]
    assert [(k, p["metadata"]["name"]) for k, p in events[1:3]] == [("ADDED", "n1"), ("MODIFIED", "n0")]


def test_admission_runs_the_products_injector_on_labelled_pods():
    from spotguard.trainer.cluster.admission import inject

    kube = LocalKube()
    kube.admit(PODS, inject)
    labelled = pod("a", **{"spotguard.io/inject": "true"})
    labelled["metadata"]["annotations"] = {"spotguard.io/in-place": "true"}
    created = kube.create(PODS, NS, labelled)
    assert created["metadata"]["annotations"]["spotguard.io/injected"] == "true" and created["metadata"]["uid"]
    assert [c["name"] for c in created["spec"]["initContainers"]] == ["spotguard-sidecar"]
    env = {e["name"] for e in created["spec"]["containers"][0]["env"]}
    assert {"SPOTGUARD_SIDECAR_URL", "SPOTGUARD_IN_PLACE", "SPOTGUARD_READY_FILE"} <= env
    assert "initContainers" not in kube.create(PODS, NS, pod("b"))["spec"]  # not labelled: untouched
    bad = pod("c", **{"spotguard.io/inject": "true"})
    bad["metadata"]["annotations"] = {"spotguard.io/grace-seconds": "forever"}
    with pytest.raises(ApiError) as refused:
        kube.create(PODS, NS, bad)
    assert refused.value.status == 400 and "grace-seconds" in str(refused.value)
    assert [p["metadata"]["name"] for p in kube.list(PODS, NS)[0]] == ["a", "b"]
