"""What the injector does to a pod: a pure function from a Pod object to a JSON patch.

A pod labelled `spotguard.io/inject: "true"` gets:
- the sidecar as a native sidecar (an init container with `restartPolicy: Always`, Kubernetes
  >= 1.29), listening on the pod's loopback, with the downward-API volume it reads membership
  from and a projected service-account token (audience `spotguard`) to report to the agent;
- in every regular container: the environment the Guard reads, the shared token volume
  (read-only), and a preStop hook (`spotguard sidecar prestop`) that holds termination until the
  checkpoint is durable (it returns at once when no notice is live);
- with annotations `spotguard.io/hostfile` (and `spotguard.io/deepspeed-config`): the sidecar is
  told to rewrite that DeepSpeed hostfile, and gets the app container's volume holding it;
- the Guard's notice horizon (`SPOTGUARD_HORIZON_SECONDS`) where an app container sets it: the
  sidecar gets the same entry, so both hold a notice due further ahead alike, as the supervisor
  does (`spotguard.wire.injection.horizon_entry`: set differently, through valueFrom or not
  seconds > 0, the pod is refused naming the variable);
- admissible wherever the pod was: the sidecar satisfies Pod Security `restricted` (non-root,
  no privilege escalation, no capabilities, RuntimeDefault seccomp), runs as the app
  containers' user where the pod sets one, and has cpu/memory requests AND limits (quotas on
  limits.* refuse containers without them);
- `terminationGracePeriodSeconds` raised to cover the save (annotation
  `spotguard.io/grace-seconds`, default 120), never lowered;
- with annotation `spotguard.io/in-place: "true"` (jobs that change membership in place): the
  in-place environment, a writable ready-file volume and a readiness probe on it (in_place.py);
- annotation `spotguard.io/injected: "true"`.
A pod without the label, or already injected, gets an empty patch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spotguard.injector import in_place
from spotguard.wire import names
from spotguard.wire.injection import SIDECAR_NAME, horizon_entry, wants_injection

SHARED_VOLUME = "spotguard-run"
PODINFO_VOLUME = "spotguard-podinfo"
TOKEN_VOLUME = "spotguard-agent-token"
SHARED_DIR = "/var/run/spotguard"
PODINFO_DIR = "/etc/podinfo"
TOKEN_DIR = "/var/run/secrets/spotguard"
DEFAULT_GRACE = 120
MAX_GRACE = 3600
SIDECAR_IMAGE_USER = 65532  # the image's USER (daemonset/Dockerfile)


class PodSpecError(ValueError):
    """The pod cannot be injected; the message names the field."""


@dataclass(frozen=True)
class InjectorConfig:
    image: str
    grace_seconds: int = DEFAULT_GRACE
    agent_port: int = names.AGENT_PORT
    sidecar_port: int = names.SIDECAR_PORT
    cpu_request: str = "10m"
    cpu_limit: str = "200m"
    memory_request: str = "32Mi"
    memory_limit: str = "96Mi"


def _escape(name: str) -> str:
    """JSON-pointer escaping of one path segment (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _mount_for(pod: dict[str, Any], path: str, field: str) -> dict[str, Any]:
    """The app containers' volume mount that holds `path` (longest mountPath prefix)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise PodSpecError(f"metadata.annotations[{field}]: expected an absolute path, got {path!r}")
    best = None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for mount in (container or {}).get("volumeMounts") or []:
            root = str(mount.get("mountPath", "")).rstrip("/")
            if path.startswith(root + "/") and (best is None or len(root) > len(best["mountPath"].rstrip("/"))):
                best = mount
    if best is None:
        raise PodSpecError(f"metadata.annotations[{field}]: no container volume holds {path}")
    return {"name": best["name"], "mountPath": best["mountPath"]}


def hostfile_wiring(pod: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """Extra sidecar args and volume mounts for the DeepSpeed hostfile annotations."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    args, mounts = [], []
    for annotation, flag in ((names.ANN_HOSTFILE, "--hostfile"), (names.ANN_DEEPSPEED_CONFIG, "--deepspeed-config")):
        path = annotations.get(annotation)
        if path is None:
            continue
        mount = _mount_for(pod, path, annotation)
        args.append(f"{flag}={path}")
        if mount not in mounts:
            mounts.append(mount)
    if names.ANN_DEEPSPEED_CONFIG in annotations and names.ANN_HOSTFILE not in annotations:
        raise PodSpecError(f"metadata.annotations[{names.ANN_DEEPSPEED_CONFIG}]: needs {names.ANN_HOSTFILE} too")
    return args, mounts


def shared_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings the sidecar reads alike with the Guard (the notice horizon), as the app
    containers set them (`horizon_entry`, the supervisor's reading too); PodSpecError names a bad one."""
    try:
        _, entry = horizon_entry(pod.get("spec") or {})
    except ValueError as exc:
        raise PodSpecError(str(exc)) from None
    return [] if entry is None else [entry]


def local_world_size(pod: dict[str, Any]) -> int:
    """Ranks in this pod, for preStop: annotation `spotguard.io/local-world-size`, else the GPUs
    the pod's containers request (at least 1)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(names.ANN_LOCAL_WORLD_SIZE)
    if raw is not None:
        if not str(raw).isdigit() or int(raw) < 1:
            raise PodSpecError(
                f"metadata.annotations[{names.ANN_LOCAL_WORLD_SIZE}]: expected a whole number >= 1, got {raw!r}")
        return int(raw)
    gpus = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = ((container or {}).get("resources") or {}).get("limits") or {}
        try:
            gpus += int(str(limits.get("nvidia.com/gpu", 0)))
        except ValueError:
            raise PodSpecError("spec.containers[].resources.limits[nvidia.com/gpu]: not a whole number") from None
    return max(1, gpus)


def app_identity(pod: dict[str, Any]) -> dict[str, int]:
    """The runAsUser/runAsGroup the pod's app containers run as, where the pod sets them: the
    first regular container's own setting, else the pod's. Absent keys: the image decides."""
    spec = pod.get("spec") or {}
    pod_ctx = spec.get("securityContext") or {}
    out: dict[str, int] = {}
    for key in ("runAsUser", "runAsGroup"):
        values = [((c or {}).get("securityContext") or {}).get(key) for c in spec.get("containers") or []]
        value = next((v for v in values if v is not None), pod_ctx.get(key))
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PodSpecError(f"spec.securityContext.{key}: expected a whole number >= 0, got {value!r}")
            out[key] = value
    return out


def sidecar_security_context(identity: dict[str, int]) -> dict[str, Any]:
    """Pod Security `restricted` for the sidecar, as the app's user: the hooks token it writes
    with mode 0600 must be readable by the trainer containers. An app running as root (only
    admissible outside `restricted`) reads it anyway; the sidecar then keeps its image's user."""
    ctx: dict[str, Any] = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    ctx["runAsUser"] = identity.get("runAsUser") or SIDECAR_IMAGE_USER
    if "runAsGroup" in identity:
        ctx["runAsGroup"] = identity["runAsGroup"]
    return ctx


def sidecar_container(cfg: InjectorConfig, extra_args: Sequence[str] = (), extra_mounts: Sequence[dict] = (),
                      local_world_size: int = 1, identity: dict[str, int] | None = None,
                      extra_env: Sequence[dict] = ()) -> dict[str, Any]:
    return {
        "name": SIDECAR_NAME,
        "image": cfg.image,
        "restartPolicy": "Always",
        "args": ["sidecar", f"--listen=127.0.0.1:{cfg.sidecar_port}",
                 f"--token-file={SHARED_DIR}/token", f"--podinfo-dir={PODINFO_DIR}",
                 f"--agent-token-file={TOKEN_DIR}/token", *extra_args],
        "env": [
            {"name": names.ENV_NODE_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": names.ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": names.ENV_LOCAL_WORLD_SIZE, "value": str(local_world_size)},
            *extra_env,
        ],
        "resources": {"requests": {"cpu": cfg.cpu_request, "memory": cfg.memory_request},
                      "limits": {"cpu": cfg.cpu_limit, "memory": cfg.memory_limit}},
        "securityContext": sidecar_security_context(identity or {}),
        "volumeMounts": [{"name": SHARED_VOLUME, "mountPath": SHARED_DIR},
                         {"name": PODINFO_VOLUME, "mountPath": PODINFO_DIR, "readOnly": True},
                         {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
                         *extra_mounts],
    }


def volumes() -> list[dict[str, Any]]:
    return [
        {"name": SHARED_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": PODINFO_VOLUME, "downwardAPI": {"items": [
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": "spotguard", "expirationSeconds": 3600, "path": "token"}}]}},
    ]


def guard_env(cfg: InjectorConfig, grace: int) -> list[dict[str, Any]]:
    return [
        {"name": names.ENV_SIDECAR_URL, "value": f"http://127.0.0.1:{cfg.sidecar_port}"},
        {"name": names.ENV_TOKEN_FILE, "value": f"{SHARED_DIR}/token"},
        {"name": names.ENV_GRACE_SECONDS, "value": str(grace)},
    ]


def grace_for(pod: dict[str, Any], cfg: InjectorConfig) -> int:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(names.ANN_GRACE_SECONDS)
    if raw is None:
        return cfg.grace_seconds
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise PodSpecError(
            f"metadata.annotations[{names.ANN_GRACE_SECONDS}]: expected whole seconds, got {raw!r}") from None
    if not 1 <= value <= MAX_GRACE:
        raise PodSpecError(
            f"metadata.annotations[{names.ANN_GRACE_SECONDS}]: must be within 1..{MAX_GRACE}, got {value}")
    return value


def build_patch(pod: dict[str, Any], cfg: InjectorConfig) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that injects spotguard into `pod`; [] when not wanted."""
    if not isinstance(pod, dict):
        raise PodSpecError("object: expected a Pod object")
    if not wants_injection(pod):
        return []
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list) or not spec["containers"]:
        raise PodSpecError("spec.containers: a pod needs at least one container")
    grace = grace_for(pod, cfg)
    try:
        in_place_pod = in_place.wants_in_place(pod)
    except ValueError as exc:
        raise PodSpecError(str(exc)) from None
    sidecar = sidecar_container(cfg, *hostfile_wiring(pod), local_world_size=local_world_size(pod),
                                identity=app_identity(pod), extra_env=shared_env(pod))
    ops: list[dict[str, Any]] = []

    if spec.get("initContainers"):
        ops.append({"op": "add", "path": "/spec/initContainers/-", "value": sidecar})
    else:
        ops.append({"op": "add", "path": "/spec/initContainers", "value": [sidecar]})

    new_volumes = volumes() + ([in_place.ready_volume()] if in_place_pod else [])
    if spec.get("volumes"):
        ops += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in new_volumes]
    else:
        ops.append({"op": "add", "path": "/spec/volumes", "value": new_volumes})

    prestop = {"exec": {"command": ["spotguard", "sidecar", "prestop",
                                    f"--url=http://127.0.0.1:{cfg.sidecar_port}", f"--timeout={grace}"]}}
    for i, container in enumerate(spec["containers"]):
        if not isinstance(container, dict):
            raise PodSpecError(f"spec.containers[{i}]: expected an object")
        base = f"/spec/containers/{i}"
        env = guard_env(cfg, grace) + (in_place.container_env(pod, container) if in_place_pod else [])
        if container.get("env"):
            ops += [{"op": "add", "path": f"{base}/env/-", "value": e} for e in env]
        else:
            ops.append({"op": "add", "path": f"{base}/env", "value": env})
        mounts = [{"name": SHARED_VOLUME, "mountPath": SHARED_DIR, "readOnly": True},
                  *([in_place.ready_mount()] if in_place_pod else [])]
        if container.get("volumeMounts"):
            ops += [{"op": "add", "path": f"{base}/volumeMounts/-", "value": m} for m in mounts]
        else:
            ops.append({"op": "add", "path": f"{base}/volumeMounts", "value": mounts})
        if in_place_pod and not container.get("readinessProbe"):
            ops.append({"op": "add", "path": f"{base}/readinessProbe", "value": in_place.readiness_probe()})
        lifecycle = container.get("lifecycle")
        if not lifecycle:
            ops.append({"op": "add", "path": f"{base}/lifecycle", "value": {"preStop": prestop}})
        elif "preStop" not in lifecycle:
            ops.append({"op": "add", "path": f"{base}/lifecycle/preStop", "value": prestop})

    current = spec.get("terminationGracePeriodSeconds")
    if not isinstance(current, int) or current < grace:
        ops.append({"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": grace})

    annotations = (pod.get("metadata") or {}).get("annotations")
    if annotations:
        ops.append({"op": "add", "path": f"/metadata/annotations/{_escape(names.ANN_INJECTED)}", "value": "true"})
    else:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {names.ANN_INJECTED: "true"}})
    return ops
