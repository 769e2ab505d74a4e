"""The join rule (hooks/elastic/join.py) against a stale membership, across real gloo processes.

A worker started without `SPOTGUARD_JOIN` reads its pod's membership from its sidecar (a stub
here that sends it on connect, as the sidecar does). A membership that does not list the
worker's host makes it join only when a group is live at the membership's store. After a
fallback or a crash every worker of the job is relaunched and the last membership is stale:
- its store is dead (no process serves it any more), or
- its store is served again, by the relaunched leader whose first group `m0/` cannot form
  without this worker (the dry-run relaunches every node on the same ports);
in both cases the worker must start the job's group with the others instead of waiting 600 s
for a membership that never lists it while the others time out. A group that is live at the
store is still joined.

Each worker is tests/workers/join_rule.py: it calls `init_process_group()`, all-reduces a 1 and
writes what it saw.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from spotguard.processes import free_port
from spotguard.wire.sse import encode
from tests.workers import zygote
from tests.workers.hosts import Hosts
from tests.workers.join_rule import HOLD_FILE
from tests.workers.launch import ROOT, base_env
from tests.workers.sidecar_stub import SidecarStub

pytestmark = pytest.mark.slow


class MembershipSidecar(SidecarStub):
    """The stub sidecar, sending `membership` on connect after the snapshot (as the real one does)."""

    def __init__(self, membership: dict):
        super().__init__()
        self.membership = membership

    async def _stream(self, request):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await response.write(encode("snapshot", {"v": 1, "node": "n", "notices": []}, 1))
            await response.write(encode("membership", json.dumps(self.membership), 2))
            while True:
                await asyncio.sleep(0.2)
                await response.write(b": keepalive\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response


class Workers(Hosts):
    """Worker processes (tests/workers/join_rule.py) by host name, on 127.0.0.1, each serving its
    own rendezvous port; the ports, waits, logs and kills of tests/workers/hosts.py."""

    def __init__(self, out: Path, sidecar_url: str):
        super().__init__(out, "ddp", out / "ckpt")
        self.sidecar_url = sidecar_url

    def start_worker(self, host: str, rank: int, world: int, master: str, **extra: str) -> None:
        env = base_env()
        env.update(SPOTGUARD_IN_PLACE="1", SPOTGUARD_NODE=host, SPOTGUARD_RDZV_HOST="127.0.0.1",
                   SPOTGUARD_RDZV_PORT=str(self.port(host)), SPOTGUARD_SIDECAR_URL=self.sidecar_url,
                   SPOTGUARD_READY_FILE=str(self.out / f"ready-{host}"), SPOTGUARD_REFORM_TIMEOUT="30",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_PORT=str(self.port(master)), **extra)
        with open(self.out / f"log-{host}", "wb") as log:
            self.procs[host] = zygote.popen(["-m", "tests.workers.join_rule", str(self.out / f"result-{host}.json")],
                                            env=env, cwd=ROOT, stdout=log)

    def result(self, host: str) -> dict:
        return json.loads((self.out / f"result-{host}.json").read_text())

    def log(self, host: str) -> str:
        path = self.out / f"log-{host}"
        return path.read_text(errors="replace") if path.exists() else ""


def wait_for(predicate, timeout: float, what: str, workers: Workers) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s:\n{workers.tail()}")
        time.sleep(0.05)


def stale(hosts: list[str], store: str) -> dict:
    """The last membership of an earlier run of the job: generation 3, without host "b"."""
    return {"v": 1, "generation": 3, "hosts": hosts, "world_size": len(hosts), "store": store}


@pytest.mark.parametrize("store", ["dead", "relaunched-leader"])
def test_a_relaunched_worker_starts_the_job_on_a_stale_membership(store, tmp_path):
    """Hosts a and b are relaunched as the job (ranks 0, 1); b's membership lists a and c, not b.
    "dead": its store is a port nobody serves; "relaunched-leader": it is a's rendezvous port,
    where the relaunched a serves its store while it waits for b to form `m0/`. Both start one
    group of 2 (before: b joined and waited for a membership listing it, a timed out and exited 1)."""
    port = free_port() if store == "dead" else None
    with MembershipSidecar({}) as sidecar:
        workers = Workers(tmp_path, sidecar.url)
        sidecar.membership = stale(["a", "c"], f"127.0.0.1:{port or workers.port('a')}")
        try:
            workers.start_worker("a", 0, 2, "a")
            workers.start_worker("b", 1, 2, "a", JOIN_TEST_JOIN_TIMEOUT="60")
            codes = workers.wait(["a", "b"], timeout=120)
            assert codes == {"a": 0, "b": 0}, workers.tail()
            for rank, host in enumerate(["a", "b"]):
                assert workers.result(host) == {"rank": rank, "world": 2, "joined": False, "sum": 2.0}
            assert "no group is live at its store" in workers.log("b") and "joining" not in workers.log("b")
        finally:
            workers.close()


def test_a_worker_still_joins_a_group_live_at_the_store(tmp_path):
    """The membership lists a (a group of one that formed and keeps training), not b: the store
    answers with a's live group, so b joins (it says it is ready and waits for a membership that
    lists it), as a replacement pod after a reclaim does."""
    from spotguard.hooks.elastic.rendezvous import live_group

    with MembershipSidecar({}) as sidecar:
        workers = Workers(tmp_path, sidecar.url)
        store = f"127.0.0.1:{workers.port('a')}"
        sidecar.membership = stale(["a"], store)
        try:
            workers.start_worker("a", 0, 1, "a", **{HOLD_FILE: str(tmp_path / "release")})
            wait_for(lambda: (tmp_path / "result-a.json").exists(), 90, "a's group formed", workers)
            assert live_group(store, 5.0) == "m0/"
            assert live_group(f"127.0.0.1:{free_port()}", 0.5) is None
            workers.start_worker("b", 1, 2, "a")
            wait_for(lambda: "joining it" in workers.log("b") and (tmp_path / "ready-b").exists(), 90,
                     "b joining a's live group", workers)
            assert workers.procs["b"].poll() is None  # waiting for a membership that lists it
        finally:
            (tmp_path / "release").touch()
            workers.close()

