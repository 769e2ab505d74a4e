"""Authentication of the agent's one state-changing call, `POST /v1/reports`.

Three modes, chosen at start:
- cluster mode (`TokenReviewAuth`): the bearer token is the reporting pod's projected
  service-account token with audience "spotguard"; the agent asks the API server with a
  TokenReview (authentication.k8s.io/v1), in a thread. The identity it returns (namespace from
  `system:serviceaccount:<ns>:<sa>`, pod from the bound token's pod-name claim) must match the
  pod and namespace the report names. Answers are cached briefly (by a hash of the token, never
  the token itself); an unreachable API server gives 503 and is not cached.
- local mode (`SharedSecretAuth`): the token must equal a shared secret read from a file
  (`--report-token-file`), compared in constant time.
- nothing configured (`RefuseAll`): every report is refused with 403.

`authenticate(header)` returns a `Caller` or raises `AuthError` with the HTTP status to send
(401: no or bad credentials; 403: valid but not allowed; 503: cannot check now).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spotguard.config import ConfigError
from spotguard.kube.api import TOKEN_REVIEWS, Kube

log = logging.getLogger(__name__)

AUDIENCE = "spotguard"
POD_NAME_CLAIM = "authentication.kubernetes.io/pod-name"
SA_PREFIX = "system:serviceaccount:"
MAX_TOKEN_BYTES = 16 * 1024


class AuthError(Exception):
    """The caller is not allowed; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Caller:
    """Who made the request. `namespace`/`pod` are None when the scheme does not say (local)."""

    name: str
    namespace: str | None = None
    pod: str | None = None

    def may_report_for(self, namespace: str, pod: str) -> bool:
        """True when this caller may report on behalf of `namespace`/`pod`."""
        if self.namespace is not None and self.namespace != namespace:
            return False
        if self.pod is not None and self.pod != pod:
            return False
        return True


class Authenticator(Protocol):
    async def authenticate(self, authorization: str | None) -> Caller: ...


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; AuthError(401) otherwise."""
    if not authorization:
        raise AuthError(401, "missing Authorization: Bearer <token>")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError(401, "expected Authorization: Bearer <token>")
    if len(token) > MAX_TOKEN_BYTES:
        raise AuthError(401, "token too long")
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class RefuseAll:
    """No authentication configured: the agent accepts no reports (and so approves nothing early)."""

    async def authenticate(self, authorization: str | None) -> Caller:
        raise AuthError(403, "reports are disabled: no authentication configured "
                             "(run in cluster mode, or pass --report-token-file)")


class SharedSecretAuth:
    """Local mode: the bearer token must equal the shared secret (constant-time comparison)."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("empty shared secret")
        self._secret_digest = _digest(secret)

    @classmethod
    def from_file(cls, path: str, field: str = "--report-token-file") -> SharedSecretAuth:
        """Reads the secret (surrounding whitespace stripped); ConfigError(field) if unusable."""
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(field, f"cannot read {path}: {exc}") from None
        if len(text) < 16:
            raise ConfigError(field, f"{path}: the shared secret must be at least 16 characters")
        return cls(text)

    async def authenticate(self, authorization: str | None) -> Caller:
        token = bearer_token(authorization)
        if not hmac.compare_digest(_digest(token), self._secret_digest):
            raise AuthError(401, "wrong token")
        return Caller("local")


class TokenReviewAuth:
    """Cluster mode: a TokenReview of the pod's projected service-account token."""

    def __init__(self, api_client: Any, audience: str = AUDIENCE, ttl: float = 30.0,
                 negative_ttl: float = 5.0, request_timeout: float = 5.0, max_cache: int = 1024):
        self.api_client = api_client
        self.kube = Kube(api_client, request_timeout=request_timeout)
        self.audience = audience
        self.ttl, self.negative_ttl = ttl, negative_ttl
        self.request_timeout = request_timeout
        self.max_cache = max_cache
        self._cache: dict[bytes, tuple[float, Caller | AuthError]] = {}
        self.reviews = 0  # TokenReviews sent (cache misses)

    async def authenticate(self, authorization: str | None) -> Caller:
        token = bearer_token(authorization)
        key = _digest(token)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            result = cached[1]
        else:
            result = await asyncio.to_thread(self._review, token)
            ttl = self.ttl if isinstance(result, Caller) else self.negative_ttl
            if not (isinstance(result, AuthError) and result.status == 503):
                self._remember(key, time.monotonic() + ttl, result)
        if isinstance(result, AuthError):
            raise result
        return result

    def _remember(self, key: bytes, expiry: float, result: Caller | AuthError) -> None:
        self._cache.pop(key, None)
        while len(self._cache) >= self.max_cache:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = (expiry, result)

    def _review(self, token: str) -> Caller | AuthError:
        """Blocking: one TokenReview. Returns the caller, or the AuthError to raise."""
        self.reviews += 1
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            review = self.kube.create(TOKEN_REVIEWS, None, body)
        except Exception as exc:  # ApiError (HTTP, transport, a malformed answer)
            log.warning("TokenReview failed: %s", exc.__class__.__name__)
            return AuthError(503, "cannot verify the token now (API server unreachable)")
        return self._caller_from(review.get("status") if isinstance(review, dict) else None)

    def _caller_from(self, status: Any) -> Caller | AuthError:
        if not isinstance(status, dict) or status.get("authenticated") is not True:
            return AuthError(401, "token not authenticated")
        audiences = status.get("audiences")
        if audiences is not None and self.audience not in audiences:
            return AuthError(401, f"token is not valid for audience {self.audience!r}")
        raw_user = status.get("user")
        user: dict = raw_user if isinstance(raw_user, dict) else {}
        username = user.get("username") or ""
        if not isinstance(username, str) or not username.startswith(SA_PREFIX):
            return AuthError(403, "only pod service-account tokens may report")
        namespace = username[len(SA_PREFIX):].split(":", 1)[0]
        raw_extra = user.get("extra")
        extra: dict = raw_extra if isinstance(raw_extra, dict) else {}
        pods = extra.get(POD_NAME_CLAIM) or []
        pod = pods[0] if isinstance(pods, list) and len(pods) == 1 else None
        if not namespace:
            return AuthError(403, "service-account token without a namespace")
        if pod is None:
            return AuthError(403, "token is not bound to a pod (use a projected service-account token)")
        return Caller(username, namespace, pod)
