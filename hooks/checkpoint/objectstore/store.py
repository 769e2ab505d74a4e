"""`ObjectCheckpointStore`: checkpoints in an S3-compatible object store, local disk first.

Two tiers, one interface (that of `CheckpointStore`, so adapters do not change):
- tier 1, local: every rank writes its files into a `CheckpointStore` on local disk (`local_dir`,
  or `SPOTGUARD_LOCAL_CHECKPOINT_DIR`, or a folder under the temp dir named after the URL); its
  part is durable there (fsynced) when `finish_rank` returns, within the notice's deadline. When
  every rank's part is on this disk (one node), rank 0 also commits the checkpoint locally;
- tier 2, object store: at `finish_rank` each rank's files are hard-linked into a staging folder
  and uploaded in the background (uploader.py), its part manifest last; rank 0's `commit` queues
  the remote commit (remote.py: waits for every part, manifest last, then `latest`, retention and
  the cleanup of dead writers' leftovers). Only this tier survives the node: a checkpoint that is
  durable locally but not yet uploaded when the node dies is lost, by design.

Reading goes to the object store: `list`, `latest`, `read` return its complete checkpoints, whose
`dir` is where `resolve` downloads them (`<local>/_downloads/<tag>/`, once per node and commit);
`resolve` downloads the newest, verifies its checksums and falls back to older ones like the disk
store does. `durable_tier(tag)` says "object", "local" or None; `wait_uploaded(timeout)` waits for
the background uploads. Opening checks the bucket at once (client.check_access): an unreachable
endpoint, refused credentials or a missing bucket raise ConfigError naming the URL and the cause.
"""
from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError, positive_float, positive_int
from spotguard.metrics import Registry

from ..derived import DerivedCopies, derived_areas
from ..locks import live_tags_reaping_dead
from ..manifest import PENDING_PREFIX, collect_parts, validate_tag
from ..pending import PendingDirectory
from ..store import CheckpointStore
from ..types import CheckpointCorrupt, CheckpointInfo, PendingCheckpoint, TieredStore
from ..verify import newest_that_checks, verify_files
from .client import check_access, make_client
from .remote import MULTIPART_CHUNK, MULTIPART_THRESHOLD, RemoteCheckpoints, RemoteCommitError, RemoteManifest
from .durability import Durability
from .staging import stage_part
from .uploader import FAILED, OBJECT, RetryPolicy, Uploader
from .url import ObjectStoreURL

log = logging.getLogger(__name__)

LOCAL_DIR_ENV = "SPOTGUARD_LOCAL_CHECKPOINT_DIR"
DOWNLOADS = "downloads"  # <local>/_downloads/<tag>/: checkpoints downloaded for loading


def default_local_dir(url: ObjectStoreURL) -> Path:
    """`SPOTGUARD_LOCAL_CHECKPOINT_DIR`, else `<tmp>/spotguard-checkpoints/<bucket>-<hash of the URL>`."""
    configured = os.environ.get(LOCAL_DIR_ENV)
    if configured:
        return Path(configured)
    digest = hashlib.sha256(str(url).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "spotguard-checkpoints" / f"{url.bucket}-{digest}"


class ObjectCheckpointStore(TieredStore):
    """Checkpoints under `s3://bucket/prefix` with a local first tier; see the module docstring.

    `keep_last`: retention in both tiers (notice checkpoints are always kept). `endpoint_url`:
    an S3-compatible endpoint (see client.py for the other ways to set it). `lease_seconds`: how
    long a silent writer's uploads are protected from another process's cleanup.
    `commit_timeout`: how long rank 0's remote commit waits for the other ranks' parts.
    `multipart_threshold`: files above this size (bytes) are uploaded in parts.
    `retry`: how a failing upload is retried (uploader.py `RetryPolicy`: for 300 s, backoff 0.2-5 s).
    `max_queued_uploads` (>= 2; default `keep_last`, at least 2): the bound of the local tier: this
    rank's parts waiting or uploading at most (the oldest waiting one is dropped past it; uploader.py).
    """

    def __init__(self, location: str, keep_last: int = 3, *, local_dir: str | os.PathLike | None = None,
                 endpoint_url: str | None = None, lease_seconds: float = 60.0, commit_timeout: float = 600.0,
                 clean: bool = True, client: Any = None, multipart_threshold: int = MULTIPART_THRESHOLD,
                 retry: RetryPolicy | None = None, max_queued_uploads: int | None = None):
        self.keep_last = positive_int("keep_last", keep_last)
        self.url = ObjectStoreURL.parse(location)
        self.commit_timeout = positive_float("commit_timeout", commit_timeout)
        self.client = client if client is not None else make_client(endpoint_url)
        check_access(client if client is not None else make_client(endpoint_url, max_attempts=2), self.url)
        self.remote = RemoteCheckpoints(self.client, self.url,
                                        lease_seconds=positive_float("lease_seconds", lease_seconds),
                                        multipart_threshold=multipart_threshold,
                                        multipart_chunk=min(MULTIPART_CHUNK, max(multipart_threshold, 5 << 20)))
        self.base = Path(local_dir) if local_dir is not None else default_local_dir(self.url)
        try:
            self.local = CheckpointStore(self.base / "tier1", keep_last=self.keep_last, on_part=self._upload_part)
        except ConfigError as exc:
            raise ConfigError("local_dir", f"{self.base}: {exc.message}") from exc
        self.staging = self.base / "staging"
        self.staging.mkdir(exist_ok=True)
        queued = max(self.keep_last, 2) if max_queued_uploads is None else max_queued_uploads
        if positive_int("max_queued_uploads", queued) < 2:
            raise ConfigError("max_queued_uploads", "must be at least 2 (the part uploading and the newest)")
        self.uploader = Uploader(self.remote, retry=retry, max_queued_parts=queued)
        self.durability = Durability(self.remote)
        self._downloads = DerivedCopies(self.base, DOWNLOADS)
        self._download_mutex = threading.Lock()
        self._attempts: dict[str, str | None] = {}  # tag -> this rank's attempt at it (begin -> commit)
        self._attempts_mutex = threading.Lock()
        if clean:
            self.cleanup()

    def __repr__(self) -> str:
        return f"ObjectCheckpointStore({str(self.url)!r}, local={str(self.base)!r})"

    @property
    def root(self) -> Path:
        """The local tier's directory (where ranks write their files)."""
        return self.local.root

    @property
    def object_step(self) -> int | None:
        """The newest step this process knows committed in the object store (durability.py)."""
        return self.durability.object_step

    @property
    def metrics(self) -> Registry:
        """The uploads' metrics (failures, drops, what is queued): `metrics.render()` is Prometheus text."""
        return self.uploader.metrics.registry

    # ---- writing ---------------------------------------------------------------------------
    agrees_attempts = True  # adapters pass `begin(tag, attempt=...)` an id every rank of the save agreed on

    def begin(self, tag: str, attempt: str | None = None) -> PendingCheckpoint:
        """Opens the local tier's pending checkpoint of `tag` for this rank (see CheckpointStore.begin).

        `attempt`: the same id on every rank of this save (a fresh one per save): the remote
        commit then takes only parts of this attempt, never a part an earlier attempt at the same
        tag left (a slow rank's, a crashed writer's). Without it (a single writer, older callers)
        any complete set of parts is taken."""
        pending = self.local.begin(tag, attempt)
        with self._attempts_mutex:
            self._attempts[tag] = attempt
        return pending

    def _upload_part(self, pending: PendingDirectory, rank: int, part: Path) -> None:
        """The local tier's `on_part`: stages this rank's part and queues its upload (staging.py)."""
        stage_part(self.staging, self.remote, self.uploader, self.durability, pending, rank, part)

    def commit(self, tag: str, world_size: int, metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Rank 0, after every rank finished: commits locally when every part is on this disk, and
        queues the remote commit. Returns the local checkpoint, or (parts on several nodes) a
        description of the one being committed remotely (`sequence` 0)."""
        validate_tag(tag)
        world_size = positive_int("world_size", world_size)
        metadata = dict(metadata or {})
        with self._attempts_mutex:
            attempt = self._attempts.pop(tag, None)
        _, problems = collect_parts(self.local.root / f"{PENDING_PREFIX}{tag}", world_size)
        info: CheckpointInfo | None = None
        if not problems:
            info = self.local.commit(tag, world_size, metadata)
        else:
            log.info("checkpoint %s: parts are on several nodes; committing in the object store only", tag)
            self.local.release(tag)

        def commit_remote() -> RemoteManifest:
            if self.uploader.tier(tag) == FAILED:  # this process's part of it did not get there
                raise RemoteCommitError(f"{tag}: not committing to {self.url}: a part upload failed")
            remote = self.remote.commit(tag, world_size, metadata, timeout=self.commit_timeout, attempt=attempt)
            self.durability.committed(tag, metadata.get("step"))
            log.info("checkpoint %s committed to %s (sequence %d)", tag, self.url, remote.sequence,
                     extra={"tag": tag, "step": metadata.get("step")})
            self._remote_housekeeping(protect={tag})
            return remote

        self.uploader.submit(tag, commit_remote)
        if info is None:
            info = CheckpointInfo(tag=tag, dir=self._downloads.path(tag), sequence=0, world_size=world_size,
                                  metadata=metadata, files={})
        return info

    def _remote_housekeeping(self, protect: AbstractSet[str]) -> None:
        try:
            self.apply_retention(protect=protect)
            self.remote.cleanup(newest=None)
        except Exception as exc:  # the commit stands; the next commit or open tries again
            log.warning("housekeeping in %s failed: %s", self.url, exc)

    def durable_tier(self, tag: str) -> str | None:
        """The job's tier of checkpoint `tag` as this process knows it, without asking the bucket:
        "object" once the job's commit of it is known in the object store (this process committed
        it, or read its manifest: durability.py; never on this rank's uploaded part alone),
        "local" (on local disk, upload queued, running or failed: lost with the node), None."""
        if self.durability.is_committed(tag):
            return "object"
        if self.uploader.tier(tag) is not None or (self.local.root / tag).is_dir():
            return "local"
        return None

    def wait_durable(self, tag: str, timeout: float | None = None) -> str | None:
        """Waits up to `timeout` for this process's uploads, then (a rank that did not commit `tag`
        itself) for the job's commit of `tag` to appear in the bucket; returns `durable_tier(tag)`.
        Never holds the caller past `timeout` (a departing rank's deadline), even on a hung request."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.uploader.wait(timeout)
        if self.uploader.tier(tag) == OBJECT and not self.durability.is_committed(tag):
            left = self.commit_timeout if deadline is None else max(deadline - time.monotonic(), 0.0)
            self.durability.wait_committed(tag, left)
        return self.durable_tier(tag)

    def is_durable(self, step: int) -> bool:
        """Whether a checkpoint of `step` is committed in the object store now (reads the bucket): what
        survives the node. `durable_step()`: the newest such step."""
        return any(info.step == step for info in self.list())

    def durable_step(self) -> int | None:
        """The newest step committed in the object store now (reads the bucket), or None."""
        steps = [info.step for info in self.list() if info.step is not None]
        return max(steps) if steps else None

    def upload_failed(self, tag: str) -> bool:
        return self.uploader.tier(tag) == FAILED

    def add_failure_listener(self, listener: Callable[[str, BaseException], None]) -> None:
        """`listener(tag, error)` runs (on the upload thread) when an upload or commit failed for good
        (the adapters keep it in `async_error`)."""
        self.uploader.on_failure.append(listener)

    def wait_uploaded(self, timeout: float | None = None) -> bool:
        """Waits for the uploads queued so far; True when they all ended within `timeout`."""
        return self.uploader.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Waits for the uploads (up to `timeout`) and stops the uploader; True when all ended."""
        return self.uploader.close(timeout)

    # ---- reading ---------------------------------------------------------------------------
    def _info(self, remote: RemoteManifest) -> CheckpointInfo:
        m = remote.manifest
        return CheckpointInfo(tag=remote.tag, dir=self._downloads.path(remote.tag), sequence=remote.sequence,
                              world_size=int(m["world_size"]), metadata=dict(m.get("metadata") or {}),
                              files=dict(m["files"]), committed_at=float(m.get("committed_at", 0.0)),
                              fingerprint=remote.fingerprint)

    def read(self, tag: str) -> CheckpointInfo | None:
        """The complete checkpoint `tag` in the object store, or None (`dir`: where resolve puts it)."""
        remote = self.remote.read(validate_tag(tag))
        return self._info(remote) if remote is not None else None

    def list(self) -> list[CheckpointInfo]:
        """Every complete checkpoint in the object store, oldest first."""
        return [self._info(r) for r in self.remote.list()]

    def latest(self) -> CheckpointInfo | None:
        complete = self.list()
        return complete[-1] if complete else None

    def verify(self, info: CheckpointInfo) -> None:
        """Checksums of the downloaded copy (see CheckpointStore.verify)."""
        verify_files(info)

    @contextlib.contextmanager
    def _downloads_locked(self) -> Iterator[None]:
        """One downloader per node at a time (flock, other processes) and per process (mutex)."""
        with self._download_mutex:
            fd = os.open(self.base / ".downloads.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def materialize(self, info: CheckpointInfo) -> CheckpointInfo:
        """Downloads checkpoint `info` into `info.dir` unless this very commit is there already."""
        with self._downloads_locked():
            if self._downloads.lookup(info) is None:
                remote = self.remote.read(info.tag)
                if remote is None or remote.fingerprint != info.fingerprint:
                    raise CheckpointCorrupt(info.tag, ["it was replaced or deleted in the object store"])
                self._downloads.build(info, lambda work: self.remote.download(remote, work))
                log.info("downloaded checkpoint %s from %s (%.1f MB)", info.tag, self.url, info.size / 1e6)
        return info

    def resolve(self, verify: bool = True) -> CheckpointInfo | None:
        """The newest complete checkpoint of the object store, downloaded and (with `verify`)
        checksummed, falling back to older ones as CheckpointStore.resolve does."""
        candidates = self.list()

        def check(info: CheckpointInfo) -> None:
            self.materialize(info)
            if verify:
                self.verify(info)

        info = newest_that_checks(candidates, check)
        if info is not None:
            self._prune_downloads(candidates)
            self.durability.saw_step(info.step)
        return info

    # ---- housekeeping ------------------------------------------------------------------------
    def _prune_downloads(self, complete: builtins.list[CheckpointInfo]) -> builtins.list[str]:
        keep = complete[-self.keep_last:]
        with self._downloads_locked():
            return [name for area in derived_areas(self.base) for name in area.prune(keep)]

    def derived(self, kind: str) -> DerivedCopies:
        """Copies of kind `kind` made from downloaded checkpoints (`<local>/_<kind>/`, derived.py)."""
        return DerivedCopies(self.base, kind)

    def apply_retention(self, protect: AbstractSet[str] = frozenset()) -> builtins.list[str]:
        """Deletes object-store checkpoints beyond the newest `keep_last`, except notice ones; returns tags."""
        complete = self.remote.list()
        keep = {m.tag for m in complete[-self.keep_last:]} | set(protect)
        keep |= {m.tag for m in complete if (m.manifest.get("metadata") or {}).get("reason") == "notice"}
        removed = []
        for remote in complete:
            if remote.tag not in keep:
                self.remote.delete(remote.tag)
                removed.append(remote.tag)
        if removed:
            log.info("retention removed %s from %s", ", ".join(removed), self.url)
        return removed

    def cleanup(self) -> builtins.list[str]:
        """Cleans the local tier (CheckpointStore.cleanup), staging folders of dead uploaders, and the
        object store's leftovers of dead writers (remote.py); points `latest` at the newest."""
        removed: builtins.list[str] = self.local.cleanup()
        live = live_tags_reaping_dead(self.staging)
        for entry in self.staging.iterdir():
            if entry.is_dir() and not entry.name.startswith(".") and entry.name.rsplit(".", 2)[0] not in live:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(f"staging/{entry.name}")
        complete = self.list()
        cleaned = self.remote.cleanup(newest=complete[-1].tag if complete else None)
        if cleaned:
            log.warning("removed leftovers of interrupted uploads to %s: %s", self.url, ", ".join(cleaned))
        removed += [f"{self.url}/{tag}" for tag in cleaned]
        removed += self._prune_downloads(complete)
        return removed

    # ---- framework plug-ins: dcp.py, torchfile.py, torchshards.py write into any PendingCheckpoint --
    def dcp_writer(self, pending: PendingCheckpoint, **options: Any) -> Any:
        """Deprecated: `spotguard.hooks.checkpoint.dcp.StoreDcpWriter(pending, **options)`."""
        from ..dcp import deprecated_writer

        return deprecated_writer(pending, **options)

    def dcp_reader(self, info: CheckpointInfo, **options: Any) -> Any:
        """Deprecated: `spotguard.hooks.checkpoint.dcp.StoreDcpReader(info.dir, **options)`."""
        from ..dcp import deprecated_reader

        return deprecated_reader(info, **options)

    def deepspeed_engine(self, **options: Any) -> Any:
        return self.local.deepspeed_engine(**options)
