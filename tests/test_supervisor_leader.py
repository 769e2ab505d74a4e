"""Leader election on a Lease over real HTTP: two replicas, one leader; only the leader acts."""
from __future__ import annotations

import asyncio
import json
import threading

from spotguard.kube import load_api_client
from spotguard.wire import names
from spotguard.kube.api import LEASES, Kube
from spotguard.supervisor.leader import LeaderElector
from tests.supervisor_cluster import NS, eventually, running_cluster

NODES = ["n0", "n1", "n2", "n3"]


def elector(cluster, identity: str, duration: float = 2.0) -> LeaderElector:
    return LeaderElector(Kube(load_api_client(host=cluster.url)), NS, "sup-lease", identity,
                         lease_duration=duration, renew_period=0.2)


async def test_concurrent_candidates_exactly_one_wins():
    async with running_cluster() as cluster:
        for round_ in range(3):
            candidates = [elector(cluster, f"c{round_}-{i}") for i in range(3)]
            barrier = threading.Barrier(len(candidates))

            def attempt(e: LeaderElector) -> bool:
                barrier.wait(5)
                return e.try_acquire_or_renew()
            results = await asyncio.gather(*(asyncio.to_thread(attempt, e) for e in candidates))
            if round_ == 0:
                assert sum(results) == 1  # a create race: the others get 409
            else:
                assert sum(results) == 0  # the previous round's holder still holds it
            winner = [e for e, won in zip(candidates, results) if won]
            if winner:
                assert winner[0].is_leader() and not any(e.is_leader() for e in candidates if e is not winner[0])


async def test_follower_takes_over_only_after_the_lease_expires():
    async with running_cluster() as cluster:
        a, b = elector(cluster, "a", duration=1.5), elector(cluster, "b", duration=1.5)
        assert await asyncio.to_thread(a.try_acquire_or_renew)
        assert not await asyncio.to_thread(b.try_acquire_or_renew)
        # a stops renewing (crashed); b must keep failing until it saw the record unchanged 1.5 s
        lease = await asyncio.to_thread(cluster.kube.get, LEASES, NS, "sup-lease")
        assert lease["spec"]["holderIdentity"] == "a"
        attempts = 0
        while not await asyncio.to_thread(b.try_acquire_or_renew):
            attempts += 1
            await asyncio.sleep(0.1)
        assert attempts >= 5  # it did wait: at least the renew-free lease duration went by
        lease = await asyncio.to_thread(cluster.kube.get, LEASES, NS, "sup-lease")
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        assert not await asyncio.to_thread(a.try_acquire_or_renew)  # the old holder lost it (409/held)
        assert not a.is_leader()


async def test_two_replicas_one_leader_only_the_leader_acts():
    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODES, {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"})
        replicas = {}
        stops = {}
        tasks = []
        for identity in ("sup-a", "sup-b"):
            e = elector(cluster, identity)
            controller = cluster.controller(identity, elector=e)
            e.on_change = controller.on_leadership
            replicas[identity] = (e, controller)
            stops[identity] = asyncio.Event()
        try:
            for identity, (e, controller) in replicas.items():
                await controller.start()
                tasks.append(asyncio.create_task(e.run(stops[identity])))

            async def one_leader():
                leaders = [i for i, (e, _) in replicas.items() if e.is_leader()]
                return leaders[0] if len(leaders) == 1 else None
            leader = await eventually(one_leader, what="a leader")
            follower = next(i for i in replicas if i != leader)

            overlap = []

            async def watch_overlap():
                while True:
                    if all(e.is_leader() for e, _ in replicas.values()):
                        overlap.append(True)
                    await asyncio.sleep(0.02)
            watcher = asyncio.create_task(watch_overlap())

            await cluster.notice("n0")

            async def scaled(n):
                job = await cluster.job("j1")
                return job["spec"]["parallelism"] == n and job
            job = await eventually(lambda: scaled(3), what="scaled to 3")
            assert json.loads(job["metadata"]["annotations"][names.ANN_STATUS])["decided_by"] == leader
            events = await eventually(lambda: cluster.events("j1", names.EVENT_SCALED), what="Event")
            assert [e["reportingInstance"] for e in events] == [leader]

            # the leader steps down (clean stop releases the Lease); the follower acts on the next notice
            stops[leader].set()
            await eventually(lambda: _true(replicas[follower][0].is_leader()), what="failover")
            await replicas[leader][1].stop()
            await cluster.notice("n1", ident="2")
            job = await eventually(lambda: scaled(2), what="scaled to 2 by the new leader")
            assert json.loads(job["metadata"]["annotations"][names.ANN_STATUS])["decided_by"] == follower
            assert cluster.spec_writes("j1") == [{"parallelism": n, "suspend": False} for n in (4, 3, 2)]
            watcher.cancel()
            assert not overlap  # never two leaders at the same moment
        finally:
            for stop in stops.values():
                stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            for _, controller in replicas.values():
                await controller.stop()


async def _true(value):
    return value
