"""Start at min in the dry-run (issue 22 item 1), the supervisor's own start-at-min code
(in_place.start_members) deciding: every node's `spotguard launch --nnodes 2:3` waits; once 2
are Ready (whichever first) the supervisor's first membership (`start`) lists them and they
train at world 2; the third is admitted in place (2 -> 3, one change), and nothing is lost. After
every pod's processes are killed (a crash of the whole group), the relaunched pods start at min
again: a new `start` membership, the group trains at 2, the third joins; a run whose loop raises
leaves no process."""
from __future__ import annotations

import signal
import time

import pytest

from spotguard.kube.api import PODS
from spotguard.trainer.dryrun import DryRun
from spotguard.trainer.reaper import POD_ENV, marked
from spotguard.trainer.scenario import parse_scenario
from tests.test_dryrun_faults import nothing_left, still_running

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


class RelaunchTrains(Exception):
    """Raised by the relaunch test's hook once the relaunched group trains: the run's end."""


@pytest.mark.timeout(420)
async def test_a_relaunch_starts_at_min_too(tmp_path):
    """Every process of every pod is killed once the group trains at 3 (a crash of the whole
    group): the Job controller re-creates the pods, and the supervisor starts them again the
    start-at-min way: a new `start` membership of the pods Ready by then (at least min), and
    the relaunched group trains at its size. Stopped once it trains by the run's own hook
    raising: run() re-raises, and no launcher or worker it started is left (the check of a run
    whose loop raised while ranks train: tests/test_dryrun_faults.py had a run of its own for it)."""
    scenario = parse_scenario(START_AT_MIN.replace("steps: 600", "steps: 100000"), "<test>")
    killed: list[float] = []
    running: list[int] = []  # the run's processes when its hook raised

    def relaunched_starts(dry: DryRun) -> list[dict]:
        return [e for e in dry.events() if e["event"] == "start" and killed and e["t"] > killed[0]
                and not e.get("joined")]

    def restart(dry: DryRun) -> object | None:
        """The newest `start` membership pushed after the kill."""
        return next((m for m in reversed(dry.memberships) if m.cause == "start" and killed and m.t > killed[0]), None)

    def relaunch_trains(dry: DryRun) -> bool:
        latest = restart(dry)
        started = [e for e in relaunched_starts(dry) if latest is not None and e["t"] >= latest.t]
        return latest is not None and len(started) >= len(latest.hosts)

    def crash_once_grown_then_stop(dry: DryRun) -> None:
        if not killed and any(len(m.hosts) == 3 for m in dry.memberships):
            killed.append(time.time())
            for pod in dry.pod_log.snapshot():
                for proc in marked(pod.uid, POD_ENV):
                    proc.send_signal(signal.SIGKILL)
        elif killed and relaunch_trains(dry):
            running.extend(p.pid for p in marked(dry.marker))
            raise RelaunchTrains

    dry = DryRun(scenario, tmp_path / "run", on_update=crash_once_grown_then_stop, time_limit=360)
    try:
        await dry.run()
    except RelaunchTrains:
        pass
    else:
        pytest.fail(f"the dry-run ended ({dry.status}) before the relaunched group trained: memberships "
                    f"{dry.memberships}, pods {dry.pod_log.snapshot()}")
    assert len(running) >= 2, running
    assert await nothing_left(dry.marker) == []
    assert not still_running(running)
    starts = [m for m in dry.memberships if m.cause == "start"]
    latest = restart(dry)
    # one start before the kill; after it, start memberships of at least min (a pod the kill took
    # after a start listed it can end that group: its rank leaves, and below min the job starts again)
    assert starts[0].t < killed[0] < starts[1].t and starts[-1] is latest, dry.memberships
    assert all(len(m.hosts) >= 2 for m in starts), dry.memberships
    # the relaunched ranks start at the start group's size
    assert {e["world_size"] for e in relaunched_starts(dry) if e["t"] >= latest.t} == {len(latest.hosts)}
