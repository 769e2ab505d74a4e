"""Checking committed checkpoints before a resume: every file's checksum, and the fallback to an
older checkpoint when the newest is damaged. Both stores resolve through `newest_that_checks`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from . import fsutil
from .types import CheckpointCorrupt, CheckpointInfo

log = logging.getLogger(__name__)


def verify_files(info: CheckpointInfo) -> None:
    """Recomputes the size and CRC-32 of every file of `info` under `info.dir`; raises
    CheckpointCorrupt listing the damage (missing, unreadable, wrong size or checksum)."""
    problems = []
    for name, entry in sorted(info.files.items()):
        path = info.dir / name
        try:
            size, crc = fsutil.file_crc32(path)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as exc:
            problems.append(f"{name} unreadable: {exc}")
            continue
        if size != entry["size"]:
            problems.append(f"{name} has {size} bytes, manifest says {entry['size']}")
        elif f"{crc:08x}" != entry["crc32"]:
            problems.append(f"{name} checksum {crc:08x} != {entry['crc32']}")
    if problems:
        raise CheckpointCorrupt(info.tag, problems)


def newest_that_checks(candidates: list[CheckpointInfo],
                       check: Callable[[CheckpointInfo], None]) -> CheckpointInfo | None:
    """The newest of `candidates` (oldest first) for which `check` (verify, or download and verify)
    raises no CheckpointCorrupt, falling back to older ones with a warning naming the damage.
    None when there are no candidates; CheckpointCorrupt when there are some but none checks
    (starting from scratch silently would throw training away)."""
    failures: list[CheckpointCorrupt] = []
    for info in reversed(candidates):
        try:
            check(info)
        except CheckpointCorrupt as exc:
            failures.append(exc)
            log.warning("checkpoint %s failed verification, falling back to an older one: %s", info.tag, exc,
                        extra={"tag": info.tag})
            continue
        if failures:
            log.warning("resuming from %s (step %s) instead of the damaged %s", info.tag, info.step,
                        ", ".join(f.tag for f in failures))
        return info
    if failures:
        raise CheckpointCorrupt(failures[0].tag, [f"no checkpoint verifies: {f}" for f in failures])
    return None
