"""Start at min in the dry-run (issue 22 item 1): every node's `spotguard launch --nnodes 2:3`
waits; once 2 are ready (whichever first) the first membership (`start`) lists them and they train at world 2;
the third is admitted in place (2 -> 3, one change), and nothing is lost."""
from __future__ import annotations

import pytest

import asyncio
import time

from spotguard.trainer.dryrun import DryRun
from spotguard.trainer.report import GenerationRecord
from spotguard.trainer.scenario import parse_scenario

pytestmark = pytest.mark.slow

START_AT_MIN = """\
name: start-at-min
cloud: aws
workers: 3
policy: elastic
min_workers: 2
start_at_min: true
steps: 160
step_seconds: 0.05
"""


async def test_the_job_trains_at_min_and_grows_in_place(tmp_path):
    dry = DryRun(parse_scenario(START_AT_MIN, "<test>"), tmp_path / "run", time_limit=300)
    report = await dry.run()
    assert report["ok"] and report["status"] == "finished", report["problems"]
    (start, first), (admitted, grown) = [(m["cause"], m["hosts"]) for m in report["memberships"]][:2]
    assert (start, len(first), admitted) == ("start", 2, "admitted"), report["memberships"]
    assert grown[:2] == first and sorted(grown) == ["node-0", "node-1", "node-2"]  # appended, in place
    grows = [(c["from_world"], c["to_world"], c["path"]) for c in report["membership_changes"]]
    assert grows == [(2, 3, "in-place")], report["membership_changes"]


async def test_a_relaunch_starts_at_min_too(tmp_path):
    """A relaunch (after a fallback or a crash: generation 1 here) starts at min like the first
    launch: its workers wait, the first membership is a `start` one listing the first 2 ready,
    no `relaunch` membership names all 3, and the third is a joiner. Stopped once it trains."""
    dry = DryRun(parse_scenario(START_AT_MIN, "<test>"), tmp_path / "run", time_limit=120)
    dry.run_dir.mkdir(parents=True)
    try:
        await dry._start_nodes()
        dry.generations.append(GenerationRecord(0, 3, ["node-0", "node-1", "node-2"], time.time(),
                                                ended_at=time.time(), reason="crashed"))
        await dry._launch(["node-0", "node-1", "node-2"])
        assert [(m.cause, len(m.hosts)) for m in dry.memberships] == [("start", 2)]
        assert dry.memberships[0].launch == 1 and len(dry.world) == 2 and len(dry._joins) == 1
        assert dry.generation is not None and dry.generation.start_at_min
        deadline = time.monotonic() + 90
        while not [e for e in dry._events() if e["event"] == "start" and e.get("generation") == 1]:
            assert time.monotonic() < deadline, "the relaunched group never trained"
            await asyncio.sleep(0.1)
        starts = [e for e in dry._events() if e["event"] == "start" and e.get("generation") == 1]
        assert {e["world_size"] for e in starts} == {2}  # trained at min, not at 3
    finally:
        await dry._stop_everything(None)
