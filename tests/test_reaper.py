"""The dry-run's reaper finds and ends the processes it marked, whatever psutil remembers.

psutil's `process_iter` keeps the `Process` objects of earlier calls; when a PID is reused (this
machine's pid_max is 32768, and a CI run starts tens of thousands of processes), the kept object
is the earlier process's, and psutil refuses to signal it (NoSuchProcess: "PID reused"). The
test makes that state on purpose: a live marked process whose PID psutil's cache holds with an
earlier creation time, as a reused PID leaves it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from spotguard.trainer.reaper import POD_ENV, kill_marked, marked, new_token


def test_a_marked_process_whose_pid_psutil_remembers_from_an_earlier_process_is_killed():
    token = new_token()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={**os.environ, POD_ENV: token})
    try:
        deadline = time.monotonic() + 30
        while not any(p.pid == child.pid for p in marked(token, POD_ENV)):
            assert time.monotonic() < deadline, "the child never showed its mark"
            time.sleep(0.05)
        list(psutil.process_iter())  # psutil's cache now holds the child's PID
        cache = getattr(psutil, "_pmap", None)
        if not isinstance(cache, dict) or child.pid not in cache:
            pytest.skip("this psutil keeps no process_iter cache to go stale")
        stale = cache[child.pid]
        stale._create_time = stale.create_time() - 1000.0  # the object of an earlier process with this PID
        stale._ident = (child.pid, stale._create_time)
        with pytest.raises(psutil.NoSuchProcess):
            stale.send_signal(0)  # what psutil does with such an object
        assert kill_marked(token, POD_ENV) == [child.pid]  # it waited for the child's end (and reaped it)
        assert not psutil.pid_exists(child.pid)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
