"""Notice -> reclaim hooks started on every rank: how long, for a notice that reaches one rank.

    .venv/bin/python bench/guard_reaction.py                   # 4 ranks, 50 ms steps, 8 trials per path
    .venv/bin/python bench/guard_reaction.py --trials 40

Each rank trains with a 50 ms synthetic step (sleep + a DDP step on gloo) and a blocking Guard
(agree every step, `exit_on_drain=False`, so one job serves many trials). Only the last rank is
connected to the sidecar (a real aiohttp SSE server in this process) and only it gets the
signals. A trial sends one notice at a random moment of a step, alternating between the two
paths: the sidecar stream (`event: notice`) and a signal (SIGUSR1, configured as the Guard's
extra signal). The figure is max over ranks of (reclaim hook start - send time); the goal is
<= one step time + 20 ms (the step time measured in the same run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--trials", type=int, default=8, help="trials per path (sidecar, signal)")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--agreement", choices=("blocking", "piggyback", "both"), default="both",
                   help="the Guard's own all_reduce, or the flag inside DDP's gradient all_reduce (default: both)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- worker ------------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.guard import Guard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    guard = Guard.from_env(agree_every=1, exit_on_drain=False, extra_signals=(signal.SIGUSR1,))
    if args.agreement == "piggyback":
        assert guard.piggyback_on(model)
    out = Path(args.out)
    log = open(out / f"hooks-{rank}.jsonl", "a")

    drains = []

    @guard.on_reclaim
    def started(step, notice):
        drains.append(step)
        received = guard.listener.last_notice_at if guard.listener is not None else None
        log.write(json.dumps({"t": time.time(), "id": notice.id, "step": step, "received": received}) + "\n")
        log.flush()

    (out / f"ready-{rank}").write_text("1")
    step = 0
    while len(drains) < 2 * args.trials:  # every rank drains at the same steps, so all stop together
        time.sleep(args.step_ms / 1000)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        guard.step(step)
        step += 1
    guard.close()
    dist.barrier()
    dist.destroy_process_group()


# ---- the sidecar stand-in (real SSE over 127.0.0.1) -----------------------------------------------
class Sidecar:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.queues: list[asyncio.Queue] = []
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        from aiohttp import web

        async def stream(request):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            queue: asyncio.Queue = asyncio.Queue()
            self.queues.append(queue)
            from spotguard.wire.sse import encode

            await response.write(encode("snapshot", {"v": 1, "node": "bench", "notices": []}, 0))
            while (frame := await queue.get()) is not None:
                await response.write(frame)
            return response

        async def hooks(request):
            await request.read()
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/v1/stream", stream)
        app.router.add_post("/v1/hooks", hooks)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def send(self, frame: bytes) -> None:
        self.loop.call_soon_threadsafe(lambda: [q.put_nowait(frame) for q in self.queues])

    def close(self) -> None:
        self.send(None)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    modes = ("blocking", "piggyback") if args.agreement == "both" else (args.agreement,)
    for mode in modes:
        args.agreement = mode
        measure(args)
    return 0


def measure(args) -> None:
    from spotguard.wire.notice import Notice, now_utc
    from spotguard.wire.sse import encode

    sidecar = Sidecar()
    target = args.ranks - 1
    procs: list[subprocess.Popen] = []
    results = {"sidecar": [], "signal": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        try:
            port = str(free_port())
            for rank in range(args.ranks):
                env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
                env.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, OMP_NUM_THREADS="1")
                if rank == target:
                    env["SPOTGUARD_SIDECAR_URL"] = sidecar.url
                procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--out", tmp,
                                               "--step-ms", str(args.step_ms), "--trials", str(args.trials),
                                               "--agreement", args.agreement], env=env))
            wait_for(lambda: all((out / f"ready-{r}").exists() for r in range(args.ranks)) and sidecar.queues, 120,
                     "workers did not start")
            time.sleep(0.5)
            rng = random.Random(1)
            for trial in range(2 * args.trials):
                path = "sidecar" if trial % 2 == 0 else "signal"
                time.sleep(0.2 + rng.uniform(0, args.step_ms / 1000))
                sent = time.time()
                if path == "sidecar":
                    now = now_utc()
                    notice = Notice(id=f"bench:{trial}", kind="reclaim", source="bench", node="bench",
                                    detected_at=now, deadline=now + timedelta(seconds=120))
                    sidecar.send(encode("notice", notice.to_wire(), trial + 1))
                else:
                    os.kill(procs[target].pid, signal.SIGUSR1)

                def lines(rank):
                    path_ = out / f"hooks-{rank}.jsonl"
                    return path_.read_text().splitlines() if path_.exists() else []

                wait_for(lambda: all(len(lines(r)) > trial for r in range(args.ranks)), 30, f"trial {trial} not seen")
                starts = [json.loads(lines(r)[trial])["t"] for r in range(args.ranks)]
                if os.environ.get("BENCH_DEBUG") and path == "sidecar":
                    rec = json.loads(lines(target)[trial])["received"]
                    print(f"trial {trial}: received after {(rec - sent) * 1000:.1f} ms, "
                          f"hooks after {(max(starts) - sent) * 1000:.1f} ms")
                results[path].append(max(starts) - sent)
            first, last = json.loads(lines(0)[0]), json.loads(lines(0)[-1])
            step_seconds = (last["t"] - first["t"]) / max(1, last["step"] - first["step"])
            for p in procs:
                p.wait(30)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            sidecar.close()
    goal = step_seconds + 0.020
    print(f"guard_reaction [{args.agreement}]: {args.ranks} ranks, gloo, {args.step_ms:.0f} ms synthetic step "
          f"(measured step {step_seconds * 1000:.1f} ms), notice to rank {target} only, {args.trials} trials per path")
    for path, values in results.items():
        worst = max(values)
        print(f"  {path:8} notice -> hooks started on all ranks: median {statistics.median(values) * 1000:6.1f} ms, "
              f"max {worst * 1000:6.1f} ms (goal <= step + 20 = {goal * 1000:.0f} ms: "
              f"{'met' if worst <= goal else 'NOT met'})")


if __name__ == "__main__":
    raise SystemExit(main())
