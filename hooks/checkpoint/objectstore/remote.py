"""Checkpoints as objects under `s3://bucket/prefix`: complete or invisible on a store without rename.

Layout (keys under the prefix):
- `<tag>/.u-<upload id>/<file>`: the files one rank uploaded in one attempt (a fresh id per
  upload, so two attempts at one tag never write the same object), uploaded first (multipart above
  the transfer threshold); `<tag>/.spotguard-part-<rank>.json`: each rank's part manifest, put
  after its files, naming their folder (`prefix`) and the commit `attempt` it belongs to (an id
  every rank of one save agreed on; None when the writer did not agree one);
- `<tag>/.spotguard-dropped-<rank>.json`: that rank dropped its queued part of this attempt (its
  local tier was full, uploader.py): the commit gives up at once instead of waiting for it;
- `<tag>/spotguard-manifest.json`: written last, by rank 0, once every rank's part of this attempt
  is there and every listed object has its recorded size; it records the `attempt` (how the other
  ranks know the commit took their part: durability.py); each file's entry names its `object`
  (checkpoints written before per-upload folders have none: the file is `<tag>/<file>`). A tag
  with this object is a complete checkpoint; without it the tag is invisible: listing, loading and
  retention read manifests only. A part of another attempt (a slow rank's previous one, a crashed
  writer's) is never taken: the commit waits for this attempt's part. After a commit the tag's
  objects it does not name (earlier attempts) are deleted;
- `latest`: the newest complete tag, put after its manifest (a hint; the manifests are the truth);
- `.writers/<id>`: a live writer's lease (JSON `{"tags": [...]}`), re-put while it uploads.

A re-commit of a tag first deletes its manifest (the old copy becomes invisible), then uploads.
Retention deletes the manifest first, then the data. `cleanup` deletes the objects of every tag
without a manifest and aborts the multipart uploads of every tag, unless a writer lease fresher
than `lease_seconds` (by the server's clock) names that tag: a crashed writer's leftovers go on
the next open after its lease ran out.
"""
from __future__ import annotations

import concurrent.futures
import email.utils
import json
import logging
import os
import time
import uuid
import builtins
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import fsutil
from ..types import CheckpointCorrupt
from ..manifest import LATEST, MANIFEST, MANIFEST_VERSION, PART_PREFIX, TAG_RE, fingerprint, merge_parts
from .url import ObjectStoreURL

log = logging.getLogger(__name__)

WRITERS = ".writers"
DROPPED_PREFIX = ".spotguard-dropped-"  # <tag>/.spotguard-dropped-<rank>.json: that rank dropped its queued part
UPLOAD_PREFIX = ".u-"  # <tag>/.u-<upload id>/: one rank's files of one attempt
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 32 << 20


class RemoteCommitError(Exception):
    """A remote commit was refused or timed out (a rank's part missing or inconsistent); nothing became visible."""

    retriable = False  # trying the same commit again would wait for the same parts


@dataclass(frozen=True)
class RemoteManifest:
    """One complete checkpoint in the object store: its manifest and that manifest's raw bytes."""

    manifest: dict[str, Any]
    raw: bytes

    @property
    def tag(self) -> str:
        return str(self.manifest["tag"])

    @property
    def sequence(self) -> int:
        return int(self.manifest["sequence"])

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.raw)


def transfer_config(max_concurrency: int = 8, multipart_threshold: int = MULTIPART_THRESHOLD,
                    multipart_chunk: int = MULTIPART_CHUNK) -> Any:
    """boto3's TransferConfig for checkpoint files: multipart above 64 MiB, 32 MiB parts by default."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunk,
                          max_concurrency=max_concurrency, use_threads=True)


class RemoteCheckpoints:
    """The object-store side of the store: see the module docstring for the layout and the order."""

    def __init__(self, client: Any, url: ObjectStoreURL, *, lease_seconds: float = 60.0, file_workers: int = 4,
                 multipart_threshold: int = MULTIPART_THRESHOLD, multipart_chunk: int = MULTIPART_CHUNK):
        self.client = client
        self.url = url
        self.lease_seconds = lease_seconds  # the server's clock counts whole seconds: keep this well above 1
        self.file_workers = file_workers
        self._transfer = transfer_config(multipart_threshold=multipart_threshold, multipart_chunk=multipart_chunk)

    # ---- keys ------------------------------------------------------------------------------------
    def key(self, tag: str, name: str) -> str:
        return self.url.key(tag, name)

    def _tag_of(self, key: str) -> str | None:
        rest = key[len(self.url.root_key):]
        tag, sep, _ = rest.partition("/")
        return tag if sep and TAG_RE.match(tag) else None

    def _objects(self) -> tuple[dict[str, int], dict[str, float], float]:
        """({key: size}, {key: last-modified epoch}) of every object under the prefix, and the server's time."""
        sizes: dict[str, int] = {}
        modified: dict[str, float] = {}
        server_now = time.time()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.url.bucket, Prefix=self.url.root_key):
            date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            if date:
                server_now = email.utils.parsedate_to_datetime(date).timestamp()
            for obj in page.get("Contents", []):
                sizes[obj["Key"]] = int(obj["Size"])
                modified[obj["Key"]] = obj["LastModified"].timestamp()
        return sizes, modified, server_now

    def _get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.url.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        except Exception as exc:  # some servers answer a missing key with a bare 404
            if getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise

    def _put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.url.bucket, Key=key, Body=body)

    def _delete(self, keys: Iterable[str]) -> None:
        batch = sorted(set(keys))
        for i in range(0, len(batch), 1000):
            chunk = batch[i:i + 1000]
            self.client.delete_objects(Bucket=self.url.bucket,
                                       Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})

    # ---- writer leases ---------------------------------------------------------------------------
    def put_lease(self, writer: str, tags: Iterable[str]) -> None:
        """(Re-)puts writer `writer`'s lease naming the tags it may still upload into."""
        self._put(self.url.key(WRITERS, writer), json.dumps({"tags": sorted(set(tags))}).encode())

    def drop_lease(self, writer: str) -> None:
        self._delete([self.url.key(WRITERS, writer)])

    def _live_tags(self, modified: Mapping[str, float], server_now: float) -> set[str]:
        live: set[str] = set()
        lease_prefix = self.url.key(WRITERS) + "/"
        for key, when in modified.items():
            if key.startswith(lease_prefix) and server_now - when < self.lease_seconds:
                raw = self._get(key)
                try:
                    live.update(json.loads(raw or b"{}").get("tags", []))
                except (ValueError, AttributeError):
                    continue
        return live

    # ---- writing ---------------------------------------------------------------------------------
    @staticmethod
    def upload_prefix() -> str:
        """A fresh folder (`.u-<id>/`) for one rank's files of one upload."""
        return f"{UPLOAD_PREFIX}{uuid.uuid4().hex[:12]}/"

    def begin_part(self, tag: str, rank: int) -> None:
        """Before a rank uploads into `tag`: the old manifest (a re-commit), this rank's old part and
        its note of a dropped part go first."""
        self._delete([self.key(tag, MANIFEST), self.key(tag, f"{PART_PREFIX}{rank}.json"),
                      self.key(tag, f"{DROPPED_PREFIX}{rank}.json")])

    def put_dropped(self, tag: str, rank: int, attempt: str | None) -> None:
        """Rank `rank` dropped its queued part of `tag` (attempt `attempt`): the commit stops waiting for it."""
        self._put(self.key(tag, f"{DROPPED_PREFIX}{rank}.json"), json.dumps({"attempt": attempt}).encode())

    def _dropped_ranks(self, tag: str, world_size: int, sizes: Mapping[str, int], attempt: str | None) -> list[int]:
        """The ranks whose part of `tag` (of `attempt`, when given) was dropped before its upload."""
        dropped = []
        for rank in range(world_size):
            key = self.key(tag, f"{DROPPED_PREFIX}{rank}.json")
            if key in sizes and self.key(tag, f"{PART_PREFIX}{rank}.json") not in sizes:
                try:
                    noted = json.loads(self._get(key) or b"{}").get("attempt")
                except (ValueError, AttributeError):
                    noted = None
                if attempt is None or noted == attempt:
                    dropped.append(rank)
        return dropped

    def upload_files(self, tag: str, files: Mapping[str, Path], prefix: str = "") -> int:
        """Uploads {name: local path} into `tag/<prefix>` (multipart for large files, several at
        once); bytes sent. `prefix`: `upload_prefix()` of this upload."""
        def one(item: tuple[str, Path]) -> int:
            name, path = item
            self.client.upload_file(str(path), self.url.bucket, self.key(tag, prefix + name), Config=self._transfer)
            return os.path.getsize(path)

        if not files:
            return 0
        with concurrent.futures.ThreadPoolExecutor(min(self.file_workers, len(files))) as pool:
            return sum(pool.map(one, sorted(files.items())))

    def put_part(self, tag: str, rank: int, part_raw: bytes, *, prefix: str = "", attempt: str | None = None) -> None:
        """Puts rank `rank`'s part manifest (after its files), naming the folder its files went to
        and the commit attempt it belongs to."""
        part = json.loads(part_raw)
        part.update(prefix=prefix, attempt=attempt)
        self._put(self.key(tag, f"{PART_PREFIX}{rank}.json"), json.dumps(part, sort_keys=True).encode())

    def _collect(self, tag: str, world_size: int, sizes: Mapping[str, int],
                 attempt: str | None) -> tuple[dict, list[str]]:
        """`merge_parts` over the uploaded parts of `tag` (of `attempt`, when given) and `sizes`."""
        def read_part(rank: int) -> dict[str, Any] | str:
            key = self.key(tag, f"{PART_PREFIX}{rank}.json")
            if key not in sizes:
                return f"rank {rank} has not uploaded its part"
            try:
                part = json.loads(self._get(key) or b"")
            except ValueError as exc:
                return f"rank {rank}'s part manifest is unreadable: {exc}"
            if attempt is not None and part.get("attempt") != attempt:
                return f"rank {rank}'s part is of attempt {part.get('attempt')}, not of this one ({attempt})"
            return part

        def object_of(part: Mapping[str, Any], name: str) -> str:
            return str(part.get("prefix") or "") + name

        return merge_parts(world_size, read_part, lambda part, name: sizes.get(self.key(tag, object_of(part, name))),
                           lambda part, name: {"object": object_of(part, name)} if part.get("prefix") else {})

    def commit(self, tag: str, world_size: int, metadata: Mapping[str, Any], *, timeout: float,
               attempt: str | None = None) -> RemoteManifest:
        """Waits (up to `timeout` s) for every rank's part (of `attempt`, when given), then writes
        the manifest and `latest`, and deletes the tag's objects the manifest does not name.

        RemoteCommitError when a part stays missing or inconsistent; nothing becomes visible then.
        """
        deadline = time.monotonic() + timeout
        pause = 0.02
        while True:
            sizes, _, _ = self._objects()
            files, problems = self._collect(tag, world_size, sizes, attempt)
            if not problems:
                break
            dropped = self._dropped_ranks(tag, world_size, sizes, attempt)
            if dropped:
                raise RemoteCommitError(f"{tag}: not committing to {self.url}: rank(s) {dropped} dropped their "
                                        "queued part (their local tier was full)")
            if time.monotonic() >= deadline:
                raise RemoteCommitError(f"{tag}: refusing to commit to {self.url}: " + "; ".join(problems))
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        sequence = 1 + max((m.sequence for m in self.list()), default=0)
        manifest = {"v": MANIFEST_VERSION, "tag": tag, "sequence": sequence, "world_size": world_size,
                    "committed_at": time.time(), "checksum": fsutil.CHECKSUM_ALGO, "metadata": dict(metadata),
                    "files": files}
        if attempt is not None:
            manifest["attempt"] = attempt  # how the other ranks know this commit took their part
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        self._put(self.key(tag, MANIFEST), raw)
        self._put(self.url.key(LATEST), tag.encode())
        named = {self.key(tag, MANIFEST)} | {self.key(tag, f"{PART_PREFIX}{rank}.json") for rank in range(world_size)}
        named |= {self._object_key(tag, name, entry) for name, entry in files.items()}
        try:
            self._delete(k for k in sizes if self._tag_of(k) == tag and k not in named)
        except Exception as exc:  # the commit stands; the next re-commit or retention removes them
            log.warning("checkpoint %s: earlier attempts' objects not deleted from %s: %s", tag, self.url, exc)
        return RemoteManifest(manifest, raw)

    def _object_key(self, tag: str, name: str, entry: Mapping[str, Any]) -> str:
        """The key of file `name` of a manifest (its `object`, or `<tag>/<name>` in the older layout)."""
        return self.key(tag, str(entry.get("object") or name))

    # ---- reading ---------------------------------------------------------------------------------
    def _parse(self, tag: str, raw: bytes | None) -> RemoteManifest | None:
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
            if (not isinstance(manifest, dict) or manifest.get("v") != MANIFEST_VERSION or manifest.get("tag") != tag
                    or not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("sequence"), int)):
                raise ValueError("unexpected manifest version, tag or fields")
        except ValueError as exc:
            log.warning("checkpoint %s in %s: manifest unreadable (%s); ignoring it", tag, self.url, exc)
            return None
        return RemoteManifest(manifest, raw)

    def read(self, tag: str) -> RemoteManifest | None:
        """The complete checkpoint `tag`, or None."""
        return self._parse(tag, self._get(self.key(tag, MANIFEST)))

    def list(self) -> list[RemoteManifest]:
        """Every complete checkpoint, oldest first (by commit sequence)."""
        sizes, _, _ = self._objects()
        found = []
        for key in sizes:
            tag = self._tag_of(key)
            if tag is not None and key == self.key(tag, MANIFEST):
                remote = self.read(tag)
                if remote is not None:
                    found.append(remote)
        found.sort(key=lambda m: (m.sequence, m.manifest.get("committed_at", 0.0), m.tag))
        return found

    def latest_hint(self) -> str | None:
        raw = self._get(self.url.key(LATEST))
        return raw.decode() if raw is not None else None

    def download(self, remote: RemoteManifest, dest: Path) -> None:
        """Downloads every file of `remote` into `dest` (fsynced), with its manifest."""
        def one(name: str) -> None:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            key = self._object_key(remote.tag, name, remote.manifest["files"][name])
            try:
                self.client.download_file(self.url.bucket, key, str(target), Config=self._transfer)
            except Exception as exc:
                status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (403, 404):  # this object is gone or unreadable: the checkpoint is damaged
                    what = "missing" if status == 404 else "unreadable (403)"
                    raise CheckpointCorrupt(remote.tag, [f"{name} is {what} in the object store ({key})"]) from exc
                raise

        names = sorted(remote.manifest["files"])
        if names:
            with concurrent.futures.ThreadPoolExecutor(min(self.file_workers, len(names))) as pool:
                list(pool.map(one, names))
        fsutil.write_file_synced(dest / MANIFEST, remote.raw)

    # ---- housekeeping ----------------------------------------------------------------------------
    def delete(self, tag: str) -> None:
        """Deletes checkpoint `tag`: its manifest first (invisible from then on), then its objects."""
        self._delete([self.key(tag, MANIFEST)])
        sizes, _, _ = self._objects()
        self._delete(k for k in sizes if self._tag_of(k) == tag)

    def cleanup(self, newest: str | None) -> builtins.list[str]:
        """Removes what dead writers left (see the module docstring), expired leases, and points
        `latest` at `newest`; returns the tags cleaned."""
        sizes, modified, server_now = self._objects()
        live = self._live_tags(modified, server_now)
        complete = {tag for key in sizes if (tag := self._tag_of(key)) is not None and key == self.key(tag, MANIFEST)}
        leftover = {tag for key in sizes if (tag := self._tag_of(key)) is not None} - complete - live
        self._delete(k for k in sizes if self._tag_of(k) in leftover)
        lease_prefix = self.url.key(WRITERS) + "/"
        self._delete(k for k, when in modified.items()
                     if k.startswith(lease_prefix) and server_now - when >= self.lease_seconds)
        aborted = self._abort_multipart(live)
        if newest is not None and self.latest_hint() != newest:
            self._put(self.url.key(LATEST), newest.encode())
        return sorted(leftover | aborted)

    def _abort_multipart(self, live: set[str]) -> set[str]:
        aborted: set[str] = set()
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.url.bucket, Prefix=self.url.root_key):
            for upload in page.get("Uploads", []) or []:
                tag = self._tag_of(upload["Key"])
                if tag is None or tag in live:
                    continue
                self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=upload["Key"],
                                                   UploadId=upload["UploadId"])
                aborted.add(tag)
        return aborted
