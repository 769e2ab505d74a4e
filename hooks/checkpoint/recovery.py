"""Finishing what a crash interrupted, so the newest complete copy of every tag is `<tag>/` again.

A commit of `<tag>` (store.py) passes through: pending dir without manifest -> pending dir with
a complete manifest (the commit is decided) -> an existing `<tag>/` renamed aside to
`.replaced-<tag>-<id>` -> pending dir renamed to `<tag>/` -> `latest` replaced -> the set-aside
copy deleted. A SIGKILL can stop it between any two of these, so at that moment the newest
complete copy of `<tag>` may be the pending dir or a set-aside copy, with no `<tag>/` at all.

- `recover_commits(root, live)`: for each tag, among `<tag>/`, its pending dir (unless a writer
  of that tag is alive) and its set-aside copies, the complete one (manifest.read_complete)
  with the highest commit sequence becomes `<tag>/`; a `<tag>/` that loses is set aside in
  turn. Each move is one rename, so a crash inside recovery leaves a state it finishes next
  time. The caller deletes what is left over only afterwards.
- `repair_latest(root, newest)`: `latest` names `newest` (atomically replaced when it does not).

Call both with the store lock held exclusive: then no commit is between two of its steps.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import fsutil
from .manifest import LATEST, PENDING_PREFIX, REPLACED_PREFIX, TAG_RE, aside_name, read_complete, tag_of_aside


def _candidates(root: Path, live: set[str]) -> dict[str, list[tuple[int, Path]]]:
    """Complete copies of each tag lying under a hidden name: {tag: [(sequence, dir), ...]}."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(PENDING_PREFIX):
            tag = name[len(PENDING_PREFIX):]
            if tag in live or not TAG_RE.match(tag):
                continue
        else:
            aside_tag = tag_of_aside(REPLACED_PREFIX, name)
            if aside_tag is None:
                continue
            tag = aside_tag
        manifest = read_complete(entry, tag)
        if manifest is not None:
            found.setdefault(tag, []).append((manifest["sequence"], entry))
    return found


def recover_commits(root: Path, live: set[str]) -> list[str]:
    """Makes the newest complete copy of every tag `<tag>/`; returns the moves made ("from -> tag")."""
    moves = []
    for tag, copies in sorted(_candidates(root, live).items()):
        sequence, best = max(copies, key=lambda c: c[0])
        target = root / tag
        current = read_complete(target, tag)
        if current is not None and current["sequence"] >= sequence:
            continue
        if os.path.lexists(target):
            os.rename(target, root / aside_name(REPLACED_PREFIX, tag))
        os.rename(best, target)
        fsutil.fsync_dir(root)
        moves.append(f"{best.name} -> {tag}")
    return moves


def repair_latest(root: Path, newest: str | None) -> bool:
    """Points `latest` at `newest` when it names something else; True when it was rewritten."""
    if newest is None:
        return False
    try:
        if (root / LATEST).read_bytes() == newest.encode():
            return False
    except FileNotFoundError:
        pass
    fsutil.write_file_atomic(root / LATEST, newest.encode())
    return True
