"""What the injector adds to a pod of a job that changes membership in place (pod annotation
`spotguard.io/in-place: "true"`, set in the Job's / PyTorchJob's pod template). Pure.

Every regular container gets, unless it sets the variable itself:
- `SPOTGUARD_IN_PLACE=1`. No `SPOTGUARD_JOIN`: whether a worker joins follows the join rule
  (docs/protocols.md: it joins when the membership it reads names a store and hosts but not its
  own; the supervisor pushes the membership to a new replica pod as soon as it exists);
- `SPOTGUARD_RDZV_PORT`: the pod's port (the first container's literal value, else
  `names.RDZV_PORT`; the supervisor reads the same value for the membership's `store`);
  `SPOTGUARD_RDZV_HOST` = `status.podIP` and `SPOTGUARD_NODE` = `spec.nodeName` (downward API);
- `SPOTGUARD_DEEPSPEED_CONFIG` = the `spotguard.io/deepspeed-config` annotation's path, when the
  pod has it: the Guard re-forms by the same elasticity rule the sidecar trims the hostfile by
  (`hooks/hostfile.group_after`);
- `SPOTGUARD_READY_FILE` in a small writable in-memory volume of its own (`READY_DIR`; the
  sidecar's shared volume stays read-only for the app), and a `readinessProbe`
  `test -f <ready file>` when it has none. The trainer creates the file once it trains or, as a
  joiner, once it is ready to join; the supervisor adds a new pod to the membership only once it
  is Ready. An emptyDir and an exec probe keep Pod Security `restricted`.
"""
from __future__ import annotations

from typing import Any

from spotguard.wire import names

READY_VOLUME = "spotguard-ready"
READY_DIR = "/var/run/spotguard-ready"
READY_FILE = f"{READY_DIR}/ready"


def wants_in_place(pod: dict[str, Any]) -> bool:
    """The pod's `spotguard.io/in-place` annotation is "true"; ValueError for a value other
    than true/false."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_IN_PLACE)
    value = str(raw if raw is not None else "").strip().lower()
    if value not in ("true", "false", ""):
        raise ValueError(f"metadata.annotations[{names.ANN_IN_PLACE}]: expected \"true\" or \"false\", got {raw!r}")
    return value == "true"


def pod_rdzv_port(pod: dict[str, Any]) -> str:
    """The pod's rendezvous port: the first container's literal SPOTGUARD_RDZV_PORT, else the default."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for env in (container or {}).get("env") or []:
            if env.get("name") == names.ENV_RDZV_PORT and env.get("value"):
                return str(env["value"])
    return str(names.RDZV_PORT)


def _field(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def container_env(pod: dict[str, Any], container: dict[str, Any]) -> list[dict[str, Any]]:
    """The in-place variables `container` does not set itself."""
    wanted: list[dict[str, Any]] = [
        {"name": names.ENV_IN_PLACE, "value": "1"},
        {"name": names.ENV_RDZV_PORT, "value": pod_rdzv_port(pod)},
        {"name": names.ENV_RDZV_HOST, "valueFrom": _field("status.podIP")},
        {"name": names.ENV_NODE, "valueFrom": _field("spec.nodeName")},
        {"name": names.ENV_READY_FILE, "value": READY_FILE},
    ]
    config = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_DEEPSPEED_CONFIG)
    if config:
        wanted.append({"name": names.ENV_DEEPSPEED_CONFIG, "value": str(config)})
    have = {e.get("name") for e in container.get("env") or []}
    return [e for e in wanted if e["name"] not in have]


def ready_mount() -> dict[str, Any]:
    return {"name": READY_VOLUME, "mountPath": READY_DIR}


def ready_volume() -> dict[str, Any]:
    return {"name": READY_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}


def readiness_probe() -> dict[str, Any]:
    return {"exec": {"command": ["test", "-f", READY_FILE]}, "periodSeconds": 2, "failureThreshold": 1}
