"""What a fresh clone's `make run` / `make test` prints while it installs.

- Building spotguard (as `pip install -e .` does, through setuptools' own backend) raises no
  setuptools warning of our making: the license is an SPDX string (PEP 639), and the bundled
  scenario and trace folders are declared packages. The wheel still holds those data files.
- `make install` prints one line (what it installs, where, about how long, where the log is),
  keeps pip's and the build backends' output in that log, and on a failed step prints the log's
  tail (the error included) and fails. The real Makefile runs, with a Python whose `-m venv`
  makes a venv of stand-in `pip` and `python` commands (the real install takes minutes and needs
  the package index).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PART_FOLDERS = ("spotguard", "agent", "hooks", "supervisor", "injector", "integrations", "emulator", "trainer")

# Builds the wheel with setuptools' PEP 517 backend and prints the warnings it raised as JSON.
BUILD_RECORDING_WARNINGS = """
import json, sys, warnings
from setuptools import build_meta
with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    build_meta.build_wheel(sys.argv[1])
print(json.dumps([f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in raised]))
"""


def test_building_spotguard_raises_no_setuptools_warning_and_keeps_the_bundled_data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in PART_FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-c", BUILD_RECORDING_WARNINGS, str(tmp_path / "dist")], cwd=src,
                           capture_output=True, text=True, timeout=180,
                           env={**os.environ, "SPOTGUARD_PARTS": "all"})
    assert built.returncode == 0, built.stderr[-3000:]
    warnings = json.loads(built.stdout.strip().splitlines()[-1])
    assert warnings == []

    [wheel] = (tmp_path / "dist").glob("spotguard-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    scenarios = {f"spotguard/trainer/scenarios/{p.name}" for p in (ROOT / "trainer/scenarios").glob("*.yaml")}
    traces = {f"spotguard/trainer/traces/{p.name}" for p in (ROOT / "trainer/traces").iterdir()
              if p.suffix in (".csv", ".md")}
    assert scenarios and traces and scenarios | traces <= files
    metadata = zipfile.ZipFile(wheel).read(next(f for f in files if f.endswith(".dist-info/METADATA")))
    assert "License-Expression: Apache-2.0" in metadata.decode()


# A stand-in for the interpreter the Makefile starts from: `-m venv DIR` makes DIR/bin/pip and
# DIR/bin/python, which print what pip and setuptools print (warnings by the dozen) and succeed,
# except the pip call whose arguments contain $FAIL_ON, which fails as pip does.
FAKE_PYTHON = r"""#!/bin/sh
[ "$1 $2" = "-m venv" ] || { echo "fake python: unexpected $*" >&2; exit 9; }
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'EOF'
#!/bin/sh
i=0
while [ $i -lt 30 ]; do
  echo "  BuildBackendWarning: \`project.license\` as a TOML table is deprecated ($i)" >&2
  echo "WARNING: Location 'file:///opt/index/x/' is ignored" >&2
  i=$((i + 1))
done
case "$*" in
  *"$FAIL_ON"*) echo "ERROR: No matching distribution found for $FAIL_ON" >&2; exit 1 ;;
esac
echo "pip $*" >> "$(dirname "$0")/../pip-calls"
"""
FAKE_VENV_PYTHON = r"""
cat > "$3/bin/python" <<'EOF'
#!/bin/sh
echo "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU."
echo "python $*" >> "$(dirname "$0")/../python-calls"
EOF
chmod +x "$3/bin/pip" "$3/bin/python"
"""


def make_install(tmp_path: Path, fail_on: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`make install` of the real Makefile in a copy of the files its install target depends on."""
    work = tmp_path / "clone"
    work.mkdir()
    for name in ("Makefile", "pyproject.toml", "setup.py", "constraints.txt"):
        shutil.copy2(ROOT / name, work / name)
    fake_python = tmp_path / "python3"
    fake_python.write_text(FAKE_PYTHON + "EOF\n" + FAKE_VENV_PYTHON)
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    result = subprocess.run(["make", "--no-print-directory", "install", f"PYTHON={fake_python}"], cwd=work,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "FAIL_ON": fail_on, "MAKEFLAGS": ""})
    return result, work / ".venv"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_prints_one_line_and_logs_the_rest(tmp_path):
    result, venv = make_install(tmp_path, fail_on="no-such-argument")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "installing spotguard and its dependencies into .venv (about 2 minutes on a quiet machine; "
        "log: .venv/install.log)"]
    assert result.stderr == ""
    assert (venv / ".spotguard-installed").exists()
    calls = (venv / "pip-calls").read_text().splitlines()
    assert calls[1] == "pip install -q -c constraints.txt torch==2.13.0"
    assert calls[3].startswith("pip install -q -c constraints.txt -e .[train,deepspeed,hf,")
    assert (venv / "python-calls").read_text() == "python tools/prebuild_deepspeed_op.py\n"
    log = (venv / "install.log").read_text()
    assert log.count("BuildBackendWarning") == 4 * 30 and "Setting accelerator to CPU" in log
    assert "+ DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints.txt --no-build-isolation deepspeed" in log


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_failed_install_step_prints_the_logs_tail_and_fails(tmp_path):
    result, venv = make_install(tmp_path, fail_on="torch==2.13.0")
    assert result.returncode != 0
    assert result.stdout.splitlines() == [
        "installing spotguard and its dependencies into .venv (about 2 minutes on a quiet machine; "
        "log: .venv/install.log)"]
    err = result.stderr.splitlines()
    assert "ERROR: No matching distribution found for torch==2.13.0" in err
    assert "make install: failed (above: the last 40 lines of .venv/install.log)" in err
    assert not (venv / ".spotguard-installed").exists()
    assert "deepspeed" not in (venv / "pip-calls").read_text()
