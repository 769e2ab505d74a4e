"""One rank's part on its way to the object store: staged by hard link, then queued for upload.

`stage_part(...)` (the local tier's `on_part`, at `finish_rank`) hard-links the part's files into
`<staging>/<tag>.<rank>.<id>/` (so local commits and retention do not disturb the upload; the
staged links are what the local tier holds beyond its `keep_last` checkpoints), holds a writer
lock on the tag there (another process's `cleanup` leaves it alone), and queues the upload: a
fresh `.u-<id>/` folder, the files, the part manifest last (remote.py). The staged files go when
the upload ends, or when the uploader drops the queued part to keep the local tier within its
bound: then a note in the bucket tells the committing rank not to wait for this part.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from ..locks import WriterLock
from ..pending import PendingDirectory
from .durability import Durability
from .remote import RemoteCheckpoints
from .uploader import PART, Uploader

log = logging.getLogger(__name__)


def note_dropped(remote: RemoteCheckpoints, tag: str, rank: int, attempt: str | None) -> None:
    """Tells the committing rank (a note in the bucket) not to wait for this part; best effort, on
    its own thread so that the save that dropped it never waits for the network."""
    try:
        remote.put_dropped(tag, rank, attempt)
    except Exception as exc:  # the commit then waits until its timeout, as for a lost rank
        log.warning("cannot note the dropped part of %s in %s: %s", tag, remote.url, exc)


def stage_part(staging: Path, remote: RemoteCheckpoints, uploader: Uploader, durability: Durability,
               pending: PendingDirectory, rank: int, part: Path) -> None:
    """See the module docstring."""
    tag, attempt = pending.tag, pending.attempt
    lock = WriterLock(staging, tag)
    stage = staging / f"{tag}.{rank}.{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    files: dict[str, Path] = {}
    for name in pending.files:
        target = stage / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(pending.dir / name, target)
        files[name] = target
    part_raw = part.read_bytes()
    durability.part_staged(tag, attempt)

    def upload() -> int:
        prefix = remote.upload_prefix()
        remote.begin_part(tag, rank)
        sent = remote.upload_files(tag, files, prefix)
        remote.put_part(tag, rank, part_raw, prefix=prefix, attempt=attempt)
        return sent

    def release() -> None:
        shutil.rmtree(stage, ignore_errors=True)
        lock.release()

    def dropped() -> None:
        release()
        threading.Thread(target=note_dropped, args=(remote, tag, rank, attempt), name="spotguard-upload-dropped",
                         daemon=True).start()

    size = sum(int(entry["size"]) for entry in pending.files.values())
    uploader.submit(tag, upload, kind=PART, size=size, on_drop=dropped, on_end=release)
