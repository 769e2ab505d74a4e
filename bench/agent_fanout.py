"""Fan-out: one notice to many SSE subscribers; the spread of delivery times per notice.

Starts the metadata emulator (default GCP, hanging GET, so flips are quick) in-process,
`spotguard agent` as a subprocess against it, and N subscribers (default 64) on its
/v1/stream, each its own connection, spread over `--procs` client processes (default 2, so
one client loop's own scheduling does not dominate what is measured; receive times use
CLOCK_MONOTONIC, which all processes share). For each of `--notices` flips it records when
every subscriber parsed the `notice` event; spread = max - min over the subscribers.

Printed: spread p50 / p99 / max (ms) over the notices, and the goal (p99 <= 10 ms).
Run: `.venv/bin/python bench/agent_fanout.py` (64 subscribers, 20 notices).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

from spotguard.emulator.control import EmulatorControl
from spotguard.emulator.server import Emulator
from spotguard.wire.sse import SSEDecoder

from _agent_process import start_agent, stop_agent  # bench/_agent_process.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class _Subscriber(asyncio.Protocol):
    """A minimal SSE subscriber: timestamps each read as the socket delivers it (no task per
    connection, so the client's own scheduling adds as little as possible to the spread).
    Chunk-size lines and response headers are not SSE fields, so the decoder ignores them."""

    def __init__(self, host: str, on_snapshot, on_notice):
        self.host, self.on_snapshot, self.on_notice = host, on_snapshot, on_notice
        self.decoder = SSEDecoder()
        self.subscribed = False

    def connection_made(self, transport) -> None:
        transport.write(f"GET /v1/stream HTTP/1.1\r\nHost: {self.host}\r\nAccept: text/event-stream\r\n\r\n".encode())

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        for event in self.decoder.feed(data):
            if event.event == "snapshot" and not self.subscribed:  # not the agent's later complete one
                self.subscribed = True
                self.on_snapshot()
            elif event.event == "notice":
                self.on_notice(event.json()["id"] + "@" + (event.id or ""), now)


def client_process(address: str, count: int, results: mp.Queue, ready: mp.Queue, stop_after: int) -> None:
    """Runs `count` subscribers; puts {notice key: [receive times]} on `results` when done."""
    async def run() -> dict[str, list[float]]:
        loop = asyncio.get_running_loop()
        received: dict[str, list[float]] = {}
        connected = 0
        done = asyncio.Event()

        def on_snapshot() -> None:
            nonlocal connected
            connected += 1
            if connected == count:
                ready.put(count)

        def on_notice(key: str, at: float) -> None:
            received.setdefault(key, []).append(at)
            if sum(1 for t in received.values() if len(t) == count) >= stop_after:
                done.set()

        host, port = address.rsplit(":", 1)
        transports = []
        for _ in range(count):
            transport, _ = await loop.create_connection(lambda: _Subscriber(address, on_snapshot, on_notice),
                                                        host, int(port))
            transports.append(transport)
        await done.wait()
        for transport in transports:
            transport.close()
        return received

    results.put(asyncio.run(run()))


async def flips(url: str, token: str, notices: int, ready: mp.Queue, procs: int) -> None:
    """Waits until every client process is subscribed, then flips a reclaim on and off."""
    async with EmulatorControl(url, token) as control:
        for _ in range(procs):
            await asyncio.to_thread(ready.get, True, 60)
        await asyncio.sleep(0.5)
        for _ in range(notices):
            await control.schedule("reclaim", in_=0.0, lead=120)
            await asyncio.sleep(0.3)
            await control.reset()
            await asyncio.sleep(0.3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--subscribers", type=int, default=64)
    p.add_argument("--notices", type=int, default=20)
    p.add_argument("--procs", type=int, default=2, help="client processes the subscribers are spread over")
    p.add_argument("--cloud", default="gcp", choices=("gcp", "aws"))
    args = p.parse_args(argv)

    async def run() -> list[float]:
        async with Emulator(args.cloud) as emu:
            streams = str(max(512, args.subscribers))  # every subscriber is one client (127.0.0.1)
            proc, address = await asyncio.to_thread(start_agent, args.cloud, emu.url, "--max-streams", streams,
                                                    "--max-streams-per-client", streams)
            ctx = mp.get_context("spawn")
            results, ready = ctx.Queue(), ctx.Queue()
            shares = [args.subscribers // args.procs + (1 if i < args.subscribers % args.procs else 0)
                      for i in range(args.procs)]
            clients = [ctx.Process(target=client_process, args=(address, n, results, ready, args.notices))
                       for n in shares]
            for c in clients:
                c.start()
            try:
                await flips(emu.url, emu.control_token, args.notices + 5, ready, args.procs)
                merged: dict[str, list[float]] = {}
                for _ in clients:
                    part = await asyncio.to_thread(results.get, True, 60)
                    for key, times in part.items():
                        merged.setdefault(key, []).extend(times)
            finally:
                for c in clients:
                    c.join(10)
                    if c.is_alive():
                        c.kill()
                        c.join(5)
                stop_agent(proc)
            complete = [t for t in merged.values() if len(t) == args.subscribers]
            return [max(t) - min(t) for t in complete][: args.notices]

    spreads = asyncio.run(run())
    ms = [s * 1000 for s in spreads]
    print(f"agent fan-out: {args.subscribers} SSE subscribers over {args.procs} client process(es), "
          f"{len(ms)} notices ({args.cloud})")
    print(f"delivery spread (max - min receive time per notice): p50 {pct(ms, 50):.2f}  p99 {pct(ms, 99):.2f}  "
          f"max {max(ms):.2f} ms   goal p99 <= 10 ms: {'met' if pct(ms, 99) <= 10 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
