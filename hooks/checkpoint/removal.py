"""`BackgroundRemoval`: deletes directories already renamed out of sight, on one daemon thread.

Freeing a checkpoint's files is no part of making the next one durable (ext4 takes ~0.35 s per
500 MB here), so a commit's retention renames what it retires to a `.trash-*` name (invisible at
once, durably) and queues the deletion here. The thread starts on the first `remove` and ends
after 5 s without work; `done(timeout)` waits until everything queued is deleted. A process that
ends first leaves the `.trash-*` names, which the store's next open removes.
"""
from __future__ import annotations

import queue
import shutil
import threading
from pathlib import Path

IDLE_SECONDS = 5.0


class BackgroundRemoval:
    """See the module docstring."""

    def __init__(self, thread_name: str = "spotguard-retention"):
        self.thread_name = thread_name
        self._queue: queue.Queue[Path] = queue.Queue()
        self._mutex = threading.Condition()
        self._queued = 0
        self._thread: threading.Thread | None = None

    def remove(self, directory: Path) -> None:
        """Queues `directory` (already out of sight) for deletion."""
        with self._mutex:
            self._queued += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread.start()
            self._queue.put(directory)  # under the mutex: the thread ends only with an empty queue

    def _run(self) -> None:
        while True:
            try:
                directory = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._mutex:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            shutil.rmtree(directory, ignore_errors=True)
            with self._mutex:
                self._queued -= 1
                self._mutex.notify_all()

    def done(self, timeout: float | None = None) -> bool:
        """Waits until every queued directory is deleted; False on timeout."""
        with self._mutex:
            return self._mutex.wait_for(lambda: self._queued == 0, timeout)
