"""What the cluster does when a node's instance is gone (a reclaim at its deadline, the cloud
replacing the VM): the cloud's node lifecycle controller deletes the Node, and the pod garbage
collector fails every pod still bound to it that had not finished, with the condition
`DisruptionTarget=True` (reason `DeletionByPodGC`). The Job controller's `podFailurePolicy`
Ignore rule on that condition then replaces them without counting a failure
(daemonset/examples/in-place-indexed-job.yaml). The failed pods are kept (the Job controller's
tracking finalizer keeps a real one visible until it was counted).
"""
from __future__ import annotations

from spotguard.kube.api import NODES, PODS, NotFound
from spotguard.trainer.cluster.job_pods import terminal
from spotguard.trainer.cluster.kube import LocalKube, rfc3339


def node_gone(kube: LocalKube, node: str) -> list[str]:
    """See the module docstring; the names of the pods it failed."""
    try:
        kube.delete(NODES, None, node)
    except NotFound:
        pass
    pods, _ = kube.list(PODS, None, field_selector=f"spec.nodeName={node}")
    failed = []
    for pod in pods:
        if terminal(pod):
            continue
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "Ready"]
        conditions += [{"type": "Ready", "status": "False", "lastTransitionTime": rfc3339()},
                       {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
                        "message": f"PodGC: node {node} no longer exists", "lastTransitionTime": rfc3339()}]
        try:
            kube.patch(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"],
                       {"status": {"phase": "Failed", "reason": "NodeLost", "conditions": conditions}}, status=True)
        except NotFound:
            continue
        failed.append(pod["metadata"]["name"])
    return failed
