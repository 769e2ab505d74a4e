"""`spotguard launch`: real launcher and worker processes (tests/workers/launch_probe.py).

Each test starts the launcher as a subprocess; on the way out it is killed by PID if still
running, and then the workers it started, by the PIDs they recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotguard.cli import main
from spotguard.hooks.launch import build_config, register, worker_env

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "workers" / "launch_probe.py"
TIMEOUT = 30


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") and k != "OMP_NUM_THREADS"}
    env.update(extra)
    return env


def wait_for(check, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Launch:
    """`spotguard launch LAUNCH_ARGS probe OUTDIR PROBE_ARGS`, stderr kept in OUTDIR/launcher.log."""

    def __init__(self, out: Path, launch_args: list[str], probe_args: list[str] = (), env: dict | None = None):
        self.out = out
        self.log_path = out / "launcher.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spotguard", "launch", *launch_args, str(PROBE), str(out), *probe_args],
                env=env or clean_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *_exc) -> None:
        if self.proc.poll() is not None and self.proc.returncode >= 0:
            return  # the launcher reaped every worker before it exited
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)
        for pid in self.all_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {TIMEOUT}s:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]

    def env(self, rank: int) -> dict[str, str]:
        return json.loads((self.out / f"rank{rank}.env").read_text())

    def pids(self, rank: int) -> list[int]:
        path = self.out / f"rank{rank}.pids"
        return [int(line) for line in path.read_text().split()] if path.exists() else []

    def all_pids(self) -> list[int]:
        return [int(line) for p in self.out.glob("rank*.pids") for line in p.read_text().split()]

    def signals(self, rank: int) -> list[str]:
        path = self.out / f"rank{rank}.signals"
        return path.read_text().split() if path.exists() else []

    def wait_ready(self, *ranks: int) -> None:
        wait_for(lambda: all((self.out / f"rank{r}.ready").exists() for r in ranks), f"ranks {ranks} ready")


def test_each_worker_gets_torchrun_and_in_place_environment(tmp_path):
    args = ["--nnodes", "2", "--node_rank", "1", "--nproc-per-node", "2", "--master_addr", "127.0.0.2",
            "--master-port", "29999", "--node-name", "node-b", "--rdzv-host", "10.0.0.5", "--rdzv-port", "29411",
            "--join", "--ready-file", str(tmp_path / "ready"), "--reform-timeout", "7.5", "--min-world-size", "2"]
    with Launch(tmp_path, args, ["--exit", "2=0", "--exit", "3=0"]) as launch:
        assert launch.wait() == 0
    for local, rank in enumerate((2, 3)):
        env = launch.env(rank)
        assert {k: env.get(k) for k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "SPOTGUARD_IN_PLACE", "SPOTGUARD_NODE",
            "SPOTGUARD_RDZV_HOST", "SPOTGUARD_RDZV_PORT", "SPOTGUARD_JOIN", "SPOTGUARD_READY_FILE",
            "SPOTGUARD_REFORM_TIMEOUT", "SPOTGUARD_MIN_WORLD_SIZE")} == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29999", "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "SPOTGUARD_IN_PLACE": "1", "SPOTGUARD_NODE": "node-b",
            "SPOTGUARD_RDZV_HOST": "10.0.0.5", "SPOTGUARD_RDZV_PORT": "29411", "SPOTGUARD_JOIN": "1",
            "SPOTGUARD_READY_FILE": str(tmp_path / "ready"), "SPOTGUARD_REFORM_TIMEOUT": "7.5",
            "SPOTGUARD_MIN_WORLD_SIZE": "2"}


def test_standalone_defaults_come_from_the_master_and_the_environment(tmp_path):
    env = clean_env(SPOTGUARD_NODE="from-env", OMP_NUM_THREADS="4")
    with Launch(tmp_path, ["--standalone", "--nproc_per_node", "2"], ["--exit", "0=0", "--exit", "1=0"],
                env=env) as launch:
        assert launch.wait() == 0
    first, second = launch.env(0), launch.env(1)
    port = first["MASTER_PORT"]
    for rank, worker in enumerate((first, second)):
        assert (worker["RANK"], worker["WORLD_SIZE"], worker["MASTER_ADDR"], worker["MASTER_PORT"]) == (
            str(rank), "2", "127.0.0.1", port)
        # rendezvous on the master (node rank 0), the same port for every local worker
        assert (worker["SPOTGUARD_RDZV_HOST"], worker["SPOTGUARD_RDZV_PORT"]) == ("127.0.0.1", port)
        assert worker["SPOTGUARD_NODE"] == "from-env" and worker["OMP_NUM_THREADS"] == "4"
        assert not {"SPOTGUARD_JOIN", "SPOTGUARD_READY_FILE", "SPOTGUARD_REFORM_TIMEOUT",
                    "SPOTGUARD_MIN_WORLD_SIZE"} & set(worker)


@pytest.mark.parametrize("codes, expected", [
    (("0", "0"), 0),
    (("0", "83"), 83),
    (("83", "83"), 83),
    (("83", "84"), 84),
    (("0", "7"), 7),
    (("kill", "0"), 128 + signal.SIGKILL),
])
def test_exit_status_aggregates_the_workers(tmp_path, codes, expected):
    with Launch(tmp_path, ["--nproc-per-node", "2"], ["--exit", f"0={codes[0]}", "--exit", f"1={codes[1]}"]) as launch:
        assert launch.wait() == expected, launch.log()


def test_a_crash_terminates_the_other_workers(tmp_path):
    with Launch(tmp_path, ["--nproc-per-node", "2"], ["--exit", "0=5"]) as launch:
        assert launch.wait() == 5, launch.log()
    assert launch.signals(1) == ["SIGTERM"]
    ends = {r["rank"]: r["status"] for r in launch.records() if r["msg"].startswith("rank") and "status" in r}
    assert ends == {0: 5, 1: 83}


def test_a_worker_ignoring_sigterm_after_a_crash_is_killed_after_the_shutdown_timeout(tmp_path):
    with Launch(tmp_path, ["--nproc-per-node", "2", "--shutdown-timeout", "0.5"],
                ["--exit", "0=5", "--ignore-term"]) as launch:
        assert launch.wait() == 5, launch.log()
    assert launch.signals(1) == ["SIGTERM"]
    ends = {r["rank"]: r["status"] for r in launch.records() if "status" in r}
    assert ends == {0: 5, 1: 128 + signal.SIGKILL}


def test_signals_to_the_launcher_reach_the_workers_handlers(tmp_path):
    with Launch(tmp_path, ["--nproc-per-node", "2"]) as launch:
        launch.wait_ready(0, 1)
        launch.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: launch.signals(0) and launch.signals(1), "SIGUSR1 forwarded")
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait() == 83, launch.log()
    assert launch.signals(0) == launch.signals(1) == ["SIGUSR1", "SIGTERM"]


def test_a_drained_worker_leaves_the_others_running_and_is_never_restarted(tmp_path):
    with Launch(tmp_path, ["--nproc-per-node", "2"], ["--exit", "0=83"]) as launch:
        wait_for(lambda: any(r.get("rank") == 0 and r.get("status") == 83 for r in launch.records()), "rank 0 ended")
        assert launch.proc.poll() is None
        os.kill(launch.pids(1)[0], 0)  # still running (it exits only when released)
        (tmp_path / "release").touch()
        assert launch.wait() == 83, launch.log()
    assert len(launch.pids(0)) == len(launch.pids(1)) == 1
    assert launch.signals(1) == []
    assert [r["rank"] for r in launch.records() if "started" in r["msg"]] == [0, 1]


def test_workers_get_sigterm_when_the_launcher_dies(tmp_path):
    with Launch(tmp_path, ["--nproc-per-node", "2"]) as launch:
        launch.wait_ready(0, 1)
        launch.proc.kill()
        launch.proc.wait(TIMEOUT)
        wait_for(lambda: launch.signals(0) and launch.signals(1), "the parent-death signal")
        # SIGTERM, and nothing else; possibly more than once: the kernel sends the parent-death
        # signal at each reparenting, and a killed launcher's threads exit one by one, so a worker
        # can be handed to a sibling thread (one SIGTERM) before init (another)
        assert {*launch.signals(0)} == {*launch.signals(1)} == {"SIGTERM"}, (launch.signals(0), launch.signals(1))


@pytest.mark.parametrize("session", [[], ["--same-session"]], ids=["own-session", "same-session"])
def test_nothing_a_worker_started_outlives_the_launcher(tmp_path, session):
    """The worker exits 0 and leaves a child behind (in its process group, ignoring SIGTERM):
    the launcher's way out kills the worker's process group."""
    with Launch(tmp_path, ["--nproc-per-node", "1", *session], ["--child", "--exit", "0=0"]) as launch:
        try:
            assert launch.wait() == 0, launch.log()
            child = int(wait_for(lambda: (tmp_path / "rank0.child").exists() and (tmp_path / "rank0.child").read_text(),
                                 "the child's pid"))
            wait_for(lambda: not running(child), "the worker's child to be gone")
        finally:
            child_file = tmp_path / "rank0.child"
            if child_file.exists() and running(int(child_file.read_text())):
                os.kill(int(child_file.read_text()), signal.SIGKILL)


def test_workers_get_sessions_of_their_own_or_process_groups_in_the_launchers_with_same_session(tmp_path):
    """torchrun's way: each worker leads a session. `--same-session`: each leads a process group
    in the launcher's session (one autogroup for the kernel's scheduler); signals still arrive."""
    for flags, out in (([], tmp_path / "own"), (["--same-session"], tmp_path / "same")):
        out.mkdir()
        with Launch(out, ["--nproc-per-node", "2", *flags]) as launch:
            launch.wait_ready(0, 1)
            sessions = [json.loads((out / f"rank{r}.session").read_text()) for r in (0, 1)]
            launcher_sid = os.getsid(launch.proc.pid)
            for s in sessions:
                assert s["pgid"] == s["pid"]  # a group of its own: the launcher's way out kills it
                if flags:
                    assert s["sid"] == launcher_sid != s["pid"]
                else:
                    assert s["sid"] == s["pid"] != launcher_sid
            launch.proc.send_signal(signal.SIGUSR1)
            wait_for(lambda launch=launch: launch.signals(0) and launch.signals(1), "the forwarded signal")
            assert launch.signals(0) == launch.signals(1) == ["SIGUSR1"]
            (out / "release").touch()
            assert launch.wait() == 0, launch.log()


def test_same_session_is_a_flag_of_the_launcher_only():
    assert launch_config().same_session is False
    assert launch_config("--same-session").same_session is True
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["launch", str(PROBE)])
    assert build_config(args, {"SPOTGUARD_SAME_SESSION": "1"}).same_session is False  # no variable


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("args, field", [
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--nproc_per_node", "two"], "--nproc-per-node"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    (["--nnodes", "4:2"], "--nnodes"),
    (["--nnodes", "0:2"], "--nnodes"),
    (["--nnodes", "1:x"], "--nnodes"),
    (["--nnodes", "2:"], "--nnodes"),
    (["--nnodes", "1:2", "--node-rank", "2"], "--node-rank"),
    (["--master-port", "70000"], "--master-port"),
    (["--rdzv-port", "0"], "--rdzv-port"),
    (["--reform-timeout", "-1"], "--reform-timeout"),
    (["--min-world-size", "0"], "--min-world-size"),
    (["--shutdown-timeout", "soon"], "--shutdown-timeout"),
    (["--standalone", "--nnodes", "2"], "--standalone"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, args, field):
    assert main(["launch", *args, str(PROBE), str(tmp_path), "--exit", "0=0"]) == 2
    assert f"error: {field}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no worker started


def test_a_bad_variable_or_a_missing_script_exits_2_naming_it(tmp_path):
    env = clean_env(SPOTGUARD_RDZV_PORT="x")
    with Launch(tmp_path, ["--nproc-per-node", "1"], ["--exit", "0=0"], env=env) as launch:
        assert launch.wait() == 2
    assert "--rdzv-port (from SPOTGUARD_RDZV_PORT)" in launch.log()
    result = subprocess.run([sys.executable, "-m", "spotguard", "launch", str(tmp_path / "missing.py")],
                            env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and "training_script: no such file" in result.stderr


def launch_config(*flags: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return build_config(parser.parse_args(["launch", *flags, str(PROBE)]), {})


def test_an_nnodes_range_starts_at_min_and_a_fixed_count_stays_as_it_was():
    elastic = launch_config("--nnodes", "2:4", "--nproc-per-node", "2", "--node-rank", "3")
    assert (elastic.nnodes, elastic.max_nodes, elastic.start_at_min, elastic.min_world_size) == (2, 4, True, 4)
    env = worker_env(elastic, 1, {})
    assert (env["SPOTGUARD_START_AT_MIN"], env["SPOTGUARD_MIN_WORLD_SIZE"]) == ("1", "4")
    assert launch_config("--nnodes", "1:3", "--min-world-size", "2").min_world_size == 2  # the flag wins
    fixed = launch_config("--nnodes", "2", "--node-rank", "1")
    assert (fixed.nnodes, fixed.max_nodes, fixed.start_at_min, fixed.min_world_size) == (2, 2, False, None)
    env = worker_env(fixed, 0, {"SPOTGUARD_START_AT_MIN": "1"})
    assert "SPOTGUARD_START_AT_MIN" not in env and env["WORLD_SIZE"] == "2"
