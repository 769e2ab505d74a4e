"""`spotguard supervisor` as a process: bad flags exit 2 naming the flag; a real run serves
/metrics, takes the Lease and releases it on SIGTERM."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from spotguard.kube.api import LEASES
from tests.supervisor_cluster import NS, eventually, running_cluster


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotguard", "supervisor", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,flag", [
    (["--resync", "0"], "--resync"),
    (["--listen", "nowhere"], "--listen"),
    (["--membership-hosts", "dns"], "--membership-hosts"),
    (["--lease-duration", "1"], "--lease-duration"),
    (["--kube-host", "ftp://x"], "--kube-host"),
])
def test_bad_flags_exit_2_naming_the_flag(args, flag):
    result = run_cli(*args)
    assert result.returncode == 2 and flag in result.stderr


def test_bad_price_file_names_the_entry(tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text("default: {spot: 1.0, on-demand: 3.0}\ninstance-types:\n  p4d: {spot: cheap}\n")
    result = run_cli("--prices", str(prices))
    assert result.returncode == 2 and "instance-types.p4d.spot" in result.stderr


async def test_runs_serves_metrics_and_releases_the_lease(tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"default": {"spot": 1.0, "on-demand": 3.0}}))
    async with running_cluster() as cluster:
        await cluster.add_node("n0", labels={"karpenter.sh/capacity-type": "spot"})
        await cluster.add_job_with_pods("j1", ["n0"], {"spotguard.io/policy": "elastic"})
        proc = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, "-m", "spotguard", "supervisor", "--kube-host", cluster.url, "--namespace", NS,
             "--listen", "127.0.0.1:0", "--identity", "cli-test", "--prices", str(prices), "--lease-duration", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            listen = json.loads(line)["listen"]

            async def scrape():
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://{listen}/metrics") as response:
                        text = await response.text()
                assert "spotguard_supervisor_leader 1" in text
                assert 'spotguard_job_cost_dollars{namespace="train",job="j1",kind="Job"}' in text
                return text
            await eventually(scrape, timeout=15, what="leader metrics")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 20) == 0
            lease = await cluster.call(cluster.kube.get, LEASES, NS, "spotguard-supervisor")
            assert lease["spec"]["holderIdentity"] == ""  # released for a standby to take at once
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
