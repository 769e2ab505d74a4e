"""Deprecated alias of `spotguard.kube.api`, the one Kubernetes access layer, kept so that code
written against the old path keeps importing; new code imports `spotguard.kube.api`."""
from spotguard.kube.api import (EVENTS, JOBS, LEASES, MERGE_PATCH, NODES, PODS, PYTORCHJOBS, ApiError, Conflict, Kube,
                                NotFound, Resource, WatchStream, matches_labels, selector_text)

__all__ = ["EVENTS", "JOBS", "LEASES", "MERGE_PATCH", "NODES", "PODS", "PYTORCHJOBS", "ApiError", "Conflict", "Kube",
           "NotFound", "Resource", "WatchStream", "matches_labels", "selector_text"]
