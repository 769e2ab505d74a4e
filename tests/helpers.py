"""Small helpers shared by tests (no fixtures here; see conftest.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from spotguard.agent.sources.base import Source
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Update, Withdrawal


async def next_update(source_iter, timeout: float = 5.0) -> Update:
    """The next update from a running `source.run()` iterator, or fail after `timeout` s."""
    return await asyncio.wait_for(source_iter.__anext__(), timeout)


async def poll_until(source: Source, predicate, timeout: float = 5.0, pause: float = 0.02) -> Any:
    """Calls `source.poll()` until predicate(result) is true; returns the result."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = await source.poll()
        except Exception as exc:  # the predicate decides what counts
            result = exc
        if predicate(result):
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{source.name}: condition not met within {timeout}s; last result {result!r}")
        await asyncio.sleep(pause)


def notices(updates: list[Update]) -> list[Notice]:
    return [u for u in updates if isinstance(u, Notice)]


def withdrawals(updates: list[Update]) -> list[Withdrawal]:
    return [u for u in updates if isinstance(u, Withdrawal)]


def drain_once(adapter: Any, notice: Notice, step: int, *, collectives: Any = None, reporter: Any = None,
               save_margin_seconds: float = 1.0) -> Any:
    """One agreed step that drains, as the Guard runs it (the agreed-step machine, with the
    departure of `exit_on_drain=False`): the step's record."""
    from spotguard.hooks.agreement.base import Verdict
    from spotguard.hooks.agreement.collectives import Collectives
    from spotguard.hooks.group_session import GroupSession
    from spotguard.hooks.machine.departure import ReturnToLoop
    from spotguard.hooks.machine.effects import Effects, Hooks
    from spotguard.hooks.machine.executor import AgreedStepMachine
    from spotguard.hooks.notice_gate import deadline_ts

    ranks = collectives if collectives is not None else Collectives()
    effects = Effects(lambda: adapter, lambda: ranks, lambda: None, lambda _id: None, lambda: None, Hooks(), reporter,
                      save_margin_seconds)
    machine = AgreedStepMachine(GroupSession(), effects, None, ReturnToLoop())
    return machine.run(step, Verdict(notice, deadline_ts(notice), 0)).drain


def dumped_stacks(run_dir: Path, lines: int = 120) -> dict[str, str]:
    """The end of each pod log of a dry-run that holds a stack dump (a rank still running at its
    node's death: `trainer.reaper.dump_stacks`), by file name."""
    from spotguard.trainer.cluster.pod_runner import LOG_DIR
    from spotguard.trainer.dryrun import STACK_DUMP

    logs = sorted((run_dir / LOG_DIR).glob("*.log")) if (run_dir / LOG_DIR).is_dir() else []
    texts = {path.name: path.read_text(errors="replace") for path in logs}
    return {name: "\n".join(text.splitlines()[-lines:]) for name, text in texts.items() if STACK_DUMP.search(text)}


async def passing_dry_run(scenario: Any, run_dir: Any, time_limit: float = 300.0) -> dict:
    """Runs `scenario` as a dry-run and returns its report, once no process it started is left
    (15 s at most for them to go) and it passed: finished, no problem, every step trained."""
    import time

    from spotguard.trainer.dryrun import DryRun
    from spotguard.trainer.reaper import marked

    dry = DryRun(scenario, run_dir, time_limit=time_limit)
    report = await dry.run()
    until = time.monotonic() + 15
    while marked(dry.marker) and time.monotonic() < until:
        await asyncio.sleep(0.2)
    assert marked(dry.marker) == []
    assert report["ok"] and report["status"] == "finished", (report["status"], report["problems"],
                                                             dumped_stacks(Path(run_dir)))
    assert report["steps_completed"] == scenario.steps
    return report
