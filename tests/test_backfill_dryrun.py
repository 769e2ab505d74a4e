"""The dry-run's backfill mode (trainer/backfill_run.py), real processes: a reclaim notice starts
an on-demand replacement at once (warm standby) that joins in place; the spot node is back as
soon as its rank has left (while the replacement still starts: no spot joiner beyond max), and
once it has been free for return-after and the replacement is a member, a spot joiner takes the
on-demand member's place in ONE membership, which the ranks carry out in place at one agreed
step. Nothing relaunches, the world never exceeds max, and the node-seconds split counts the
on-demand stint. The run is cancelled once the swap-back happened (every process ends).

Three worker start-ups in a row (the job, the replacement, the spot joiner) make its time."""
from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from spotguard.supervisor.backfill import plan
from spotguard.trainer.backfill_run import BackfillDryRun
from spotguard.trainer.scenario import Scenario, ScenarioEvent
from spotguard.wire.names import EXIT_PREEMPTED

WAIT = 240.0  # bound on the whole story on a loaded machine


@pytest.mark.timeout(360)
async def test_warm_standby_joins_and_is_swapped_back_for_spot_in_place(tmp_path):
    scenario = Scenario(name="backfill", workers=2, steps=100000, step_seconds=0.05,
                        events=(ScenarioEvent(at=0.5, kind="reclaim", node="node-1", lead=5.0),
                                # injected once node-1's rank has left (DryRun._until_gone)
                                ScenarioEvent(at=1.0, kind="capacity", node="node-1")))
    dry = BackfillDryRun(scenario, tmp_path, ["--log-every=1"], time_limit=WAIT, fallback_after=60.0,
                         return_after=1.0)
    run = asyncio.create_task(dry.run())

    async def until(what: str, check):
        deadline = time.monotonic() + WAIT
        while not check():
            assert not run.done(), f"the dry-run ended ({dry.status}) before {what}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.2)

    def hosts() -> list[list[str]]:
        return [m.hosts for m in dry.memberships]

    try:
        await until("the on-demand replacement joined", lambda: ["node-0", "od-0"] in hosts())
        await until("the swap-back", lambda: hosts()[-1] == ["node-0", "node-1"] and "od-0" not in dry.world)
        swapped_at = dry.memberships[-1].t
        await until("the ranks carried out the swap", lambda: swap_done(dry, swapped_at))
    finally:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert hosts()[0] == ["node-0", "node-1"]
    swap = hosts().index(["node-0", "node-1"], 1)
    assert hosts()[swap - 1] == ["node-0", "od-0"]  # one membership: node-1 in, od-0 out
    assert all(len(h) <= 2 for h in hosts())
    assert len(dry.generations) == 1  # nothing relaunched
    assert any("warm standby" in s["reason"] for s in dry.backfill_steps)
    spot_starts = [s["t"] for s in dry.backfill_steps if "node-1" in s["start"]]
    assert len(spot_starts) == 1 and spot_starts[0] >= dry.memberships[swap - 1].t  # after od-0 joined
    split = dry.node_seconds(dry.memberships[0].t, time.time())
    assert split["on-demand"] > 0 and split["spot"] > 0
    resized, joined = swap_done(dry, swapped_at)
    assert resized["from_world"] == resized["to_world"] == 2  # never below the size it had
    assert joined["step"] == resized["step"]  # 0 steps lost: the spot joiner starts at the agreed step
    assert dry.generation is not None and dry.generation.running["od-0"].process.returncode == EXIT_PREEMPTED


def swap_done(dry: BackfillDryRun, since: float) -> tuple[dict, dict] | None:
    """node-0's in-place change to the swap's membership and node-1's joined start, once the
    ranks did both and od-0's rank left; else None."""
    events = [e for e in dry._events() if e["t"] >= since]
    resized = [e for e in events if e["event"] == "resized" and e["node"] == "node-0" and e["reason"] == "membership"]
    joined = [e for e in events if e["event"] == "start" and e["node"] == "node-1" and e.get("joined")]
    gen = dry.generation
    left = gen is not None and "od-0" in gen.running and gen.running["od-0"].process.returncode is not None
    return (resized[-1], joined[-1]) if resized and joined and left else None


def test_a_member_whose_rank_left_before_the_run_looked_still_gets_its_warm_standby(tmp_path):
    """The rank on node-1 saw its reclaim notice and left within one tick of the run's loop: the
    next plan still counts it as leaving (the notice asks for its replacement), so an on-demand
    warm standby starts now, not after fallback-after. No processes: the view and the plan only."""
    dry = BackfillDryRun(Scenario(name="backfill", workers=2, steps=10, step_seconds=0.05), tmp_path,
                         fallback_after=60.0, return_after=1.0)
    dry.world = ["node-0"]
    dry.available.remove("node-1")  # reclaimed
    dry._standby_owed.add("node-1")  # what injecting its notice while it was a member records
    step = plan(dry.settings, dry._view(), dry.clocks, datetime.now(UTC))
    assert step.add_on_demand == 1 and "warm standby" in step.reason
    dry._standby_owed.clear()  # once a plan has seen it: below max, on-demand waits for fallback-after
    assert plan(dry.settings, dry._view(), dry.clocks, datetime.now(UTC)).add_on_demand == 0
