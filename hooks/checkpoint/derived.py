"""Copies derived from committed checkpoints (DeepSpeed's universal form): made from exactly one
commit, complete or invisible, removed with their source.

Layout under the store root: `_<kind>/` holds a marker `.spotguard-derived` (so the store finds
it) and, per checkpoint tag, `<tag>/`: the copy, with `spotguard-source.json` written last
({"tag", "fingerprint"}: the SHA-256 of the source's manifest, which differs for every commit,
re-commits of a tag included). Hidden names in `_<kind>/` are copies being built
(`.build-<tag>-<id>`, each under a writer lock held by its builder, see locks.py) or being
deleted (`.trash-*`).

- `lookup(info)`: the copy made from exactly the commit `info`, else None (a copy of an earlier
  commit under the same tag, or one without its source record, is never reused);
- `build(info, make)`: `make(dir)` fills a fresh hidden dir; its files are fsynced, the source
  record written, and it replaces `<tag>/` by rename. A crash or an error leaves no visible
  partial copy; a stale `<tag>/` is renamed to trash before it is deleted;
- `prune(keep)`: removes every copy not made from one of the commits `keep`, and the build dirs
  of dead builders. The store calls it from retention and from cleanup at open.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable, Iterable

from . import fsutil
from .locks import WriterLock, live_tags_reaping_dead, store_lock
from .manifest import TRASH_PREFIX, aside_name, tag_of_aside
from .types import CheckpointInfo

MARKER = ".spotguard-derived"
SOURCE = "spotguard-source.json"
BUILD_PREFIX = ".build-"


class DerivedCopies:
    """`<root>/_<kind>/<tag>/`: one derived copy per checkpoint tag; see the module docstring."""

    def __init__(self, root: str | os.PathLike, kind: str):
        if not kind or not kind.replace("_", "").isalnum():
            raise ValueError(f"invalid kind of derived copy {kind!r}: use letters, digits and '_'")
        self.kind = kind
        self.dir = Path(root) / f"_{kind}"

    def path(self, tag: str) -> Path:
        """Where the copy of `tag` lives once built."""
        return self.dir / tag

    def source_of(self, copy: Path) -> str | None:
        """The fingerprint of the commit `copy` was made from, or None without a readable record."""
        try:
            record = json.loads((copy / SOURCE).read_bytes())
            return record["fingerprint"] if record.get("tag") == copy.name else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def lookup(self, info: CheckpointInfo) -> Path | None:
        """The copy of exactly the commit `info`, or None."""
        copy = self.path(info.tag)
        return copy if info.fingerprint and self.source_of(copy) == info.fingerprint else None

    def build(self, info: CheckpointInfo, make: Callable[[Path], None]) -> Path:
        """Runs `make(dir)` on a hidden dir and publishes it as the copy of `info`; returns its path."""
        if not info.fingerprint:
            raise ValueError(f"checkpoint {info.tag} has no fingerprint; read it through the store")
        fsutil.makedirs_durable(self.dir)
        if not (self.dir / MARKER).exists():
            fsutil.write_file_atomic(self.dir / MARKER, b"")
        with store_lock(self.dir, exclusive=False):
            lock = WriterLock(self.dir, info.tag)
            work = self.dir / aside_name(BUILD_PREFIX, info.tag)
            work.mkdir()
        stale = None
        try:
            make(work)
            fsutil.fsync_tree(work)
            record = {"tag": info.tag, "fingerprint": info.fingerprint, "sequence": info.sequence}
            fsutil.write_file_atomic(work / SOURCE, json.dumps(record).encode())
            final = self.path(info.tag)
            with store_lock(self.dir, exclusive=False):  # no prune between the two renames
                if os.path.lexists(final):
                    stale = self.dir / aside_name(TRASH_PREFIX, info.tag)
                    os.rename(final, stale)
                os.rename(work, final)
                fsutil.fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            lock.release()
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def prune(self, keep: Iterable[CheckpointInfo]) -> list[str]:
        """Removes copies not made from one of the commits `keep`, and dead builders' dirs; returns names."""
        if not self.dir.is_dir():
            return []
        wanted = {info.tag: info.fingerprint for info in keep if info.fingerprint}
        removed = []
        with store_lock(self.dir, exclusive=True):
            live = live_tags_reaping_dead(self.dir)
            for entry in self.dir.iterdir():
                name = entry.name
                building = tag_of_aside(BUILD_PREFIX, name)
                if building is not None:
                    if building in live:
                        continue
                elif not name.startswith(TRASH_PREFIX):
                    if name.startswith(".") or (name in wanted and self.source_of(entry) == wanted[name]):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        trash = self.dir / aside_name(TRASH_PREFIX, name)
                        os.rename(entry, trash)  # never a visible copy half deleted
                        entry = trash
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        entry.unlink()
                removed.append(name)
            if removed:
                fsutil.fsync_dir(self.dir)
        return removed


def derived_areas(root: str | os.PathLike) -> list[DerivedCopies]:
    """Every `_<kind>/` area under `root` (those holding the marker)."""
    root = Path(root)
    return [DerivedCopies(root, entry.name[1:]) for entry in root.iterdir()
            if entry.name.startswith("_") and (entry / MARKER).is_file()]
