"""The one way a long-running spotguard command runs: logging, signals, event loop.

Contract of `run_daemon(main, log_level=...)`:
- with `log_level`, logs go to stderr as JSON lines (`spotguard.logs.setup_logging`) first;
  without it, logging is left as it is (commands that print their own output);
- `main(stop)` runs in a fresh event loop (`asyncio.run`); `stop` is an `asyncio.Event` that
  SIGTERM and SIGINT set. That is the graceful stop: `main` finishes or cancels its work, cleans
  up and returns. A second signal sets the event again and changes nothing; the handlers go
  away with the loop, and the handlers the process had before come back;
- the return value is `main`'s (None counts as 0), the command's exit status; stdout is flushed
  before it returns, so a JSON line printed at start is never lost in a buffer.
"""
from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_daemon(main: Callable[[asyncio.Event], Awaitable[int | None]], *, log_level: str | None = None) -> int:
    """Runs `main(stop)` until it returns; see the module docstring."""
    if log_level is not None:
        from spotguard.logs import setup_logging

        setup_logging(log_level)
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        return asyncio.run(_run(main))
    finally:
        for sig, handler in before.items():  # asyncio leaves SIG_DFL behind, whatever was there
            if handler is not None:
                signal.signal(sig, handler)


async def _run(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        return int(await main(stop) or 0)
    finally:
        sys.stdout.flush()


async def until_stopped(stop: asyncio.Event, work: Awaitable[int | None]) -> int | None:
    """Runs `work` until it finishes or `stop` is set. Finished: its result (or its exception).
    Stopped first: the work is cancelled, its cleanup awaited, and the answer is None."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None
