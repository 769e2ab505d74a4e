"""Start at min in the dry-run (issue 22 item 1): every node's `spotguard launch --nnodes 2:3`
waits; once 2 are ready (whichever first) the first membership (`start`) lists them and they train at world 2;
the third is admitted in place (2 -> 3, one change), and nothing is lost."""
from __future__ import annotations

import pytest

from spotguard.trainer.dryrun import DryRun
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
