"""The Job the dry-run submits to its local cluster: what daemonset/examples/ tells users to
deploy, so that a passing scenario proves what those manifests do.

- in place (elastic DDP/FSDP2): in-place-indexed-job.yaml: an Indexed Job, `spotguard launch
  --nnodes=W --node-rank=$(JOB_COMPLETION_INDEX)`, `restartPolicy: Never`, `podFailurePolicy`
  Ignore on exit 83 and on DisruptionTarget, annotations `policy: elastic`, `in-place`, min/max,
  the template labelled for the injector with `spotguard.io/in-place` (the local API's admission
  runs the product's injector on every pod: trainer/cluster/admission.py); start at min:
  `--nnodes=MIN:REPLICAS` and `spotguard.io/start-at-min`;
- backfill (in place with `spotguard.io/fallback: on-demand`): the template admits spot and
  on-demand (required node affinity on `karpenter.sh/capacity-type`) and carries the gate
  `spotguard.io/capacity`; one replica more than max (the spare), start at min (placement.py);
- the restart path (DeepSpeed, the Trainer / Lightning integrations, `--membership restart`, the
  fixed policy): torchrun-indexed-job.yaml: torchrun with c10d rendezvous `--nnodes=MIN:MAX`
  (fixed: W:W), `--max-restarts=0` (a worker that drains ends its pod; the Job controller makes
  a new one, and a scale-out is torchrun's own restart of its workers), and `successPolicy`
  `succeededCount: 1`: torchrun exits 0 only once its workers finished the training, so one
  index that succeeded completes the Job. Without it an Indexed Job needs every index in
  [0, completions) to succeed: after the supervisor scaled it down (parallelism, not
  completions), an index that never ran would get its pod once the training finished, and
  torchrun (`--nnodes=MIN:MAX`) would train again from the last checkpoint.
Every pod mounts the claim `train-checkpoints` at /ckpt (the checkpoints outlive the pods) and
asks for one `nvidia.com/gpu`. What differs from the examples, because the pods share this host:
`--master-addr` is 127.0.0.1 (no cluster DNS), each completion index gets a rendezvous port of its
own (`RendezvousPorts`, run at pod admission: a cluster gives each pod its own IP), and the
image's CPU settings (`DS_ACCELERATOR=cpu`, `OMP_NUM_THREADS=1`) are in the template.
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field

from spotguard.processes import free_port
from spotguard.supervisor.placement import GATE
from spotguard.trainer.cluster.job_pods import index_of
from spotguard.trainer.scenario import Scenario
from spotguard.wire import names

JOB = "train"
NAMESPACE = "default"
CLAIM = "train-checkpoints"
CHECKPOINTS = "/ckpt"
CAPACITY_LABEL = "karpenter.sh/capacity-type"
GRACE_SECONDS = 30
DRAIN_CODE = names.EXIT_PREEMPTED


@dataclass(frozen=True)
class Backfill:
    """The backfill's settings (seconds), or None on a job without it."""

    fallback_after: float
    return_after: float
    on_demand_max: int | None = None


class RendezvousPorts:
    """One free port per completion index, written into each pod's `SPOTGUARD_RDZV_PORT` when it
    is created (`admit`, the local API's admission hook for pods)."""

    def __init__(self) -> None:
        self._ports: dict[int, int] = {}

    def port(self, index: int) -> int:
        if index not in self._ports:
            self._ports[index] = free_port()
        return self._ports[index]

    def admit(self, pod: dict) -> None:
        index = index_of(pod)
        if index < 0:
            return
        for container in (pod.get("spec") or {}).get("containers") or []:
            env = [e for e in container.get("env") or [] if e.get("name") != names.ENV_RDZV_PORT]
            container["env"] = [{"name": names.ENV_RDZV_PORT, "value": str(self.port(index))}, *env]


@dataclass
class JobShape:
    """What the manifest depends on besides the scenario."""

    train_argv: list[str]
    ports: RendezvousPorts = field(default_factory=RendezvousPorts)
    backfill: Backfill | None = None
    c10d_port: int = field(default_factory=free_port)
    inject: bool = True  # labelled for the injector (False: a cluster without spotguard's pods)
    reform_timeout: float = 10.0  # seconds: `spotguard launch --reform-timeout` (in place)


def replicas(scenario: Scenario, backfill: Backfill | None) -> int:
    """The Job's completions = parallelism: the workers, plus the spare of a backfill job."""
    return scenario.workers + (1 if backfill is not None else 0)


def _annotations(scenario: Scenario, backfill: Backfill | None) -> dict[str, str]:
    out = {names.ANN_POLICY: scenario.policy, names.ANN_MAX_REPLICAS: str(scenario.workers),
           names.ANN_MIN_REPLICAS: str(scenario.min_workers if scenario.policy == "elastic" else scenario.workers)}
    if scenario.in_place:
        out[names.ANN_IN_PLACE] = "true"
    if scenario.in_place and (scenario.start_at_min or backfill is not None):
        out[names.ANN_START_AT_MIN] = "true"
    if backfill is not None:
        out.update({names.ANN_FALLBACK: "on-demand", names.ANN_FALLBACK_AFTER: f"{backfill.fallback_after:g}s",
                    names.ANN_RETURN_AFTER: f"{backfill.return_after:g}s"})
        if backfill.on_demand_max is not None:
            out[names.ANN_ON_DEMAND_MAX] = str(backfill.on_demand_max)
    return out


def _command(scenario: Scenario, shape: JobShape) -> list[str]:
    count = replicas(scenario, shape.backfill)
    if scenario.in_place:
        at_min = scenario.start_at_min or shape.backfill is not None
        nnodes = f"{scenario.min_workers}:{count}" if at_min else str(count)
        return ["spotguard", "launch", f"--nnodes={nnodes}",
                "--node-rank=$(JOB_COMPLETION_INDEX)", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                f"--master-port={shape.ports.port(0)}", f"--reform-timeout={shape.reform_timeout:g}",
                f"--min-world-size={scenario.min_workers}", "--same-session", *shape.train_argv]
    least = scenario.min_workers if scenario.policy == "elastic" else scenario.workers
    return ["torchrun", f"--nnodes={least}:{scenario.workers}",
            "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{shape.c10d_port}",
            f"--rdzv-id={JOB}", "--max-restarts=0", "--rdzv-conf=last_call_timeout=1", "--monitor-interval=0.1",
            *shape.train_argv]


def _placement(backfill: Backfill | None) -> dict:
    if backfill is None:
        return {"nodeSelector": {CAPACITY_LABEL: "spot"}}
    either = {"key": CAPACITY_LABEL, "operator": "In", "values": ["spot", "on-demand"]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [either]}]}}}, "schedulingGates": [{"name": GATE}]}


def _pod_template(scenario: Scenario, shape: JobShape) -> dict:
    command = _command(scenario, shape)
    container: dict = {"name": "trainer", "image": "spotguard (this checkout)", "command": command[:2],
                       "args": command[2:],
                       "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
                               {"name": "TORCHELASTIC_SHUTDOWN_TIMEOUT", "value": "60"},
                               {"name": "DS_ACCELERATOR", "value": "cpu"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
                       "resources": {"limits": {"nvidia.com/gpu": 1}},
                       "volumeMounts": [{"name": "ckpt", "mountPath": CHECKPOINTS}]}
    template = {"metadata": {"labels": {names.LABEL_INJECT: "true"} if shape.inject else {},
                             "annotations": {names.ANN_GRACE_SECONDS: str(GRACE_SECONDS)}},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_SECONDS,
                         **_placement(shape.backfill), "containers": [container],
                         "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": CLAIM}}]}}
    if os.environ.get(names.ENV_HORIZON_SECONDS):  # the ranks inherit it (bench/goodput.py --horizon): the
        # template says it too, so the supervisor and the sidecar read notices with the Guard's horizon
        container["env"].append({"name": names.ENV_HORIZON_SECONDS, "value": os.environ[names.ENV_HORIZON_SECONDS]})
    if scenario.in_place:  # the injector adds the in-place environment, the ready file and its probe
        template["metadata"]["annotations"][names.ANN_IN_PLACE] = "true"
    else:  # the ranks' node, as memberships and notices name it (the injector adds it in place)
        container["env"].append({"name": names.ENV_NODE, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    return template


def job_manifest(scenario: Scenario, shape: JobShape) -> dict:
    """The Job (see the module docstring)."""
    count = replicas(scenario, shape.backfill)
    done_when = {} if scenario.in_place else {"successPolicy": {"rules": [{"succeededCount": 1}]}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": JOB, "namespace": NAMESPACE, "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": _annotations(scenario, shape.backfill)},
            "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                     "backoffLimitPerIndex": 100, "maxFailedIndexes": count,
                     "podFailurePolicy": {"rules": [
                         {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                              "values": [DRAIN_CODE]}},
                         {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
                     **done_when, "template": _pod_template(scenario, shape)}}
