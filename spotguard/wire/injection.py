"""Whether a pod asked for the spotguard sidecar and whether it has it: one answer for the
injector, which adds the sidecar at admission (injector/patch.py), and for the supervisor, which
warns about a pod admitted without it while the injector was not ready (the webhook's
failurePolicy is Ignore: supervisor/sidecar_watch.py). And the job's notice horizon as its pod
spec sets it for the Guard: one reading for the injector, which hands it to the sidecar, and for
the supervisor, which reads the job's notices with it (`horizon_entry`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from spotguard.wire import names
from spotguard.wire.notice_policy import HORIZON_SECONDS

SIDECAR_NAME = "spotguard-sidecar"
# The namespaces the webhook's namespaceSelector leaves out (daemonset/base/injector/webhook.yaml):
# a labelled pod there is never injected, by design.
UNINJECTED_NAMESPACES = ("kube-system", "spotguard")


def wants_injection(pod: Mapping[str, Any]) -> bool:
    """The pod is labelled `spotguard.io/inject: "true"` and has no sidecar yet (neither the
    `spotguard.io/injected` annotation nor an init container named SIDECAR_NAME)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    if labels.get(names.LABEL_INJECT) != "true" or annotations.get(names.ANN_INJECTED) == "true":
        return False
    spec = pod.get("spec") or {}
    return not any(c.get("name") == SIDECAR_NAME for c in (spec.get("initContainers") or []))


HORIZON_FIELD = f"spec.containers[].env[{names.ENV_HORIZON_SECONDS}]"


def horizon_entry(pod_spec: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(horizon seconds, its env entry) as the app containers of one pod spec set
    `SPOTGUARD_HORIZON_SECONDS` for the Guard; (HORIZON_SECONDS, None) when none sets it (an
    empty value is unset, as the Guard reads it; a container that sets none, such as a logger, is
    not read). ValueError naming HORIZON_FIELD when two containers set it differently, when it
    is set through `valueFrom` (the supervisor reads the job's template, not the pod's ConfigMaps
    or Secrets), or when its value is not seconds > 0."""
    found: dict[str, Any] | None = None
    for container in pod_spec.get("containers") or []:
        for entry in (container or {}).get("env") or []:
            if (entry or {}).get("name") != names.ENV_HORIZON_SECONDS:
                continue
            if "valueFrom" not in entry and not str(entry.get("value") or "").strip():
                continue  # empty: unset, as the Guard and the sidecar read it
            if found is not None and found != entry:
                raise ValueError(f"{HORIZON_FIELD}: the app containers set it differently; the Guard, the "
                                 "sidecar and the supervisor need one value")
            found = entry
    if found is None:
        return HORIZON_SECONDS, None
    if "valueFrom" in found:
        raise ValueError(f"{HORIZON_FIELD}: set it as a value (the supervisor reads the job's template, "
                         "not a ConfigMap or Secret)")
    try:
        seconds = float(str(found["value"]).strip())
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{HORIZON_FIELD}: expected seconds > 0, got {found['value']!r}")
    return seconds, dict(found)


def job_horizon(pod_specs: Iterable[Mapping[str, Any]]) -> float:
    """The one horizon every pod role of a job holds notices by (`horizon_entry` of each role's
    pod spec; a role that sets none holds by the default). ValueError naming HORIZON_FIELD when
    one role's is bad or two roles differ (a PyTorchJob's Master runs a Guard too)."""
    horizons = {horizon_entry(spec)[0] for spec in pod_specs}
    if len(horizons) > 1:
        raise ValueError(f"{HORIZON_FIELD}: the job's pod roles hold notices by different horizons "
                         f"({', '.join(f'{h:g}' for h in sorted(horizons))} s); set the same value in every role")
    return next(iter(horizons), HORIZON_SECONDS)
