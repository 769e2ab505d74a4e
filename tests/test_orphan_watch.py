"""The orphan watch's trigger (hooks/orphan_watch.py); its effect on real workers under a real
launcher is in tests/test_in_place_faults.py."""
from __future__ import annotations

import os
import subprocess
import sys

from spotguard.hooks.orphan_watch import OrphanWatch
from spotguard.wire import names


def test_only_a_worker_of_spotguard_launch_is_watched():
    assert OrphanWatch.from_env(2.0, {}) is None
    assert OrphanWatch.from_env(2.0, {names.ENV_LAUNCHER_PID: "x"}) is None
    assert OrphanWatch.from_env(2.0, {names.ENV_LAUNCHER_PID: "123"}).launcher_pid == 123


def test_a_launcher_that_is_not_the_parent_counts_while_it_runs():
    """`spotguard launch bash run.sh`: the Guard's parent is the shell, the launcher above it."""
    assert not OrphanWatch(os.getppid(), 1.0).launcher_gone()  # our parent stands in for the launcher
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert OrphanWatch(gone.pid, 1.0).launcher_gone()
