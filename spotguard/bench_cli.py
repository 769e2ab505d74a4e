"""`spotguard bench NAME [args]`: run one of the repository's bench/ scripts by name.

    spotguard bench list                   # every script with its docstring's first paragraph
    spotguard bench goodput --workers 2    # runs bench/goodput.py's main(["--workers", "2"])

The scripts live in the source tree, not in the package: bench/ is found next to the
`spotguard` package's folder (an editable install or a checkout on PYTHONPATH). Installed from
a wheel there is no bench/: the command then fails with a message saying so (exit 2).
A name matches `bench/<name>.py`, with `-` read as `_`. The script's `main(argv)` runs in this
process; its return value (or SystemExit code) is the command's exit status.
"""
from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from spotguard.config import ConfigError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class BenchNotFound(ConfigError):
    """There is no bench/ folder beside this installation of spotguard."""


def find_bench_dir(package_dir: Path | None = None) -> Path:
    """The repository's bench/ folder for the `spotguard` package at `package_dir`.

    It is `<package_dir>/../bench`, accepted only when that parent is a spotguard source tree
    (it holds pyproject.toml or setup.py), so a stray bench/ in site-packages never matches.
    Raises BenchNotFound otherwise.
    """
    if package_dir is None:
        package_dir = Path(__file__).resolve().parent
    root = package_dir.parent
    bench = root / "bench"
    if bench.is_dir() and any((root / marker).is_file() for marker in ("pyproject.toml", "setup.py")):
        return bench
    raise BenchNotFound("bench", f"no bench/ folder beside {package_dir}: the benchmarks ship with the source "
                                 "tree only; run them from a checkout (pip install -e .)")


def list_scripts(bench_dir: Path) -> list[tuple[str, str]]:
    """(name, summary) of every bench/<name>.py, read without importing it: the summary is the
    docstring's first paragraph on one line (a summary may be wrapped over several lines)."""
    out = []
    for path in sorted(bench_dir.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        except (SyntaxError, UnicodeDecodeError, OSError) as exc:
            doc = f"(unreadable: {exc.__class__.__name__})"
        out.append((path.stem, " ".join(doc.strip().split("\n\n")[0].split())))
    return out


def format_listing(scripts: list[tuple[str, str]], columns: int) -> str:
    """The names in one column, each summary wrapped whole beside its name to `columns`
    (at least 40 characters of text per line)."""
    width = max((len(n) for n, _ in scripts), default=0)
    text_width = max(columns - width - 2, 40)
    lines = []
    for name, summary in scripts:
        wrapped = textwrap.wrap(summary, text_width) or [""]
        lines.append(f"{name:<{width}}  {wrapped[0]}".rstrip())
        lines += [" " * (width + 2) + more for more in wrapped[1:]]
    return "\n".join(lines)


def script_path(bench_dir: Path, name: str) -> Path:
    """bench/<name>.py (`-` read as `_`), or ConfigError("NAME") listing the known names."""
    stem = name.replace("-", "_")
    path = bench_dir / f"{stem}.py"
    if not NAME.match(name) or stem.startswith("_") or not path.is_file():
        known = ", ".join(n for n, _ in list_scripts(bench_dir)) or "none"
        raise ConfigError("NAME", f"no bench script {name!r} in {bench_dir} (known: {known}; "
                                  "`spotguard bench list` describes them)")
    return path


# Runs in a fresh interpreter: the script is loaded as `__main__` from its own file, so its own
# `if __name__ == "__main__"` block runs as with `python bench/NAME.py`, and worker processes it
# starts with the "spawn" method can import it again; a script without that block gets main(argv).
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "path = sys.argv[1]\n"
    "sys.argv = [path, *sys.argv[2:]]\n"
    "sys.path.insert(0, path.rsplit('/', 1)[0])\n"
    "spec = importlib.util.spec_from_file_location('__main__', path)\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "module.__spec__ = None\n"  # spawned workers then re-import the script from __file__, as for `python FILE`
    "sys.modules['__main__'] = module\n"
    "spec.loader.exec_module(module)\n"
    "main = getattr(module, 'main', None)\n"
    "if not callable(main):\n"
    "    raise SystemExit(f'{path} has no main(argv) function')\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_script(path: Path, argv: list[str]) -> int:
    """Runs the script at `path` in its own Python process; returns the exit status of its
    `main(argv)` (SystemExit("message") prints the message and gives 1, as Python does)."""
    return subprocess.run([sys.executable, "-c", _BOOTSTRAP, str(path), *argv]).returncode


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark script from the repository's bench/ folder",
        description="Run bench/NAME.py's main with the remaining arguments; `spotguard bench list` lists "
                    "the scripts. Needs the source tree (an editable install).")
    p.add_argument("name", metavar="NAME", nargs="?", default="list", help="script name, or `list` (default)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (try NAME --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bench_dir = find_bench_dir()
    if args.name == "list":
        print(format_listing(list_scripts(bench_dir), shutil.get_terminal_size().columns))
        return 0
    return run_script(script_path(bench_dir, args.name), list(args.args))
