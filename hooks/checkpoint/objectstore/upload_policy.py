"""What the uploader decides, apart from doing it (pure: no I/O, time passed in).

- `retriable(exc)`: whether an upload or commit that raised `exc` is tried again: a transport
  failure (endpoint unreachable, connection reset, timeout, a 5xx, throttling) is; a refusal that
  will not change by itself (credentials, a missing bucket, a 4xx other than 408/429, a commit
  refused because a part is missing or was dropped, a staged file gone) is not.
- `RetryBudget`: how long a failing job is retried, from its first failure.
- `parts_to_drop(queued, limit)`: the bound of the local tier. `queued` lists this rank's part
  uploads held in staging, oldest first (the one uploading now first, if any); at most `limit`
  stay. The oldest not yet started are dropped first, never the newest (the one just staged),
  never the one uploading now.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RETRY_STATUS = frozenset({408, 429})  # 4xx statuses that a later try may pass


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def retriable(exc: BaseException) -> bool:
    """See the module docstring. Walks the exception's causes: boto3's S3UploadFailedError wraps
    the client error that made it."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt, FileNotFoundError)):
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "retriable", None) is False:  # RemoteCommitError: waiting again changes nothing
            return False
        name = type(current).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "NoSuchBucket"):
            return False
        status = _status(current)
        if status is not None:
            return status >= 500 or status in RETRY_STATUS
        current = current.__cause__ or current.__context__
    text = str(exc)
    return not any(word in text for word in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                             "NoSuchBucket", "(403)", "(401)", "(400)"))


@dataclass
class RetryBudget:
    """A job's retries: allowed until `seconds` after its first failure (`now` is monotonic)."""

    seconds: float
    first_failure: float | None = None

    def allows(self, now: float) -> bool:
        if self.first_failure is None:
            self.first_failure = now
        return now - self.first_failure < self.seconds


@dataclass(frozen=True)
class QueuedPart:
    """One part upload held in staging: its tag, whether it is uploading now, and its bytes."""

    tag: str
    started: bool
    size: int


def parts_to_drop(queued: Sequence[QueuedPart], limit: int) -> list[str]:
    """The tags whose queued part uploads go so that at most `limit` remain (module docstring)."""
    excess = len(queued) - max(limit, 1)
    if excess <= 0:
        return []
    droppable = [part.tag for part in queued[:-1] if not part.started]
    return droppable[:excess]
