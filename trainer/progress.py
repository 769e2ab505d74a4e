"""The dry-run's live view: nodes, their notices, the job's world size, step and throughput.

Rendered with rich at a few frames per second from the same sources the report uses (the
agents' live notice tables, the supervisor's record and memberships, the trainers' event logs);
it never writes anything the run depends on.
"""
from __future__ import annotations

import time

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from spotguard.trainer.events import read_events


class LiveView:
    def __init__(self, scenario, refresh: float = 0.25):
        self.scenario = scenario
        self.refresh = refresh
        self._live = Live(Text("starting..."), refresh_per_second=8, transient=False)
        self._last = 0.0

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)

    def update(self, dry) -> None:
        now = time.monotonic()
        if now - self._last < self.refresh:
            return
        self._last = now
        self._live.update(self.render(dry))

    def render(self, dry) -> Group:
        events = list(read_events(dry.run_dir / "events")) if (dry.run_dir / "events").exists() else []
        steps = [e for e in events if e["event"] == "step" and e.get("rank") == 0]
        last = steps[-1] if steps else None
        started = dry.started_at or time.time()
        head = Text.assemble(
            ("spotguard dry-run ", "bold"), (f"{self.scenario.name} ", "cyan"),
            f"t={time.time() - started:5.1f}s  ", (dry.status, "yellow"), "  policy ",
            (f"{self.scenario.policy}/{dry.supervisor_log.snapshot()[2].phase}", "magenta"))
        job = Table(show_header=True, header_style="bold", box=None)
        for col in ("generation", "world size", "step", "of", "samples/s", "loss"):
            job.add_column(col)
        job.add_row(str(last.get("generation", 0)) if last else "-", str(len(dry.world)),
                    str(last["step"]) if last else "-", str(self.scenario.steps),
                    f"{last['samples_per_s']:.0f}" if last and last.get("samples_per_s") else "-",
                    f"{last['loss']:.4f}" if last else "-")
        nodes = Table(show_header=True, header_style="bold", box=None)
        for col in ("node", "state", "live notices"):
            nodes.add_column(col)
        world = dry.world
        for name, node in dry.nodes.items():
            state = "training" if name in world else ("gone" if not node.alive else "available")
            notices = ", ".join(f"{n.kind.value}({n.source})" for n in node.live_notices()) or "-"
            nodes.add_row(name, state, notices)
        recent = Table(show_header=False, box=None)
        for inj in dry.injected[-5:]:
            recent.add_row(f"t={inj.at:5.1f}s", f"{inj.kind} on {inj.node}", inj.note)
        for e in [e for e in events if e["event"] in ("agreed", "durable", "drained", "start")][-6:]:
            recent.add_row(f"t={e['t'] - started:5.1f}s", f"gen{e.get('generation')} rank{e.get('rank')} {e['event']}",
                           f"step {e.get('step')}")
        return Group(head, job, nodes, Text("recent", style="bold"), recent)
