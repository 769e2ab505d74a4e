"""`spotguard bench`: finding bench/, listing the scripts, running one's main with its arguments."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spotguard.bench_cli import BenchNotFound, find_bench_dir, format_listing, list_scripts, script_path
from spotguard.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
WAIT = 60.0  # seconds: bound on every child process (subprocess.run kills it on timeout)


def spotguard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotguard", *args], capture_output=True, text=True,
                          timeout=WAIT, cwd=cwd, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_list_names_every_script_with_its_whole_summary(tmp_path):
    done = subprocess.run([sys.executable, "-m", "spotguard", "bench", "list"], capture_output=True, text=True,
                          timeout=WAIT, cwd=tmp_path,  # from elsewhere: bench/ is found by the package
                          env=dict(os.environ, COLUMNS="100"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 100
    indent = len(lines[0]) - len(lines[0].split(None, 1)[1])
    entries: dict[str, str] = {}  # name -> its summary, continuation lines joined
    for line in lines:
        if line[:indent].strip():
            name, summary = line.split(None, 1)
            entries[name] = summary
        else:
            entries[name] += " " + line.strip()
    scripts = sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
    assert sorted(entries) == [p.stem for p in scripts]
    for script in scripts:
        summary = entries[script.stem]
        # each one whole, never cut mid-sentence (it was: "... the Trainer, Accelerate and")
        assert summary.endswith("."), f"{script.stem}: {summary!r}"
        first_paragraph = " ".join(ast.get_docstring(ast.parse(script.read_text())).split("\n\n")[0].split())
        assert summary == first_paragraph
    assert "spot trace" in entries["goodput"]
    assert entries["integration_overhead"].endswith("the Trainer, Accelerate and Lightning loops with and "
                                                    "without spotguard, in one run.")


def test_listing_wraps_each_summary_beside_its_name():
    summary = "The first sentence of eleven words, then a second one: which wraps."
    listing = format_listing([("a", summary), ("long_name", "Short."), ("none", "")], 60)
    assert listing.split("\n") == ["a          The first sentence of eleven words, then a second",
                                    "           one: which wraps.",
                                    "long_name  Short.",
                                    "none"]
    narrow = format_listing([("a", summary)], 20).split("\n")  # never fewer than 40 characters of text
    assert [len(line) for line in narrow] == [3 + 40, 3 + 26]


def test_runs_a_script_main_with_the_remaining_arguments(tmp_path):
    done = spotguard("bench", "goodput", "--plan", "--time-scale", "300", "--window", "930", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "reclaim   node-1, 10s notice" in done.stdout  # node36, live at the window's start
    assert "running" not in done.stdout  # --plan reached main and stopped before any run


def test_script_argument_errors_are_the_script_s(tmp_path):
    done = spotguard("bench", "goodput", "--workers", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert "--workers" in done.stderr and "must be > 0" in done.stderr


def test_unknown_name_exits_2_and_lists_the_known_ones():
    done = spotguard("bench", "no-such-bench")
    assert done.returncode == 2
    assert "NAME" in done.stderr and "no-such-bench" in done.stderr and "goodput" in done.stderr


def make_tree(root: Path, marker: bool = True) -> Path:
    """A source tree with a spotguard/ package folder and a bench/ with two scripts."""
    (root / "spotguard").mkdir(parents=True)
    (root / "bench").mkdir()
    if marker:
        (root / "pyproject.toml").write_text("[project]\nname = 'spotguard'\n")
    (root / "bench" / "echo_args.py").write_text(textwrap.dedent('''\
        """Echo: prints its arguments and exits with the
        number of them.

        More text that `list` does not show.
        """
        import sys


        def main(argv=None):
            print("argv=" + ",".join(argv))
            return len(argv)
        '''))
    (root / "bench" / "no_doc.py").write_text("def main(argv=None):\n    raise SystemExit('failed: no doc')\n")
    (root / "bench" / "_helper.py").write_text('"""Private helper, not a benchmark."""\n')
    return root / "spotguard"


def test_finds_bench_only_beside_a_source_tree(tmp_path):
    package = make_tree(tmp_path / "checkout")
    assert find_bench_dir(package) == tmp_path / "checkout" / "bench"
    wheel_like = make_tree(tmp_path / "site-packages", marker=False)
    with pytest.raises(BenchNotFound) as caught:
        find_bench_dir(wheel_like)
    assert caught.value.field == "bench" and "source tree" in caught.value.message
    lonely = tmp_path / "lib" / "spotguard"
    lonely.mkdir(parents=True)
    with pytest.raises(BenchNotFound):
        find_bench_dir(lonely)


def test_list_and_lookup_in_a_tree(tmp_path):
    bench = find_bench_dir(make_tree(tmp_path))
    assert list_scripts(bench) == [("echo_args", "Echo: prints its arguments and exits with the number of them."),
                                   ("no_doc", "")]
    assert script_path(bench, "echo-args") == bench / "echo_args.py"
    for bad in ("_helper", "../bench/echo_args", "missing"):
        with pytest.raises(ConfigError) as caught:
            script_path(bench, bad)
        assert caught.value.field == "NAME" and "echo_args" in caught.value.message


def test_run_script_passes_argv_and_returns_its_status(tmp_path):
    bench = find_bench_dir(make_tree(tmp_path))
    code = ("import sys; from pathlib import Path; from spotguard.bench_cli import run_script, script_path; "
            f"b = Path({str(bench)!r}); "
            "rc1 = run_script(script_path(b, 'echo_args'), ['--a', 'b']); "
            "rc2 = run_script(script_path(b, 'no_doc'), []); "
            "print('codes', rc1, rc2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    assert "argv=--a,b" in done.stdout and "codes 2 1" in done.stdout
    assert "failed: no doc" in done.stderr
