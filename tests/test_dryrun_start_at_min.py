"""Start at min in the dry-run (issue 22 item 1), the supervisor's own start-at-min code
(in_place.start_members) deciding: every node's `spotguard launch --nnodes 2:3` waits; once 2
are Ready (whichever first) the supervisor's first membership (`start`) lists them and they
train at world 2; the third is admitted in place (2 -> 3, one change), and nothing is lost. After
every pod's processes are killed (a crash of the whole group), the relaunched pods start at min
again: a new `start` membership, the group trains at 2, the third joins."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from spotguard.kube.api import PODS
from spotguard.trainer.dryrun import DryRun
from spotguard.trainer.reaper import POD_ENV, marked
from spotguard.trainer.scenario import parse_scenario

pytestmark = pytest.mark.slow
INDEX = "batch.kubernetes.io/job-completion-index"

START_AT_MIN = """\
name: start-at-min
cloud: aws
workers: 3
policy: elastic
min_workers: 2
start_at_min: true
steps: 600
step_seconds: 0.05
"""


async def test_the_job_trains_at_min_and_grows_in_place(tmp_path):
    """The third pod is held back by a scheduling gate of the test's own until the first group
    started (the three would otherwise race to be Ready, and the supervisor lists every pod Ready
    when it starts the group), then scheduled: it joins in place. Training is long enough (30 s of
    steps) for that pod's processes to start and be admitted on a loaded machine (160 steps were
    not, at load 17: training finished first)."""
    hold = HoldIndex("2")
    dry = DryRun(parse_scenario(START_AT_MIN, "<test>"), tmp_path / "run", on_update=hold.release_once_started,
                 time_limit=300)
    dry.cluster.kube.admit(PODS, hold)
    report = await dry.run()
    assert report["ok"] and report["status"] == "finished", report["problems"]
    (start, first), (admitted, grown) = [(m["cause"], m["hosts"]) for m in report["memberships"]][:2]
    assert (start, len(first), admitted) == ("start", 2, "admitted"), report["memberships"]
    assert grown[:2] == first and sorted(grown) == ["node-0", "node-1", "node-2"]  # appended, in place
    grows = [(c["from_world"], c["to_world"], c["path"]) for c in report["membership_changes"]]
    assert grows == [(2, 3, "in-place")], report["membership_changes"]


class HoldIndex:
    """Admission: the first pod of a completion index waits behind a scheduling gate of the test's
    own (`__call__`), until the supervisor pushed its first membership (`release_once_started`)."""

    GATE = "test/held"

    def __init__(self, index: str):
        self.index = index
        self.held: str | None = None  # the name of the pod held

    def __call__(self, pod: dict) -> None:
        if self.held is None and pod["metadata"].get("annotations", {}).get(INDEX) == self.index:
            self.held = pod["metadata"].get("name") or pod["metadata"].get("generateName", "")
            pod["spec"].setdefault("schedulingGates", []).append({"name": self.GATE})

    def release_once_started(self, dry: DryRun) -> None:
        if not dry.memberships:
            return
        for pod in dry.cluster.pods():
            if {"name": self.GATE} in (pod["spec"].get("schedulingGates") or []):
                dry.cluster.kube.patch(PODS, "default", pod["metadata"]["name"], {"spec": {"schedulingGates": None}})


@pytest.mark.timeout(420)
async def test_a_relaunch_starts_at_min_too(tmp_path):
    """Every process of every pod is killed once the group trains at 3 (a crash of the whole
    group): the Job controller re-creates the pods, and the supervisor starts them again the
    start-at-min way: a new `start` membership of the pods Ready by then (at least min), and
    the relaunched group trains at its size. Stopped once it trains."""
    scenario = parse_scenario(START_AT_MIN.replace("steps: 600", "steps: 100000"), "<test>")
    killed: list[float] = []

    def crash_once_grown(dry: DryRun) -> None:
        if not killed and any(len(m.hosts) == 3 for m in dry.memberships):
            killed.append(time.time())
            for pod in dry.pod_log.snapshot():
                for proc in marked(pod.uid, POD_ENV):
                    proc.send_signal(signal.SIGKILL)

    dry = DryRun(scenario, tmp_path / "run", on_update=crash_once_grown, time_limit=360)
    run = asyncio.create_task(dry.run())

    def relaunched_starts() -> list[dict]:
        return [e for e in dry.events() if e["event"] == "start" and killed and e["t"] > killed[0]
                and not e.get("joined")]

    def restart() -> object | None:
        """The newest `start` membership pushed after the kill."""
        return next((m for m in reversed(dry.memberships) if m.cause == "start" and killed and m.t > killed[0]), None)

    def relaunch_trains() -> bool:
        latest = restart()
        return latest is not None and len([e for e in relaunched_starts() if e["t"] >= latest.t]) >= len(latest.hosts)

    try:
        deadline = time.monotonic() + 300
        while not relaunch_trains():
            assert not run.done(), f"the dry-run ended ({dry.status}) before the relaunched group trained"
            assert time.monotonic() < deadline, \
                f"the relaunched group never trained: memberships {dry.memberships}, pods {dry.pod_log.snapshot()}"
            await asyncio.sleep(0.2)
    finally:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    starts = [m for m in dry.memberships if m.cause == "start"]
    latest = restart()
    # one start before the kill; after it, start memberships of at least min (a pod the kill took
    # after a start listed it can end that group: its rank leaves, and below min the job starts again)
    assert starts[0].t < killed[0] < starts[1].t and starts[-1] is latest, dry.memberships
    assert all(len(m.hosts) >= 2 for m in starts), dry.memberships
    # the relaunched ranks start at the start group's size
    assert {e["world_size"] for e in relaunched_starts() if e["t"] >= latest.t} == {len(latest.hosts)}
