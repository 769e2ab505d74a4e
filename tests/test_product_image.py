"""The product image leaves the test doubles and the dry-run out.

- No product module (agent, hooks, supervisor, injector, spotguard/*) imports
  `spotguard.emulator` or `spotguard.trainer`, at import time or inside a function (read from
  the source, so a lazy import cannot hide either).
- A wheel built with SPOTGUARD_PARTS=product (as daemonset/Dockerfile builds it) holds no
  emulator, trainer or fake NVML module; installed alone, the product's entry modules import,
  and the test-double commands exit 2 saying they are not installed.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_FOLDERS = ("spotguard", "agent", "hooks", "supervisor", "injector")
TEST_DOUBLE_PACKAGES = ("spotguard.emulator", "spotguard.trainer")
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` statement in `path` names (absolute imports; the code uses no
    relative ones), wherever the statement sits."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_product_module_imports_a_test_double_or_the_dry_run():
    offenders = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in imported_modules(path):
                if any(name == pkg or name.startswith(pkg + ".") for pkg in TEST_DOUBLE_PACKAGES):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


def build_product_wheel(tmp_path: Path) -> Path:
    """A wheel of a fresh copy of the tree (every part copied, so the setting alone leaves
    some out), built as the Dockerfile does; no network, no build isolation."""
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in (*PRODUCT_FOLDERS, "emulator", "trainer"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    env = {**os.environ, "SPOTGUARD_PARTS": "product", "PIP_NO_INDEX": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(src)],
                   check=True, env=env, timeout=120, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("spotguard-*.whl")
    return wheel


def test_the_product_wheel_holds_no_test_doubles_and_runs_alone(tmp_path):
    wheel = build_product_wheel(tmp_path)
    files = zipfile.ZipFile(wheel).namelist()
    modules = [f for f in files if f.endswith(".py")]
    assert "spotguard/agent/app.py" in modules and "spotguard/injector/patch.py" in modules
    assert [f for f in modules if f.startswith(("spotguard/emulator/", "spotguard/trainer/"))] == []
    assert [f for f in files if "fake_backend" in f or f.endswith("/nvml.py") or "scenarios/" in f] == []

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, timeout=120, capture_output=True)
    # -S: no site processing, so the dev venv's editable finder cannot supply the missing parts;
    # its third-party packages come in as a plain path after the wheel's own folder.
    third_party = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{third_party}"}
    env.pop("SPOTGUARD_PARTS", None)

    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    imported = python("import spotguard, spotguard.agent.app, spotguard.hooks.guard, spotguard.supervisor.controller, "
                      "spotguard.injector.patch, spotguard.cli; print(spotguard.__file__)")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(target))
    missing = python("import spotguard.emulator")
    assert missing.returncode == 1 and "No module named 'spotguard.emulator'" in missing.stderr

    for command, part in (("emulate", "spotguard.emulator"), ("dry-run", "spotguard.trainer"),
                          ("demo", "spotguard.emulator")):
        result = python(f"from spotguard.cli import main; raise SystemExit(main([{command!r}, '--cloud', 'aws']))")
        assert result.returncode == 2, result.stderr
        assert f"spotguard {command}: error: {command}: {part} is not installed" in result.stderr
    fake_gpu = python("from spotguard.agent.gpu.select import make_backend\n"
                      "from spotguard.config import ConfigError\n"
                      "try:\n    make_backend('fake:x.yaml')\nexcept ConfigError as exc:\n    print(exc.field)")
    assert fake_gpu.returncode == 0 and fake_gpu.stdout.strip() == "--gpu", fake_gpu.stderr
