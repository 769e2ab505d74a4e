"""The dry-run's backfill mode (trainer/backfill_run.py), real processes, the supervisor's own
backfill (placement.py, placer.py, in_place.py) deciding: a reclaim notice gets an on-demand
replacement placed at once (warm standby: the spare pod) that joins in place; the spot node is
back as soon as its rank has left, and once it has been free for return-after and the
replacement is a member, a spot pod takes the on-demand member's place in ONE membership, which
the ranks carry out in place at one agreed step. Nothing relaunches, the world never exceeds
max, and the node-seconds split counts the on-demand stint. The run is cancelled once the
swap-back happened, and nothing it started is left (the check of a cancelled run: until this
test made it, tests/test_dryrun_faults.py had a run of its own for it).

Three worker start-ups in a row (the job, the replacement, the spot joiner) make its time."""
from __future__ import annotations

import asyncio
import time

import pytest

from spotguard.trainer.backfill_run import BackfillDryRun
from spotguard.trainer.reaper import marked
from spotguard.trainer.scenario import Scenario, ScenarioEvent
from spotguard.wire.names import EXIT_PREEMPTED
from tests.test_dryrun_faults import nothing_left, still_running

WAIT = 240.0  # bound on the whole story on a loaded machine


@pytest.mark.timeout(420)
async def test_warm_standby_joins_and_is_swapped_back_for_spot_in_place(tmp_path):
    scenario = Scenario(name="backfill", workers=2, steps=100000, step_seconds=0.05)
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
        """Each membership's hosts by name: a membership lists them by pod index, and node-1 holds
        index 0 when it was Ready first (then od-0 takes index 0: [od-0, node-0], ci on df11f57)."""
        return [sorted(m.hosts) for m in dry.memberships]

    capacity: asyncio.Task | None = None
    try:
        # The job starts at min (1): whichever node is Ready first trains alone, the other joins.
        # Only once both ranks trained a step together is node-1 reclaimed, so the group it leaves
        # goes on (a reclaim of a first group of node-1 alone ended it: node-0 started a second
        # one, ci20 and ci27; a reclaim as soon as the membership of both was published came
        # before node-0 had joined: the same, ci on 923d249).
        await until("both spot nodes trained together", lambda: trained_together(dry, {"node-0", "node-1"}))
        await dry.injector.inject_now(ScenarioEvent(at=0.0, kind="reclaim", node="node-1", lead=5.0))
        # carried out once node-1's rank has left (Injector._give_back)
        capacity = asyncio.create_task(dry.injector.inject_now(ScenarioEvent(at=0.0, kind="capacity", node="node-1")))
        await until("the on-demand replacement joined", lambda: ["node-0", "od-0"] in hosts())
        await until("the swap-back", lambda: hosts()[-1] == ["node-0", "node-1"] and ["node-0", "od-0"] in hosts())
        swap = len(hosts()) - 1  # the run's cancellation pushes memberships of its own after it
        swapped_at = dry.memberships[swap].t
        await until("the ranks carried out the swap", lambda: swap_done(dry, swapped_at))
        running = [p.pid for p in marked(dry.marker)]
    finally:
        if capacity is not None:
            capacity.cancel()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    # cancelled as Ctrl-C cancels `spotguard dry-run`: nothing it started is left, the workers of
    # this in-place job included (their own process groups, SIGTERM trapped)
    assert len(running) >= 2, running
    assert await nothing_left(dry.marker) == []
    assert not still_running(running)
    assert hosts()[swap - 1] == ["node-0", "od-0"], hosts()  # one membership: node-1 in, od-0 out
    assert all(len(h) <= 2 for h in hosts())
    _, generations = dry.trainer_events()
    assert len(generations) == 1, (generations, hosts())  # nothing relaunched
    assert any("warm standby" in s["backfill"] for s in dry.supervisor_log.backfill_steps)
    spot = [j for j in dry.joiners if j.node == "node-1"]
    assert spot and spot[-1].started >= dry.memberships[swap - 1].t  # placed once od-0 had joined
    split = dry.node_seconds(dry.memberships[0].t, time.time())
    assert split["on-demand"] > 0 and split["spot"] > 0
    resized, joined = swap_done(dry, swapped_at)
    assert resized["from_world"] == resized["to_world"] == 2  # never below the size it had
    assert joined["step"] == resized["step"]  # 0 steps lost: the spot joiner starts at the agreed step
    od = [p for p in dry.pod_log.snapshot() if p.node == "od-0"]
    assert od and od[-1].exit_code == EXIT_PREEMPTED


def swap_done(dry: BackfillDryRun, since: float) -> tuple[dict, dict] | None:
    """node-0's in-place change to the swap's membership and node-1's joined start, once the
    ranks did both and od-0's rank left; else None."""
    events = [e for e in dry.events() if e["t"] >= since]
    resized = [e for e in events if e["event"] == "resized" and e["node"] == "node-0" and e["reason"] == "membership"]
    joined = [e for e in events if e["event"] == "start" and e["node"] == "node-1" and e.get("joined")]
    left = [p for p in dry.pod_log.snapshot() if p.node == "od-0" and p.finished is not None]
    return (resized[-1], joined[-1]) if resized and joined and left else None


def trained_together(dry: BackfillDryRun, nodes: set[str]) -> bool:
    """Every one of `nodes` logged a step at a world of their number: the join was carried out,
    not only published."""
    stepped = {e["node"] for e in dry.events() if e["event"] == "step" and e.get("world_size") == len(nodes)}
    return nodes <= stepped
