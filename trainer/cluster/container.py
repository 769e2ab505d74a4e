"""How the local kubelet turns a pod's container spec into a local process. Pure.

- `Volumes(pod, pod_dir, claims_dir)`: where each of the container's mounts lives on this host:
  an `emptyDir` under the pod's directory, a `persistentVolumeClaim` under `claims_dir/<claim>`
  (shared by every pod, as an RWX volume is), a `downwardAPI` volume at the pod's podinfo
  directory. `host_path(text)` rewrites every container path inside `text` (a mount path at the
  start of a path: after the start, `=`, `:` or a space) to its host path;
- `container_env(pod, container, volumes, extra)`: the container's variables as the kubelet sets
  them: `value` (with `$(NAME)` replaced by a variable defined before it, `$$` an escaped `$`),
  `valueFrom.fieldRef` (`metadata.name|namespace|uid`, `metadata.labels['k']`,
  `metadata.annotations['k']`, `spec.nodeName`, `spec.serviceAccountName`, `status.podIP`,
  `status.hostIP`), over `extra` (the sidecar's and the node's part), container paths mapped;
- `argv(container, env, volumes)`: command + args with `$(NAME)` expanded from `env`, paths mapped,
  and the image's commands (`IMAGE_COMMANDS`: `spotguard`, `python`, `torchrun`) run by this
  checkout's interpreter, which stands in for the training image;
- `ready_file(container, volumes)`: the file an exec readiness probe `test -f FILE` checks
  (the injector's probe), mapped; None when the container has no such probe (it is Ready once
  Running). Other probes are not run (ValueError names them).
"""
from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IMAGE_COMMANDS = {"spotguard": [sys.executable, "-m", "spotguard"], "python": [sys.executable],
                  "python3": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(NAME)` expansion: defined names are replaced, `$$` is `$`, others stay."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return _VAR.sub(one, text)


class Volumes:
    """See the module docstring."""

    def __init__(self, pod: Mapping[str, Any], container: Mapping[str, Any], pod_dir: Path, claims_dir: Path):
        sources = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
        self.mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            source = sources.get(mount.get("name")) or {}
            if "persistentVolumeClaim" in source:
                where = claims_dir / source["persistentVolumeClaim"].get("claimName", mount["name"])
            elif "downwardAPI" in source:
                where = pod_dir / "podinfo"
            else:
                where = pod_dir / "volumes" / str(mount.get("name"))
            self.mounts[str(mount["mountPath"]).rstrip("/")] = where
        self._pattern = re.compile(
            r"(?:(?<=^)|(?<=[=: ]))(" + "|".join(re.escape(m) for m in sorted(self.mounts, key=len, reverse=True))
            + r")(?=/|$|[ :,])") if self.mounts else None

    def host_path(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: str(self.mounts[m.group(1)]), text)

    def create(self) -> None:
        for path in self.mounts.values():
            path.mkdir(parents=True, exist_ok=True)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's value of `path` for `pod` ("" when the pod has none yet)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    subscript = _SUBSCRIPT.match(path)
    if subscript:
        return str((meta.get(subscript.group(1)) or {}).get(subscript.group(2), ""))
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
              "status.hostIP": status.get("hostIP")}
    if path not in simple:
        raise ValueError(f"fieldRef {path!r} is not served by the local kubelet")
    return str(simple[path] or "")


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Volumes,
                  extra: Mapping[str, str]) -> dict[str, str]:
    """See the module docstring."""
    env = dict(extra)
    defined: dict[str, str] = {}
    for item in container.get("env") or []:
        name = str(item["name"])
        if "valueFrom" in item:
            ref = (item["valueFrom"] or {}).get("fieldRef")
            if ref is None:
                raise ValueError(f"env {name}: only fieldRef is served by the local kubelet")
            value = field_ref(pod, str(ref.get("fieldPath", "")))
        else:
            value = expand(str(item.get("value", "")), defined)
        defined[name] = env[name] = volumes.host_path(value)
    return env


def argv(container: Mapping[str, Any], env: Mapping[str, str], volumes: Volumes) -> list[str]:
    """See the module docstring; ValueError when the container names no command."""
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    if not words:
        raise ValueError(f"container {container.get('name')!r}: no command (the local kubelet has no image "
                         "entrypoint)")
    expanded = [volumes.host_path(expand(str(w), env)) for w in words]
    return [*IMAGE_COMMANDS.get(expanded[0], expanded[:1]), *expanded[1:]]


def ready_file(container: Mapping[str, Any], volumes: Volumes) -> Path | None:
    """See the module docstring."""
    probe = container.get("readinessProbe")
    if not probe:
        return None
    command = list(((probe.get("exec") or {}).get("command")) or [])
    if len(command) != 3 or command[:2] != ["test", "-f"]:
        raise ValueError(f"container {container.get('name')!r}: the local kubelet runs only `test -f FILE` "
                         f"readiness probes, not {probe!r}")
    return Path(volumes.host_path(command[2]))
