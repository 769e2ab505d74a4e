"""Each Dockerfile in daemonset/ builds: the wheel it builds, from exactly the files its COPY lines
put in the build (there is no container engine here, so the image itself is not built), with the
SPOTGUARD_PARTS its RUN line sets. The README's install tells users to build both images."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = {  # the spotguard subpackages each image's wheel holds
    "Dockerfile": {"agent", "hooks", "supervisor", "injector"},
    "Dockerfile.train": {"agent", "hooks", "supervisor", "injector", "trainer", "emulator", "integrations"},
}


def build_context(dockerfile: Path) -> tuple[list[str], str]:
    """(the repository paths its COPY lines copy from the build context, the SPOTGUARD_PARTS it builds with)."""
    copied: list[str] = []
    parts = "all"
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--from"):
            copied += words[1:-1]
        setting = re.search(r"\bSPOTGUARD_PARTS=(\w+)", line)
        if words[:1] == ["RUN"] and setting:
            parts = setting.group(1)
    return copied, parts


@pytest.mark.parametrize("name", sorted(PARTS))
def test_the_wheel_each_dockerfile_builds_builds_from_what_it_copies(tmp_path, name):
    copied, parts = build_context(ROOT / "daemonset" / name)
    assert "pyproject.toml" in copied and "setup.py" in copied
    src = tmp_path / "src"
    src.mkdir()
    for path in copied:
        if (ROOT / path).is_dir():
            shutil.copytree(ROOT / path, src / path, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / path, src / path)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                           timeout=180, env={**os.environ, "SPOTGUARD_PARTS": parts, "PIP_NO_INDEX": "1"})
    # Dockerfile.train used to fail here: "error: package directory 'integrations' does not exist"
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("spotguard-*.whl")
    packages = {f.split("/")[1] for f in zipfile.ZipFile(wheel).namelist()
                if f.startswith("spotguard/") and f.endswith("/__init__.py") and f.count("/") == 2}
    shipped_with_every_part = {p.name for p in (ROOT / "spotguard").iterdir() if (p / "__init__.py").exists()}
    assert packages - shipped_with_every_part == PARTS[name]
    assert shipped_with_every_part <= packages
