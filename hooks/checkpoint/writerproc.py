"""The separate writer process of the fast path (mode="process").

Run as `python -m spotguard.hooks.checkpoint.writerproc THREADS`. Protocol on stdin/stdout,
one JSON object per line: first `{"ready": pid}` from the child, then request
`{"shm": name, "jobs": [[path, start, end], ...]}`, answer `{"ok": [[size, crc32], ...]}` or
`{"error": "text"}`. It writes each byte range of the named shared-memory segment to its file (in
parallel, fsynced) and never unlinks the segment: the parent owns it. EOF on stdin ends the process.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

from .rawformat import write_pieces


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pool = ThreadPoolExecutor(int(argv[0]) if argv else 4)
    attached: dict[str, shared_memory.SharedMemory] = {}
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            name = request["shm"]
            if name not in attached:
                attached[name] = shared_memory.SharedMemory(name=name)
                # the parent owns the segment: untrack it so this process's exit does not unlink it.
                # `_name` (the tracker's key) is private, so typeshed leaves it out; 3.13's track=False
                # replaces this.
                resource_tracker.unregister(attached[name]._name, "shared_memory")  # type: ignore[attr-defined]
            view = attached[name].buf
            if view is None:
                raise ValueError(f"shared memory {name} is closed")
            futures = [pool.submit(write_pieces, Path(p), [view[a:b]]) for p, a, b in request["jobs"]]
            answer: dict[str, Any] = {"ok": [list(f.result()) for f in futures]}
        except Exception as exc:  # reported to the parent; the loop goes on
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    pool.shutdown()
    for shm in attached.values():
        shm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
