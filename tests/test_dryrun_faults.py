"""The dry-run under faults (issue 18): real agents, sidecars, Guards and `spotguard launch`, the
supervisor's own code deciding every membership (issue 35).

Each test runs a `DryRun` in this process and steers it from its `on_update` hook (called every
tick of its loop) at a moment it waits for, never after a sleep: a joiner is frozen once it is
Ready and killed once the survivors are blocked in the change, a reclaim lands while a joiner
starts. After every run, no process it started is left. (A run that raised, and one cancelled,
leave none either: tests/test_dryrun_start_at_min.py's relaunch ends by its hook raising,
tests/test_backfill_dryrun.py's run is cancelled, and both check it.)
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from spotguard.kube.api import PODS
from spotguard.trainer.dryrun import DryRun
from spotguard.trainer.local_cluster import Timings
from spotguard.trainer.reaper import POD_ENV, marked
from spotguard.trainer.scenario import ScenarioEvent, load_scenario, parse_scenario
from tests.helpers import passing_dry_run
from tests.test_scenarios_bundled import assert_passed_as_shipped

pytestmark = pytest.mark.slow
QUICK_REFORM = Timings(reform_timeout=5.0)  # the dry-run's other timings, a re-form that times out sooner


def scenario(text: str):
    return parse_scenario(text, "<test>")


async def nothing_left(marker: str, bound: float = 15.0) -> list[int]:
    """PIDs of the run's processes still alive after waiting up to `bound` seconds for none."""
    until = time.monotonic() + bound
    while True:
        alive = [p.pid for p in marked(marker)]
        if not alive or time.monotonic() > until:
            return alive
        await asyncio.sleep(0.2)


def still_running(pids: list[int]) -> list[int]:
    """Those of `pids` alive and not a zombie."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def pod_processes(uid: str) -> list[psutil.Process]:
    """Every process of a pod (the kubelet marks them with the pod's uid)."""
    return marked(uid, POD_ENV)


def last_step_at(dry: DryRun, node: str) -> float:
    return max((e["t"] for e in dry.events() if e["event"] == "step" and e.get("node") == node), default=0.0)


def joiner_on(dry: DryRun, node: str):
    """The running pod on `node` made after training started (a replacement: a joiner) that the
    supervisor's last membership does not list, or None."""
    if dry.started_at is None or node in dry.world:
        return None
    pods = [p for p in dry.pod_log.snapshot() if p.node == node and p.finished is None and p.created > dry.started_at]
    return max(pods, key=lambda p: p.created) if pods else None


class FreezeJoinerThenKill:
    """Freezes the joiner on `node` (SIGSTOP to every process of its pod) the moment its kubelet
    reports it Ready (a listener on the local API's writes: before the supervisor can admit it), so
    that it is admitted but never forms the new group; once the survivor has made no step for
    1.5 s (it waits in the change) kills them (SIGKILL). The survivor's re-form then times out and
    falls back."""

    def __init__(self, node: str):
        self.node = node
        self.frozen: list[psutil.Process] = []
        self.killed_at: float | None = None
        self.pod: str | None = None
        self.dry: DryRun | None = None

    def attach(self, dry: DryRun) -> FreezeJoinerThenKill:
        self.dry = dry
        dry.cluster.kube.subscribe(self.on_write)
        return self

    def on_write(self, kind: str, resource: str, pod: dict) -> None:
        if self.frozen or resource != str(PODS) or (pod.get("spec") or {}).get("nodeName") != self.node:
            return
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or [])
        assert self.dry is not None
        if ready and self.dry.started_at is not None and pod["metadata"]["name"] in self._replacements():
            self.pod, self.frozen = pod["metadata"]["name"], pod_processes(pod["metadata"]["uid"])
            for proc in self.frozen:
                proc.send_signal(signal.SIGSTOP)

    def _replacements(self) -> set[str]:
        assert self.dry is not None
        return {p.name for p in self.dry.pod_log.snapshot() if p.created > (self.dry.started_at or 0.0)}

    def __call__(self, dry: DryRun) -> None:
        if self.killed_at is not None or not self.frozen:
            return
        admitted = any(m.cause == "admitted" and self.node in m.hosts for m in dry.memberships)
        if admitted and time.time() - last_step_at(dry, "node-0") > 1.5:
            for proc in self.frozen:
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            self.killed_at = time.time()


# 600 steps (24 s at least) cover the joiner's start-up and admission with room on a loaded machine
# (admitted 5 s after the start at load 2, step 114; 13 s at load 8, step 241); the survivor trains
# no step while it waits in the change, and the relaunch trains what is left (900 before: 12 s more).
FALLBACK = """\
name: joiner-dies-in-the-change
cloud: aws
workers: 2
policy: elastic
min_workers: 1
steps: 600
step_seconds: 0.04
events:
  - {at: 1, kind: reclaim, node: node-1, lead: 8}
  - {at: 2, kind: capacity, node: node-1}
"""


async def test_a_relaunch_after_a_fallback_starts_every_node_and_loses_nothing(tmp_path):
    """Item 1: the joiner dies inside the grow; the survivor falls back (checkpoint, exit 83) and
    every node is relaunched. The relaunch pushes the membership of its own world first, so
    node-1 starts with node-0 instead of joining the stale membership that left it out. The
    survivor waits one re-form timeout for the killed joiner: 5 s (`QUICK_REFORM`) proves the
    fallback as the dry-run's 10 s did, the shrink before it re-forms in well under a second."""
    hold = FreezeJoinerThenKill("node-1")
    dry = DryRun(scenario(FALLBACK), tmp_path / "run", on_update=hold, time_limit=300, timings=QUICK_REFORM)
    hold.attach(dry)
    report = await dry.run()
    assert await nothing_left(dry.marker) == []
    assert hold.killed_at is not None, "the joiner was never admitted and frozen"
    assert report["status"] == "finished", (report["status"], report["problems"])
    assert report["ok"], report["problems"]
    assert report["steps_lost"] == 0 and report["steps_completed"] == 600
    relaunch = [m for m in report["memberships"] if m["cause"] == "relaunch" and m["launch"] >= 1]
    assert relaunch and sorted(relaunch[0]["hosts"]) == ["node-0", "node-1"], report["memberships"]
    assert len(report["generations"]) == 2, report["generations"]
    fallback = [c for c in report["membership_changes"] if c["path"] == "fallback"]
    assert [(c["from_world"], c["to_world"]) for c in fallback] == [(1, 2)], report["membership_changes"]
    capacity = report["timeline"][1]
    assert capacity["kind"] == "capacity" and capacity["path"] == "fallback", capacity
    assert capacity["resumed_step"] == capacity["checkpoint_step"], capacity
    relaunched = max((p for p in dry.pod_log.snapshot() if p.node == "node-1"), key=lambda p: p.created)
    assert relaunched.name != hold.pod
    assert "joining it" not in (tmp_path / "run" / "logs" / f"{relaunched.name}.log").read_text()


# 350 steps (14 s at least): the joiner starts ~3 s after the capacity (at ~5 s here) and its node
# dies 3 s after the reclaim that follows; the survivor trains on well past both (before: 500).
RECLAIM_DURING_START_UP = """\
name: reclaim-during-start-up
cloud: aws
workers: 2
policy: elastic
min_workers: 1
steps: 350
step_seconds: 0.04
events:
  - {at: 1, kind: reclaim, node: node-1, lead: 6}
  - {at: 2, kind: capacity, node: node-1}
"""


async def test_a_joiner_whose_node_is_reclaimed_during_its_start_up_is_not_admitted(tmp_path):
    """Item 5: node-1 comes back, its joiner starts, and node-1 is reclaimed again before the
    joiner is ready: the joiner is stopped, no membership ever lists node-1 again."""
    injected: list = []

    def reclaim_when_the_joiner_starts(dry: DryRun) -> None:
        joiner = joiner_on(dry, "node-1")
        if not injected and joiner is not None and joiner.started is not None and joiner.ready is None:
            injected.append(asyncio.get_running_loop().create_task(
                dry.inject_now(ScenarioEvent(at=0.0, kind="reclaim", node="node-1", lead=3.0))))

    dry = DryRun(scenario(RECLAIM_DURING_START_UP), tmp_path / "run", on_update=reclaim_when_the_joiner_starts,
                 time_limit=240)
    report = await dry.run()
    assert await nothing_left(dry.marker) == []
    assert injected, "no joiner was started on node-1"
    assert report["ok"] and report["status"] == "finished", report["problems"]
    assert report["steps_lost"] == 0
    admitted = [m for m in report["memberships"] if m["cause"] == "admitted"]
    assert admitted == [], admitted
    assert [(c["from_world"], c["to_world"]) for c in report["membership_changes"]] == [(2, 1)]


async def test_two_returns_at_once_grow_in_one_change(tmp_path):
    """Item 6, on the bundled `two-reclaims` as shipped (3 nodes, 3 -> 2 -> 1, both reclaimed
    nodes return together at t=16 s): their joiners are admitted in one membership, and the job
    grows 1 -> 3 in one change (one pause), not one node at a time. Two returning nodes prove it as
    three did (a 4-node run of its own until this one took its place, 4 more worker start-ups):
    the supervisor holds Ready joiners back while another is still starting
    (in_place.joiners_settled), whatever their number, and one at a time would be 1 -> 2 -> 3.
    The bundled-scenario matrix leaves this scenario to this test (tests/test_scenarios_bundled.py,
    `OWN_TESTS`): its report gets the matrix's checks too."""
    shipped = load_scenario("two-reclaims")
    report = await passing_dry_run(shipped, tmp_path / "run")  # finished, nothing left running
    assert_passed_as_shipped(shipped, report)
    grows = [(c["from_world"], c["to_world"], c["path"]) for c in report["membership_changes"]
             if (c["to_world"] or 0) > (c["from_world"] or 0)]
    assert grows == [(1, 3, "in-place")], report["membership_changes"]
    admitted = [m["hosts"] for m in report["memberships"] if m["cause"] == "admitted"]
    assert len(admitted) == 1 and admitted[0][0] == "node-0", report["memberships"]  # the survivor stays rank 0
    assert sorted(admitted[0]) == ["node-0", "node-1", "node-2"], report["memberships"]
    rows = [e for e in report["timeline"] if e["kind"] == "capacity"]
    assert [e["world"] for e in rows] == ["1 -> 3"] * 2, rows


SHORT = """\
name: short
cloud: aws
workers: 2
policy: elastic
min_workers: 1
steps: 3000
step_seconds: 0.05
events:
  - {at: 1, kind: reclaim, node: node-1, lead: 10}
"""


def test_the_cli_interrupted_leaves_no_process(tmp_path):
    """`spotguard dry-run` and SIGINT (a terminal's Ctrl-C): exit 130, every process gone."""
    import subprocess
    import sys
    import uuid

    path = tmp_path / "short.yaml"
    path.write_text(SHORT)
    mark = uuid.uuid4().hex
    env = {**os.environ, "SPOTGUARD_TEST_MARK": mark}
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "spotguard", "dry-run", "--no-live", "--scenario", str(path),
                             "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        until = time.monotonic() + 180
        while not any(Path(out / "events").glob("*.jsonl")) and time.monotonic() < until and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, output[-3000:]
    until = time.monotonic() + 15
    while marked(mark, "SPOTGUARD_TEST_MARK") and time.monotonic() < until:
        time.sleep(0.2)
    assert [p.pid for p in marked(mark, "SPOTGUARD_TEST_MARK")] == []
