"""The NVML event-waiter thread of the GPU source.

Contract: `EventWaiter(backend, wait_timeout_ms, post)`; `start()` runs a daemon thread that
blocks in `backend.wait_event(wait_timeout_ms)` (a Timeout is normal) and calls `post(item)`
with each `GpuEvent`, or with a marker: ("lost", None) once per run of GpuIsLost,
("polling", exc) when the wait is unavailable (NotSupported / FunctionNotFound: the thread ends),
("error", exc) for any other failure. After a failure it waits with exponential backoff (0.5 s
doubling, 30 s at most). `post` returns False when nobody listens any more: the thread ends.
`stop(timeout)` ends the thread (blocking: call it from a thread, never the event loop).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from spotguard.agent.gpu.backend import GpuBackend

log = logging.getLogger("spotguard.agent.sources.gpu")


class EventWaiter:
    def __init__(self, backend: GpuBackend, wait_timeout_ms: int, post: Callable[[Any], bool]):
        self.backend = backend
        self.wait_timeout_ms = wait_timeout_ms
        self._post = post
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="gpu-event-wait", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        import pynvml as nvml

        failures = 0
        lost_reported = False
        while not self._stop.is_set():
            try:
                event = self.backend.wait_event(self.wait_timeout_ms)
            except nvml.NVMLError_Timeout:
                failures = 0
                continue
            except nvml.NVMLError_GpuIsLost:
                if not lost_reported and not self._post(("lost", None)):
                    return
                lost_reported = True
                failures += 1
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as exc:
                self._post(("polling", exc))
                return
            except nvml.NVMLError as exc:
                if not self._post(("error", exc)):
                    return
                failures += 1
            except Exception as exc:  # a backend bug must not kill the waiter silently
                log.exception("gpu: event wait failed")
                if not self._post(("error", exc)):
                    return
                failures += 1
            else:
                failures = 0
                lost_reported = False
                if not self._post(event):
                    return
                continue
            self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)))
