"""trainer.events.EventTail: only lines added since the last poll are parsed, a line still being
written waits, torn lines are skipped, and `milestones()` is every event but `step`."""
from __future__ import annotations

import json

from spotguard.trainer.events import EventTail


def line(event: str, t: float, **extra) -> str:
    return json.dumps({"t": t, "event": event, **extra}) + "\n"


def test_the_tail_reads_new_lines_only_and_milestones_leave_steps_out(tmp_path):
    log = tmp_path / "gen0-node-0.jsonl"
    log.write_text(line("start", 1.0, rank=0) + line("step", 1.1, step=1) + '{"t": 1.2, "ev')
    tail = EventTail(tmp_path)
    assert [e["event"] for e in tail.poll()] == ["start", "step"]
    assert [e["event"] for e in tail.milestones()] == ["start"]
    with log.open("a") as f:  # the torn line ends, then more steps and a drain
        f.write('ent": "step"}\n' + "not json\n" + line("step", 1.3, step=2) + line("drained", 1.4, exit_code=83))
    (tmp_path / "gen0-node-1.jsonl").write_text(line("start", 1.05, rank=1))
    assert [e["event"] for e in tail.poll()] == ["start", "step", "step", "step", "drained", "start"]
    assert [(e["event"], e["t"]) for e in tail.milestones()] == [("start", 1.0), ("drained", 1.4), ("start", 1.05)]
    assert len(tail.poll()) == 6  # nothing new: nothing parsed twice
