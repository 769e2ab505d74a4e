"""The one Kubernetes access layer of agent, supervisor and injector: a thin, blocking facade
over the official `kubernetes` client that speaks plain dicts.

Every call goes through the typed APIs (CoreV1Api, BatchV1Api, CoordinationV1Api,
AuthenticationV1Api, AdmissionregistrationV1Api) or, for
other groups (e.g. kubeflow.org PyTorchJobs), CustomObjectsApi, always with
`_preload_content=False` so responses are parsed with `json.loads` instead of model classes.
Contract:
- methods block: call them from a thread (`asyncio.to_thread`), never on the event loop;
- `patch` sends `application/merge-patch+json` (valid for built-in and custom resources) unless
  told another `content_type` (strategic merge, JSON patch); put `metadata.resourceVersion` in
  the body to make it conditional: the server answers 409 when the object changed since, which
  `Conflict` reports (`spotguard.kube.conflict.retry_on_conflict` re-reads and retries);
- `NotFound` / `Conflict` / `ApiError` carry the HTTP status (0: transport failure;
  `MalformedResponse`: a 2xx whose body is not JSON); label and field selectors are
  sent to the server as documented (callers still filter, see `matches_labels`).
"""
from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class Resource:
    """An API resource: group ("" = core), version, plural, and the snake_case kind the typed
    client uses in method names (e.g. "pod" -> list_namespaced_pod)."""

    group: str
    version: str
    plural: str
    snake: str
    namespaced: bool = True
    kind: str = ""

    @property
    def api_version(self) -> str:
        return self.version if not self.group else f"{self.group}/{self.version}"

    def __str__(self) -> str:
        return f"{self.plural}.{self.group or 'core'}/{self.version}"


NODES = Resource("", "v1", "nodes", "node", namespaced=False, kind="Node")
PODS = Resource("", "v1", "pods", "pod", kind="Pod")
EVENTS = Resource("", "v1", "events", "event", kind="Event")
JOBS = Resource("batch", "v1", "jobs", "job", kind="Job")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "lease", kind="Lease")
PYTORCHJOBS = Resource("kubeflow.org", "v1", "pytorchjobs", "", kind="PyTorchJob")
SECRETS = Resource("", "v1", "secrets", "secret", kind="Secret")
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", "token_review", namespaced=False,
                         kind="TokenReview")
MUTATING_WEBHOOKS = Resource("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
                             "mutating_webhook_configuration", namespaced=False, kind="MutatingWebhookConfiguration")

_TYPED = {"": "CoreV1Api", "batch": "BatchV1Api", "coordination.k8s.io": "CoordinationV1Api",
          "authentication.k8s.io": "AuthenticationV1Api", "admissionregistration.k8s.io": "AdmissionregistrationV1Api"}


class ApiError(Exception):
    """A non-2xx answer (or a transport failure, status 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class MalformedResponse(ApiError):
    """A 2xx answer whose body is not a JSON document."""


def _error(exc: Exception) -> ApiError:
    status = int(getattr(exc, "status", 0) or 0)
    return error_for_status(status, str(getattr(exc, "body", None) or exc))


def error_for_status(status: int, body: str) -> ApiError:
    """The error for a non-2xx answer: NotFound (404), Conflict (409), else ApiError."""
    message = body[:300]
    if status == 404:
        return NotFound(status, message)
    if status == 409:
        return Conflict(status, message)
    return ApiError(status, message)


def matches_labels(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def selector_text(selector: Mapping[str, str] | None) -> str | None:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items())) if selector else None


class Kube:
    """Dict-in, dict-out Kubernetes calls over one `ApiClient` (see the module docstring)."""

    def __init__(self, api_client, request_timeout: float = 15.0):
        import kubernetes

        self.api_client = api_client
        self.timeout = request_timeout
        self._k = kubernetes
        self._typed: dict[str, Any] = {}  # built on first use: each API class is a large module to import
        self._custom_api: Any = None

    def _call(self, fn, *args, **kwargs) -> Any:
        kwargs.setdefault("_request_timeout", self.timeout)
        try:
            response = fn(*args, _preload_content=False, **kwargs)
        except self._k.client.ApiException as exc:
            raise _error(exc) from None
        except Exception as exc:  # urllib3 transport errors: connection refused, timeouts
            if isinstance(exc, ApiError):
                raise
            raise ApiError(0, f"{type(exc).__name__}: {exc}") from None
        data = response.data
        try:
            return json.loads(data) if data else {}
        except ValueError:
            raise MalformedResponse(0, f"{getattr(fn, '__name__', 'call')}: the body is not JSON") from None

    def _typed_api(self, res: Resource):
        if not res.snake or res.group not in _TYPED:
            return None
        api = self._typed.get(res.group)
        if api is None:
            api = self._typed[res.group] = getattr(self._k.client, _TYPED[res.group])(self.api_client)
        return api

    @property
    def _custom(self):
        if self._custom_api is None:
            self._custom_api = self._k.client.CustomObjectsApi(self.api_client)
        return self._custom_api

    def list(self, res: Resource, namespace: str | None = None, *, label_selector: Mapping[str, str] | None = None,
             field_selector: str | None = None) -> tuple[list[dict], str]:
        """(items, list resourceVersion). Callers should still filter by labels themselves."""
        kw = {}
        if label_selector:
            kw["label_selector"] = selector_text(label_selector)
        if field_selector:
            kw["field_selector"] = field_selector
        api = self._typed_api(res)
        if api is not None:
            if not res.namespaced:
                fn = getattr(api, f"list_{res.snake}")
                body = self._call(fn, **kw)
            elif namespace:
                body = self._call(getattr(api, f"list_namespaced_{res.snake}"), namespace, **kw)
            else:
                body = self._call(getattr(api, f"list_{res.snake}_for_all_namespaces"), **kw)
        elif namespace:
            body = self._call(self._custom.list_namespaced_custom_object, res.group, res.version, namespace,
                              res.plural, **kw)
        else:
            body = self._call(self._custom.list_cluster_custom_object, res.group, res.version, res.plural, **kw)
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise MalformedResponse(0, f"list of {res}: no items array")
        return [i for i in items if isinstance(i, dict)], str((body.get("metadata") or {}).get("resourceVersion") or "")

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        api = self._typed_api(res)
        if api is not None:
            if res.namespaced:
                return self._call(getattr(api, f"read_namespaced_{res.snake}"), name, namespace)
            return self._call(getattr(api, f"read_{res.snake}"), name)
        return self._call(self._custom.get_namespaced_custom_object, res.group, res.version, namespace, res.plural,
                          name)

    def patch(self, res: Resource, namespace: str | None, name: str, body: Mapping[str, Any] | builtins.list, *,
              status: bool = False, content_type: str = MERGE_PATCH) -> dict:
        """A patch of the object, or of its status subresource: a JSON merge patch (RFC 7386)
        by default; `content_type` STRATEGIC_MERGE_PATCH, or JSON_PATCH with a list of ops."""
        api = self._typed_api(res)
        kw = {"_content_type": content_type}
        body = list(body) if isinstance(body, list) else dict(body)
        sub = "_status" if status else ""
        if api is not None:
            if res.namespaced:
                return self._call(getattr(api, f"patch_namespaced_{res.snake}{sub}"), name, namespace, body, **kw)
            return self._call(getattr(api, f"patch_{res.snake}{sub}"), name, body, **kw)
        custom = self._custom
        fn = custom.patch_namespaced_custom_object_status if status else custom.patch_namespaced_custom_object
        return self._call(fn, res.group, res.version, namespace, res.plural, name, body, **kw)

    def create(self, res: Resource, namespace: str | None, body: Mapping[str, Any]) -> dict:
        api = self._typed_api(res)
        if api is not None:
            if res.namespaced:
                return self._call(getattr(api, f"create_namespaced_{res.snake}"), namespace, dict(body))
            return self._call(getattr(api, f"create_{res.snake}"), dict(body))
        return self._call(self._custom.create_namespaced_custom_object, res.group, res.version, namespace, res.plural,
                          dict(body))

    def watch(self, res: Resource, namespace: str | None, resource_version: str, *, timeout_seconds: int = 300,
              label_selector: Mapping[str, str] | None = None, field_selector: str | None = None) -> WatchStream:
        """Opens a watch from `resource_version`; iterate the returned stream for events."""
        kw: dict[str, Any] = {"watch": True, "timeout_seconds": timeout_seconds, "allow_watch_bookmarks": True,
                              "_request_timeout": (self.timeout, timeout_seconds + 30)}
        if resource_version:
            kw["resource_version"] = resource_version
        if label_selector:
            kw["label_selector"] = selector_text(label_selector)
        if field_selector:
            kw["field_selector"] = field_selector
        api = self._typed_api(res)  # a method the client lacks raises AttributeError here: nothing is sent
        args: tuple[str, ...]
        if api is not None:
            if not res.namespaced:
                fn, args = getattr(api, f"list_{res.snake}"), ()
            elif namespace:
                fn, args = getattr(api, f"list_namespaced_{res.snake}"), (namespace,)
            else:
                fn, args = getattr(api, f"list_{res.snake}_for_all_namespaces"), ()
        elif namespace:
            fn, args = self._custom.list_namespaced_custom_object, (res.group, res.version, namespace, res.plural)
        else:
            fn, args = self._custom.list_cluster_custom_object, (res.group, res.version, res.plural)
        try:
            response = fn(*args, _preload_content=False, **kw)
        except self._k.client.ApiException as exc:
            raise _error(exc) from None
        except Exception as exc:
            raise ApiError(0, f"{type(exc).__name__}: {exc}") from None
        return WatchStream(response)


class WatchStream:
    """The events of one watch response: dicts {"type", "object"}; `close()` from any thread
    ends the iteration."""

    def __init__(self, response):
        self._response = response
        self.closed = False

    def __iter__(self) -> Iterator[dict]:
        from kubernetes.watch.watch import iter_resp_lines

        try:
            for line in iter_resp_lines(self._response):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("object"), dict):
                    yield event
        except Exception as exc:
            if self.closed:
                return
            raise ApiError(0, f"watch broke: {type(exc).__name__}: {exc}") from None
        finally:
            self._release()

    def _release(self) -> None:
        try:
            self._response.release_conn()
        except Exception:
            pass

    def close(self) -> None:
        self.closed = True
        try:
            self._response.shutdown()
        except Exception:
            pass
        try:
            self._response.close()
        except Exception:
            pass
