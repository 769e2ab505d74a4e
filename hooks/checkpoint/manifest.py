"""Names in a store's root and the reading of checkpoint manifests (shared by the store and its recovery).

A directory holds a complete checkpoint of `tag` when its `spotguard-manifest.json` parses, has
this format version and names `tag`, and (for `read_complete`) every file it lists exists with
the recorded size. A manifest is only ever written after every rank's part was checked, so a
directory that passes `read_complete` was a decided commit, wherever it lies.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

MANIFEST = "spotguard-manifest.json"
PART_PREFIX = ".spotguard-part-"
PENDING_PREFIX = ".pending-"
TRASH_PREFIX = ".trash-"
REPLACED_PREFIX = ".replaced-"
LATEST = "latest"
MANIFEST_VERSION = 1
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def validate_tag(tag: str) -> str:
    """Returns `tag` if it is a safe directory name (letters, digits, `_ . -`), else ValueError."""
    if not isinstance(tag, str) or not TAG_RE.match(tag) or tag in (LATEST, MANIFEST):
        raise ValueError(f"invalid checkpoint tag {tag!r}: use letters, digits, '_', '.', '-' "
                         "(not starting with '.' or '-')")
    return tag


def read_manifest(directory: Path, tag: str) -> tuple[dict[str, Any], bytes]:
    """(manifest, its raw bytes) of `directory`; FileNotFoundError/NotADirectoryError when absent,
    ValueError when unreadable or not a manifest of `tag` in this format."""
    raw = (directory / MANIFEST).read_bytes()
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("v") != MANIFEST_VERSION or manifest.get("tag") != tag:
        raise ValueError(f"unexpected manifest version/tag in {directory}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("sequence"), int):
        raise ValueError(f"manifest in {directory} lacks files or sequence")
    return manifest, raw


def read_complete(directory: Path, tag: str) -> dict[str, Any] | None:
    """The manifest of `directory` if it is a complete checkpoint of `tag` (files present, sizes
    as recorded; no checksum pass), else None."""
    try:
        manifest, _ = read_manifest(directory, tag)
        for name, entry in manifest["files"].items():
            if (directory / name).stat().st_size != int(entry["size"]):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def fingerprint(raw_manifest: bytes) -> str:
    """The identity of one commit: SHA-256 of its manifest (which holds sequence, time and every CRC)."""
    return hashlib.sha256(raw_manifest).hexdigest()


def aside_name(prefix: str, name: str) -> str:
    """A fresh hidden name `<prefix><name>-<8 hex>` for a directory set aside or being deleted."""
    return f"{prefix}{name}-{uuid.uuid4().hex[:8]}"


def tag_of_aside(prefix: str, name: str) -> str | None:
    """`<name>` of an `aside_name(prefix, name)`, or None when `name` is not one."""
    if not name.startswith(prefix):
        return None
    base, sep, suffix = name[len(prefix):].rpartition("-")
    return base if sep and len(suffix) == 8 and TAG_RE.match(base) else None


def merge_parts(world_size: int, read_part: Callable[[int], dict[str, Any] | str],
                size_of: Callable[[Mapping[str, Any], str], int | None],
                where: Callable[[Mapping[str, Any], str], dict[str, Any]] = lambda part, name: {},
                ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every rank's part manifest merged into one file table (each entry gains its `rank`, and what
    `where(part, name)` adds), each file checked against `size_of(part, name)` (None: missing);
    and the problems found (a part `read_part(rank)` could not give, which it says as a string; a
    file recorded twice, missing, or of another size). Commit only when the problems are none."""
    files: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for rank in range(world_size):
        part = read_part(rank)
        if isinstance(part, str):
            problems.append(part)
            continue
        for name, entry in part.get("files", {}).items():
            if name in files:
                problems.append(f"{name} recorded by rank {files[name]['rank']} and rank {rank}")
                continue
            actual = size_of(part, name)
            if actual is None:
                problems.append(f"{name} (rank {rank}) is missing")
                continue
            if actual != entry["size"]:
                problems.append(f"{name} (rank {rank}) has {actual} bytes, part manifest says {entry['size']}")
            files[name] = {**entry, "rank": rank, **where(part, name)}
    return files, problems


def collect_parts(pending_dir: Path, world_size: int) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """`merge_parts` over the part manifests and files in `pending_dir`."""
    def read_part(rank: int) -> dict[str, Any] | str:
        part_path = pending_dir / f"{PART_PREFIX}{rank}.json"
        try:
            return json.loads(part_path.read_bytes())
        except FileNotFoundError:
            return f"rank {rank} has not finished (no {part_path.name})"
        except ValueError as exc:
            return f"rank {rank}'s part manifest is unreadable: {exc}"

    def size_of(_part: Mapping[str, Any], name: str) -> int | None:
        try:
            return (pending_dir / name).stat().st_size
        except FileNotFoundError:
            return None

    return merge_parts(world_size, read_part, size_of)
