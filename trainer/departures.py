"""The ranks' own account of their departures, as trainer events the report joins with the rest.

A rank that leaves for a notice writes its termination message (hooks/termination_message.py:
`notice_id`, `step`, `saved_step`, `checkpoint`, `exit_code`, and how it was saved: `saved_by`,
`margin_seconds`, `snapshot_steps`) to the file its kubelet gave it, right before it exits. The
deadline watchdog's departure writes nothing else (the process ends from its thread), so the
report reads every departure from there, whichever path saved.

`read_messages(pods_dir, pods)` reads each pod's file (`<pods_dir>/<pod>/termination-log`, as the
local kubelet lays it out: trainer/cluster/pod_runner.py) with the time it was written; a pod
whose node died has one too, though its dead kubelet reported nothing.
`departure_events(messages, events, kinds)`: per message that names a notice, one `left` event
`{"t": when the message was written, "notice_id", "kind", "step", "saved", "saved_by",
"margin_seconds", "snapshot_steps", "durable", "exit_code", "container_exit_code"}` (`exit_code`:
the code the rank said it leaves with; `container_exit_code`: the container's, None when its node
died, which a launcher such as torchrun makes its own) with the process fields (`generation`,
`node`, `group`, `rank`, `world_size`) of that pod's trainer, taken from its last event before the
message, so it belongs to that process's log (trainer.changes). The early exit's message (a
process that left before its Guard existed, step -1: a pod stopped during its start-up) is no
departure: that process was in no group. `step` and `saved` count
completed steps, as every trainer event does (a Guard step + 1). Nothing is derived: what the
message says, as it says it; a message that is not JSON, or names no notice, is no departure.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.trainer.cluster_log import PodLife

PROCESS_FIELDS = ("generation", "node", "group", "rank", "world_size")
ACCOUNT = ("saved_by", "margin_seconds", "snapshot_steps")
MESSAGE_FILE = "termination-log"


@dataclass(frozen=True)
class Message:
    """One pod's termination message as its rank wrote it."""

    pod: str
    node: str
    text: str
    written_at: float
    container_exit_code: int | None


def read_messages(pods_dir: Path, pods: Iterable[PodLife]) -> list[Message]:
    """See the module docstring (blocking: small local files)."""
    out = []
    for pod in pods:
        path = pods_dir / pod.name / MESSAGE_FILE
        try:
            text, written_at = path.read_text(errors="replace"), path.stat().st_mtime
        except OSError:
            continue
        if text and pod.node is not None:
            out.append(Message(pod.name, pod.node, text, written_at, pod.exit_code))
    return out


def departure_events(messages: Iterable[Message], events: Iterable[dict], kinds: Mapping[str, str]) -> list[dict]:
    """See the module docstring (`kinds`: notice id -> the injected event's kind)."""
    events = list(events)
    out = []
    for m in messages:
        message = _parsed(m.text)
        mine = [e for e in events if e.get("node") == m.node and e["t"] <= m.written_at]
        if message is None or not mine or _before_the_guard(message):
            continue  # not the Guard's, its trainer never logged, or it left before it had a Guard
        last = max(mine, key=lambda e: e["t"])
        left = {"t": m.written_at, "event": "left", **{k: last.get(k) for k in PROCESS_FIELDS},
                "notice_id": message["notice_id"], "kind": kinds.get(message["notice_id"]),
                "step": _done(message.get("step")), "saved": _done(message.get("saved_step")),
                "durable": message.get("checkpoint") == "durable", "exit_code": message.get("exit_code"),
                "container_exit_code": m.container_exit_code}
        left.update({k: message[k] for k in ACCOUNT if k in message})
        out.append(left)
    return out


def _parsed(text: str) -> dict[str, Any] | None:
    try:
        message = json.loads(text)
    except ValueError:
        return None
    return message if isinstance(message, dict) and isinstance(message.get("notice_id"), str) else None


def _before_the_guard(message: dict) -> bool:
    """The early exit's message (hooks/early_exit.py: step -1): a process that left before its
    Guard existed was in no group yet, so its leaving changed no membership."""
    step = message.get("step")
    return isinstance(step, int) and step < 0


def _done(step: Any) -> int | None:
    """Completed steps after Guard step `step` (None when the message has no such whole number)."""
    return step + 1 if isinstance(step, int) and not isinstance(step, bool) else None
