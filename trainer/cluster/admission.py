"""The local API's mutating admission: what the cluster's webhooks do to a pod at its creation.

`inject(pod)` is the product's injector (injector/patch.py `build_patch`, the JSON patch its
webhook answers with) applied as the API server applies it: a pod labelled
`spotguard.io/inject: "true"` gets the sidecar (a native sidecar init container), its volumes,
the Guard's environment, the preStop hook, the grace period and, for an in-place pod, the
in-place environment, the ready file and its readiness probe. A pod the injector refuses is
refused (ApiError 400 naming the field), as a webhook's denial is.
"""
from __future__ import annotations

from spotguard.injector.patch import InjectorConfig, PodSpecError, build_patch
from spotguard.kube.api import ApiError
from spotguard.trainer.cluster.patches import json_patch

INJECTOR = InjectorConfig(image="spotguard (this checkout)")


def inject(pod: dict) -> None:
    """See the module docstring (changes `pod` in place)."""
    try:
        ops = build_patch(pod, INJECTOR)
    except PodSpecError as exc:
        raise ApiError(400, f"admission webhook spotguard-injector denied the request: {exc}") from None
    if ops:
        patched = json_patch(pod, ops)
        pod.clear()
        pod.update(patched)
