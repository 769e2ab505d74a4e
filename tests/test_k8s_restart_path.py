"""The restart path's Job as users deploy it (daemonset/examples/torchrun-indexed-job.yaml) on a
real kube-apiserver, Job controller and scheduler, scaled down by the supervisor (as its own
ServiceAccount) on a reclaim notice: when a remaining replica then exits 0 (torchrun: the
training finished), the Job is complete at once and no pod is made for the index the scale-down
left out. Without the manifest's `successPolicy` the Job controller would make that index's pod,
and its torchrun (`--nnodes=2:4`) would train again from the last checkpoint (the dry-run's
`spotguard-restart` mode did: tests/test_goodput.py)."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import yaml

from spotguard.trainer.cluster.job_pods import INDEX_KEY
from tests.k8s_world import refusals, set_container_exit, wait_until
from tests.test_k8s_supervisor import POOL, World, _controller, _mark

pytestmark = pytest.mark.k8s
EXAMPLE = Path(__file__).resolve().parents[1] / "daemonset" / "examples" / "torchrun-indexed-job.yaml"


def _example_job(pool: str) -> dict:
    """The example's Job, on this test's nodes: its node selector is the test's pool, no volume
    (no storage here), a grace period of 0 (no kubelet ends a deleted pod), quantities as strings
    (the client's models want them so)."""
    job = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d["kind"] == "Job")
    job["metadata"]["name"] = "train"
    pod = job["spec"]["template"]["spec"]
    pod.update(nodeSelector={POOL: pool}, terminationGracePeriodSeconds=0)
    pod.pop("volumes")
    container = pod["containers"][0]
    container.pop("volumeMounts")
    container["resources"]["limits"] = {k: str(v) for k, v in container["resources"]["limits"].items()}
    return job


def _pods(world: World) -> list:
    return world.core.list_namespaced_pod(world.ns, label_selector="job-name=train").items


def _condition_reasons(world: World) -> dict:
    return {c["type"]: c["reason"] for c in world.job()["status"].get("conditions") or [] if c["status"] == "True"}


async def test_a_scaled_down_torchrun_job_completes_when_its_training_finishes(control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    world = World(control_plane, k8s_namespace)
    for _ in range(4):
        await asyncio.to_thread(world.add_node)
    job = _example_job(k8s_namespace)
    assert job["spec"]["completions"] == 4 and job["spec"]["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    await asyncio.to_thread(world.batch.create_namespaced_job, k8s_namespace, job)
    await asyncio.to_thread(world.running_on, 4)
    controller = _controller(control_plane, k8s_namespace)
    await controller.start()
    try:
        await _mark(control_plane, world.nodes[0])
        await asyncio.to_thread(wait_until, lambda: world.job_is(3, False, "Running"), 30, "scaled 4 -> 3")
        survivors = await asyncio.to_thread(world.running_on, 3)  # the Job controller removed one
        left_out = {"0", "1", "2", "3"} - {p.metadata.annotations[INDEX_KEY] for p in survivors}
        assert len(left_out) == 1
        made = {p.metadata.name for p in await asyncio.to_thread(_pods, world)}

        await asyncio.to_thread(set_container_exit, control_plane, k8s_namespace, survivors[0].metadata.name, 0)

        def settled():
            reasons = _condition_reasons(world)
            new = [p.metadata.name for p in _pods(world) if p.metadata.name not in made]
            return (reasons, new) if "Complete" in reasons or new else None
        reasons, new = await asyncio.to_thread(wait_until, settled, 30, "the Job complete, or a new pod")
        assert new == [], f"a pod for index {left_out} after the training finished: {new}"
        assert reasons == {"SuccessCriteriaMet": "SuccessPolicy", "Complete": "SuccessPolicy"}
        # The other replicas are ended (a real torchrun group finishes together) and nothing new is made.
        await asyncio.to_thread(wait_until, lambda: not world.pods(), 30, "the lingering pods ended")
        assert {p.metadata.name for p in await asyncio.to_thread(_pods, world)} <= made
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)
