"""Whether a pod asked for the spotguard sidecar and whether it has it: one answer for the
injector, which adds the sidecar at admission (injector/patch.py), and for the supervisor, which
warns about a pod admitted without it while the injector was not ready (the webhook's
failurePolicy is Ignore: supervisor/sidecar_watch.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spotguard.wire import names

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
