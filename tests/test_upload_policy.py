"""The uploader's pure decisions (hooks/checkpoint/objectstore/upload_policy.py): which failures are
tried again, how long, and which queued parts the bound of the local tier drops."""
from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, NoCredentialsError
from boto3.exceptions import S3UploadFailedError

from spotguard.hooks.checkpoint.objectstore.remote import RemoteCommitError
from spotguard.hooks.checkpoint.objectstore.upload_policy import QueuedPart, RetryBudget, parts_to_drop, retriable


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def wrapped(cause: BaseException) -> S3UploadFailedError:
    try:
        raise S3UploadFailedError("Failed to upload x to ckpt/x: An error occurred") from cause
    except S3UploadFailedError as exc:
        return exc


@pytest.mark.parametrize("exc, again", [
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), True),
    (ConnectionClosedError(endpoint_url="http://127.0.0.1:9"), True),
    (client_error(503, "SlowDown"), True),
    (client_error(500, "InternalError"), True),
    (client_error(429, "TooManyRequests"), True),
    (wrapped(client_error(503, "ServiceUnavailable")), True),
    (wrapped(EndpointConnectionError(endpoint_url="http://127.0.0.1:9")), True),
    (client_error(403, "AccessDenied"), False),
    (client_error(404, "NoSuchBucket"), False),
    (wrapped(client_error(403, "InvalidAccessKeyId")), False),
    (NoCredentialsError(), False),
    (RemoteCommitError("a part is missing"), False),
    (FileNotFoundError("staged file gone"), False),
    (KeyboardInterrupt(), False),
])
def test_what_is_tried_again(exc, again):
    assert retriable(exc) is again


def test_a_budget_counts_from_the_first_failure():
    budget = RetryBudget(10.0)
    assert budget.allows(100.0) and budget.allows(109.9) and not budget.allows(110.0)


def parts(*spec: str) -> list[QueuedPart]:
    """'a*' is uploading now, 'b' waits."""
    return [QueuedPart(s.rstrip("*"), s.endswith("*"), 1) for s in spec]


@pytest.mark.parametrize("queued, limit, dropped", [
    (parts("a*", "b"), 2, []),
    (parts("a*", "b", "c"), 2, ["b"]),                 # the oldest waiting one, never the one uploading
    (parts("a*", "b", "c", "d"), 2, ["b", "c"]),
    (parts("a", "b", "c"), 2, ["a"]),                  # nothing uploading: the oldest goes
    (parts("a*", "b", "c", "d"), 3, ["b"]),
    (parts("a*", "b"), 1, []),                         # never the newest, never the one uploading
    (parts("a", "b", "c"), 5, []),
])
def test_the_bound_drops_the_oldest_waiting_parts_never_the_newest(queued, limit, dropped):
    assert parts_to_drop(queued, limit) == dropped
