"""The trainer's event log: one JSON object per line, per rank, read back by the dry-run report.

Events the reference trainer writes (every one has `t` (wall-clock seconds), `rank`,
`world_size`, and `process_fields()`: `generation` (the launch epoch), `node`, `group`):
- `start`      {"step": first step of this run, "resumed_from": tag or null, "digest": state digest}
- `step`       {"step", "loss", "samples_per_s"} (every `log_every` steps)
- `agreed`     {"step", "notice_id", "kind", "deadline"}: all ranks agreed to act at this step
- `durable`    {"step", "tag", "seconds", "digest", "snapshot": bool}: the checkpoint is complete
- `drained`    {"step", "exit_code"}
- `snapshot`   {"step", "digest"}: the Guard holds an in-memory snapshot of this state
- `finished`   {"step"}
A process the deadline watchdog ends writes no `agreed` / `durable` / `drained`: the dry-run reads
its departure from its termination message (`trainer.departures`: `left` events).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping


def process_fields(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What every event of this process carries: `generation` (its container's launch epoch,
    `SPOTGUARD_GENERATION`), `node` (`SPOTGUARD_NODE`) and `group` (its launcher's rendezvous
    address, `MASTER_ADDR:MASTER_PORT`: trainer/rounds.py tells groups apart by it)."""
    env = os.environ if environ is None else environ
    return {"generation": int(env.get("SPOTGUARD_GENERATION", "0") or 0), "node": env.get("SPOTGUARD_NODE"),
            "group": f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"}


class EventLog:
    """Appends events to `path` (line-buffered; one writer per file). A None path logs nothing."""

    def __init__(self, path: str | os.PathLike | None, **common: Any):
        self.common = common
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        """Appends one event; `t` defaults to now (pass it for an event measured earlier)."""
        if self._file is not None:
            self._file.write(json.dumps({"t": time.time() if t is None else t, "event": event,
                                         **self.common, **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(directory: str | os.PathLike) -> Iterator[dict]:
    """Every event from every *.jsonl file in `directory`, in time order; torn last lines skipped."""
    events = [e for path in sorted(Path(directory).glob("*.jsonl")) for e in read_event_file(path)]
    events.sort(key=lambda e: e["t"])
    return iter(events)


def read_event_file(path: str | os.PathLike) -> list[dict]:
    """The events of one log, in the order written; torn lines skipped."""
    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a rank killed mid-write leaves a torn last line
        if isinstance(obj, dict) and "t" in obj and "event" in obj:
            events.append(obj)
    return events


class EventTail:
    """Follows every *.jsonl in a directory, parsing only lines added since the last `poll()`.

    A line still being written (no newline yet) waits for the next poll; torn lines are skipped.
    `milestones()` is the same minus the `step` events (a few dozen against thousands): what a
    loop that polls every 0.1 s scans, so it costs the same at step 10 and at step 10000.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.events: list[dict] = []
        self.milestone_events: list[dict] = []
        self._offsets: dict[Path, int] = {}

    def milestones(self) -> list[dict]:
        """Every event but `step` seen so far, in the order read (after a `poll()`)."""
        self.poll()
        return self.milestone_events

    def poll(self) -> list[dict]:
        """All events seen so far, in the order read (not sorted by time)."""
        if not self.directory.exists():
            return self.events
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path] = offset + end + 1
            for line in chunk[: end + 1].splitlines():
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict) and "t" in obj and "event" in obj:
                    self.events.append(obj)
                    if obj["event"] != "step":
                        self.milestone_events.append(obj)
        return self.events
