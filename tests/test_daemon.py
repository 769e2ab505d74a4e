"""spotguard.daemon: the one runner of every long-running command (signals -> graceful stop)."""
from __future__ import annotations

import asyncio
import os
import signal

from spotguard.daemon import run_daemon, until_stopped


def test_sigterm_sets_stop_and_main_returns_the_exit_status():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []

    async def main(stop: asyncio.Event) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.wait_for(stop.wait(), 10)
            return 7
        finally:
            cleaned.append(True)

    assert run_daemon(main) == 7 and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler went away with the loop


def test_the_handlers_the_process_had_come_back_after_the_loop():
    """A process with its own SIGTERM handler (a Guard's, in a training process) gets it back:
    asyncio leaves SIG_DFL behind when its loop closes."""
    seen = []

    def own(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        async def main(stop: asyncio.Event) -> int:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 10)
            return 3

        assert run_daemon(main) == 3 and seen == []  # the loop's handler took it
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigint_is_a_graceful_stop_too_and_none_means_0():
    async def main(stop: asyncio.Event) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 10)

    assert run_daemon(main) == 0


def test_until_stopped_cancels_the_work_and_awaits_its_cleanup():
    cleaned = []

    async def forever() -> int:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)
            cleaned.append(True)
        return 1

    async def main(stop: asyncio.Event) -> int:
        asyncio.get_running_loop().call_soon(stop.set)
        return 5 if await until_stopped(stop, forever()) is None else 6

    assert run_daemon(main) == 5 and cleaned == [True]


def test_until_stopped_returns_the_result_of_work_that_finishes_first():
    async def quick() -> int:
        return 3

    async def main(stop: asyncio.Event) -> int:
        return await until_stopped(stop, quick())

    assert run_daemon(main) == 3
