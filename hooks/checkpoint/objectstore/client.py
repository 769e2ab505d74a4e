"""The boto3 client of an object-store checkpoint root, and the check that stops a bad one at start.

Credentials come from boto3's standard chain: environment (`AWS_ACCESS_KEY_ID`, ...), the shared
config files, web identity (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`: IRSA on EKS),
container credentials, the instance profile. The endpoint is, first found: the `endpoint_url`
argument, `SPOTGUARD_S3_ENDPOINT`, boto3's own `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, else
AWS. With any endpoint override, requests use path-style addressing (what S3-compatible servers
expect).

`check_access` lists the prefix and writes then deletes one probe object: an unreachable endpoint,
missing or refused credentials, a missing bucket or a read-only grant raise `ConfigError`
("checkpoint_dir") naming the URL, the endpoint and the cause, before training starts.
"""
from __future__ import annotations

import os
import uuid
from typing import Any

from spotguard.config import ConfigError

from .url import ObjectStoreURL

ENDPOINT_ENV = "SPOTGUARD_S3_ENDPOINT"
FIELD = "checkpoint_dir"


def endpoint_of(endpoint_url: str | None) -> str | None:
    """The endpoint override in force (argument, SPOTGUARD_S3_ENDPOINT, boto3's variables), or None."""
    for value in (endpoint_url, os.environ.get(ENDPOINT_ENV), os.environ.get("AWS_ENDPOINT_URL_S3"),
                  os.environ.get("AWS_ENDPOINT_URL")):
        if value:
            return value
    return None


def make_client(endpoint_url: str | None = None, *, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                max_attempts: int = 4, pool_size: int = 32) -> Any:
    """A thread-safe boto3 S3 client with the standard credential chain (see the module docstring)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise ConfigError(FIELD, "an s3:// checkpoint_dir needs boto3: pip install 'spotguard[s3]'") from exc
    endpoint = endpoint_of(endpoint_url)
    config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                    retries={"max_attempts": max_attempts, "mode": "standard"}, max_pool_connections=pool_size,
                    s3={"addressing_style": "path"} if endpoint else {},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint, config=config)


def describe_failure(exc: BaseException) -> str:
    """What went wrong talking to the object store, in words (for errors at start and in logs)."""
    from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError,
                                     ReadTimeoutError)

    if isinstance(exc, NoCredentialsError):
        return ("no credentials found (environment, web identity / IRSA, config files, instance profile "
                "were tried)")
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        return f"endpoint unreachable ({exc})"
    if isinstance(exc, ReadTimeoutError):
        return f"endpoint did not answer in time ({exc})"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket",) or (status == 404 and code in ("404", "NotFound", "")):
            return "the bucket does not exist"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "AuthorizationHeaderMalformed") or status in (401, 403):
            return f"credentials refused ({code or status}: {error.get('Message') or 'access denied'})"
        return f"{code or status}: {error.get('Message', exc)}"
    return f"{type(exc).__name__}: {exc}"


def check_access(client: Any, url: ObjectStoreURL) -> None:
    """Lists the prefix and writes/deletes a probe object; ConfigError naming the URL and the cause."""
    from botocore.exceptions import BotoCoreError, ClientError

    probe = url.key(f".spotguard-probe-{uuid.uuid4().hex[:12]}")
    where = f"{url} (endpoint {client.meta.endpoint_url})"
    try:
        client.list_objects_v2(Bucket=url.bucket, Prefix=url.root_key, MaxKeys=1)
        client.put_object(Bucket=url.bucket, Key=probe, Body=b"")
        client.delete_object(Bucket=url.bucket, Key=probe)
    except (BotoCoreError, ClientError) as exc:
        raise ConfigError(FIELD, f"{where}: {describe_failure(exc)}") from exc
