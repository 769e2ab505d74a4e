"""Deprecated alias of `spotguard.kube.api` (the one Kubernetes access layer), kept so that code
written against the old path keeps importing; new code imports `spotguard.kube.api`."""
from spotguard.kube.api import *  # noqa: F401,F403
from spotguard.kube.api import ApiError, Conflict, Kube, NotFound, Resource, WatchStream  # noqa: F401
