"""Posts core/v1 Events about a Node and the opted-in pods running on it.

`NodeEventPoster.post_notices(desired, node)` posts one Event (reason SpotguardNotice) per live
notice on the Node and on each pod there with label `spotguard.io/inject: "true"` (listed with
the field selector spec.nodeName=<node>, filtered again client-side), once per notice and
object: Event names derive from (notice id, object), so a restarted agent gets 409
AlreadyExists instead of posting twice. `post(name, ref, ...)` posts one Event; True if created,
False if it existed. Blocking (Kubernetes client): call from a worker thread.
"""
from __future__ import annotations

import hashlib
import json

from spotguard.agent.node_marks import notice_message
from spotguard.wire import names
from spotguard.wire.notice import Notice, now_utc
from spotguard.kube.api import EVENTS, PODS, Conflict, Kube



class NodeEventPoster:
    """See the module docstring. `stats["events"]` counts the Events created."""

    def __init__(self, kube: Kube, node: str, *, event_pods: bool = True, event_namespace: str = "default"):
        self.kube = kube
        self.node = node
        self.event_pods = event_pods
        self.event_namespace = event_namespace
        self.stats = {"events": 0}
        self._done: dict[str, set[tuple[str, str, str]]] = {}  # notice id -> objects told

    def post_notices(self, desired: list[Notice], node: dict | None) -> None:
        """The missing notice Events for the live notices `desired`; forgets the gone ones."""
        if desired:
            targets = [self.node_ref(node)]
            if self.event_pods:
                targets += self._opted_in_pods()
            for notice in desired:
                done = self._done.setdefault(notice.id, set())
                for ref in targets:
                    key = (ref["kind"], ref.get("namespace", ""), ref["name"])
                    if key in done:
                        continue
                    digest = hashlib.sha256(json.dumps([notice.id, *key]).encode()).hexdigest()[:16]
                    self.post(f"{ref['name'][:200]}.{digest}", ref, names.EVENT_NOTICE, notice_message(notice),
                              "Warning",
                              annotations={names.ANN_NOTICE + "-id": notice.id})
                    done.add(key)
        live_ids = {n.id for n in desired or ()}
        for gone in self._done.keys() - live_ids:
            del self._done[gone]

    def node_ref(self, node: dict | None) -> dict:
        ref = {"apiVersion": "v1", "kind": "Node", "name": self.node}
        uid = ((node or {}).get("metadata") or {}).get("uid")
        if uid:
            ref["uid"] = uid
        return ref

    def _opted_in_pods(self) -> list[dict]:
        pods, _ = self.kube.list(PODS, None, field_selector=f"spec.nodeName={self.node}",
                                 label_selector={names.LABEL_INJECT: "true"})
        refs = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (pod.get("spec") or {}).get("nodeName") != self.node:
                continue  # the field selector is a request, not a promise: filter again
            if (meta.get("labels") or {}).get(names.LABEL_INJECT) != "true":
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or not meta.get("name"):
                continue
            ref = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                   "namespace": meta.get("namespace") or "default"}
            if meta.get("uid"):
                ref["uid"] = meta["uid"]
            refs.append(ref)
        return refs

    def post(self, name: str, ref: dict, reason: str, message: str, type: str,
             annotations: dict | None = None) -> bool:
        """Creates one Event; True if created, False if it already existed (409)."""
        namespace = ref.get("namespace") or self.event_namespace
        stamp = now_utc().strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"name": name, "namespace": namespace, **({"annotations": annotations} if annotations else {})},
            "involvedObject": ref,
            "reason": reason,
            "message": message[:1024],
            "type": type,
            "source": {"component": names.COMPONENT_AGENT, "host": self.node},
            "reportingComponent": names.COMPONENT_AGENT,
            "reportingInstance": self.node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self.kube.create(EVENTS, namespace, body)
        except Conflict:
            return False
        self.stats["events"] += 1
        return True
