"""`spotguard demo`, as the README's set-up shows it: for each cloud, the emulator serves a
reclaim notice and the cloud's own source reports it, with the time it took."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLOUD_SOURCES = {"aws": ("aws.spot", 4), "gcp": ("gcp.preempted", 2), "azure": ("azure.events", 1),
                 "alibaba": ("alibaba.spot", 1)}


def readme_demo_command() -> list[str]:
    """The README's `spotguard demo` line in its set-up block, as arguments after `spotguard`."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set-up", 1)[1].split("```", 2)[1]
    [line] = [ln for ln in setup.splitlines() if ln.startswith(".venv/bin/spotguard demo")]
    return line.split("#", 1)[0].split()[1:]


def test_the_readme_demo_detects_a_reclaim_on_every_cloud():
    args = readme_demo_command()
    assert args == ["demo"]
    done = subprocess.run([sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr
    for cloud, (source, count) in CLOUD_SOURCES.items():
        polling = f"{count} source{'s' if count > 1 else ''} polling"
        assert re.search(rf"^\[{cloud}\] emulator on http://127\.0\.0\.1:\d+; {polling}; reclaim in 2s$",
                         done.stdout, re.M), done.stdout
        assert re.search(rf"^\[{cloud}\] detected reclaim from {re.escape(source)} id=\S+ \d+ ms after the "
                         r"emulator served it; deadline in \d+s$", done.stdout, re.M), done.stdout
