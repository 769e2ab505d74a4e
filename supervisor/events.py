"""Kubernetes Events for decisions, named after the decision's idempotency key.

An Event's name is `<job>.<key>`: sending the same decision's Event again (a restarted or new
leader) gets 409 from the API server and is not duplicated. Its involved object's kind and
apiVersion come from the object's resource, never from the object: an object from a list (the
informer's first sync) carries neither, and an Event without them is shown by neither `kubectl
describe` nor `spotguard status`, which select Events by involvedObject kind and name.
"""
from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any
from collections.abc import Mapping

from spotguard.kube.api import Resource
from spotguard.wire import names
from spotguard.wire.notice import format_time


def event_name(job_name: str, key: str) -> str:
    suffix = key if key.replace("-", "").isalnum() and len(key) <= 32 else hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{job_name[:200]}.{suffix}".lower()


def event_body(obj: Mapping[str, Any], involved: Resource, *, key: str, reason: str, message: str,
               event_type: str, action: str, identity: str, now: datetime) -> dict:
    """The Event about `obj`, an object of the resource `involved` (module docstring)."""
    meta = obj.get("metadata") or {}
    stamp = format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(meta.get("name", "job"), key), "namespace": meta.get("namespace", "default"),
                     "labels": {names.PREFIX + "component": "supervisor"}},
        "involvedObject": {"apiVersion": involved.api_version, "kind": involved.kind,
                           "name": meta.get("name", ""), "namespace": meta.get("namespace", ""),
                           "uid": meta.get("uid", ""), "resourceVersion": meta.get("resourceVersion", "")},
        "reason": reason,
        "message": message[:1024],
        "type": event_type,
        "action": action,
        "source": {"component": names.COMPONENT},
        "reportingComponent": names.COMPONENT,
        "reportingInstance": identity[:128],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "eventTime": None,
        "count": 1,
    }
