"""The update rules of the API server the supervisor relies on, as checks of (old, new). Pure.

Each check raises `Invalid` (the API server's 422) naming the field, and changes nothing:
- a Job's pod template may change only in its scheduling directives (`nodeSelector`,
  `affinity`, `tolerations`, `schedulingGates`), and only while the Job is suspended and has no
  `status.startTime` before the update (one patch may move it and resume it; the Job controller
  clears startTime once a suspended Job's pods are gone: tests/test_k8s_fallback.py); the
  template's labels and annotations, `completionMode`, `podFailurePolicy`, `successPolicy` and
  the selector never;
  `completions` only together with an equal `parallelism` (an elastic Indexed Job);
- a Pod's spec is immutable but for: its scheduling gates may be removed (never added), its
  `nodeSelector` may gain keys while it is still gated, tolerations may be added (placement.py
  and the admission policy rely on exactly this); `nodeName` is set only by binding.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DIRECTIVES = ("nodeSelector", "affinity", "tolerations", "schedulingGates")


class Invalid(ValueError):
    """An update the API server refuses (422 Unprocessable Entity)."""


def _spec(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return (obj or {}).get("spec") or {}


def check_job_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """See the module docstring (Jobs)."""
    before, after = _spec(old), _spec(new)
    for name in ("completionMode", "podFailurePolicy", "successPolicy", "selector"):
        if before.get(name) != after.get(name):
            raise Invalid(f"spec.{name}: field is immutable")
    if before.get("completions") != after.get("completions") and after.get("completions") != after.get("parallelism"):
        raise Invalid("spec.completions: may change only together with an equal spec.parallelism")
    old_t, new_t = before.get("template") or {}, after.get("template") or {}
    if old_t == new_t:
        return
    old_pod, new_pod = old_t.get("spec") or {}, new_t.get("spec") or {}
    changed = sorted({k for k in {*old_pod, *new_pod} if old_pod.get(k) != new_pod.get(k)})
    other = [k for k in changed if k not in DIRECTIVES]
    if other or old_t.get("metadata") != new_t.get("metadata"):
        field = f"spec.template.spec.{other[0]}" if other else "spec.template.metadata"
        raise Invalid(f"{field}: field is immutable")
    started = bool((old.get("status") or {}).get("startTime"))
    if not before.get("suspend") or started:
        raise Invalid(f"spec.template.spec.{changed[0]}: the scheduling directives of a Job's template may "
                      "change only while it is suspended and has no status.startTime")


def check_pod_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """See the module docstring (Pods)."""
    before, after = dict(_spec(old)), dict(_spec(new))
    old_gates = before.pop("schedulingGates", None) or []
    new_gates = after.pop("schedulingGates", None) or []
    if any(g not in old_gates for g in new_gates):
        raise Invalid("spec.schedulingGates: gates may be removed, not added")
    old_selector = before.pop("nodeSelector", None) or {}
    new_selector = after.pop("nodeSelector", None) or {}
    if old_selector != new_selector:
        if not old_gates:
            raise Invalid("spec.nodeSelector: may change only while the pod has scheduling gates")
        if any(new_selector.get(k) != v for k, v in old_selector.items()):
            raise Invalid("spec.nodeSelector: existing keys may not change or go away")
    old_tolerations = before.pop("tolerations", None) or []
    new_tolerations = after.pop("tolerations", None) or []
    if any(t not in new_tolerations for t in old_tolerations):
        raise Invalid("spec.tolerations: tolerations may be added, not removed")
    if before != after:
        field = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))[0]
        raise Invalid(f"spec.{field}: field is immutable")
