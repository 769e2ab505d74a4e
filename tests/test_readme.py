"""Every command the README and docs/*.md tell a user to run is accounted for, and the Python they
show still names what exists.

Commands are the lines of the shell code blocks (```bash, ```sh, ```console: there only the
lines after `$ `), with `\\` continuations joined, comments and heredoc bodies dropped. Each must
be one of:
- a `spotguard ...` / `.venv/bin/spotguard ...` / `kubectl spotguard ...` command: parsed by the
  real CLI's argparse parser, so a renamed subcommand or flag fails here; `spotguard bench NAME
  ARGS` also needs bench/NAME.py and every `--flag` of ARGS in that script's source (the same
  holds for the inline `spotguard bench ...` commands of the benchmark tables); `bash bench/X.sh
  [python3 bench/Y.py ARGS]` needs the scripts and Y's flags;
- a command listed in RUN_BY below, with the test or CI step that runs it (each named test
  function must exist: the table cannot rot);
- a command listed in NOT_RUN_HERE, with why nothing here can run it.

Python blocks are compiled, and every name they import from spotguard must exist.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from spotguard.cli import build_kubectl_parser, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = ("bash", "sh", "console")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")

# command (how it starts, after any VAR=value prefixes) -> what runs it: "tests/FILE.py::FUNCTION",
# or a CI step ".ci/run: <the step>" (.ci/run runs `make lint` and `make test`).
RUN_BY = {
    # the default scenario, shortened; `make run` itself is `spotguard dry-run` (test_make_run_is_the_dry_run)
    "make run": "tests/test_dryrun_truth.py::test_the_default_path_changes_membership_in_place_and_says_so_truly",
    "make test": ".ci/run: make test",
    "mkdir -p my-spotguard && cat > my-spotguard/kustomization.yaml":
        "tests/test_k8s_install.py::test_the_readme_install_on_a_cluster_it_was_never_installed_on",
    "kubectl apply -f daemonset/base/namespace.yaml":
        "tests/test_k8s_install.py::test_the_readme_install_on_a_cluster_it_was_never_installed_on",
    "kubectl apply -k my-spotguard/":
        "tests/test_k8s_install.py::test_the_readme_install_on_a_cluster_it_was_never_installed_on",
    "kubectl -n spotguard delete job spotguard-injector-certgen --ignore-not-found":
        "tests/test_k8s_install.py::test_the_readme_install_on_a_cluster_it_was_never_installed_on",
    ".venv/bin/python -m pytest tests/test_checkpoint_crash.py":  # with more trials than CI's 30 per lane
        "tests/test_checkpoint_crash.py::test_sigkill_during_saves_never_loses_the_newest_checkpoint",
}
# command -> why nothing here runs it, and what checks the nearest thing.
NOT_RUN_HERE = {
    "docker build -f daemonset/Dockerfile": "no container engine here; tests/test_images.py builds the "
                                            "wheel each Dockerfile builds, from what its COPY lines name",
    "docker push ": "no registry here; the push is the user's",
}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def shell_commands(language: str, body: str) -> list[str]:
    """The commands of one shell block: continuations joined, comments and heredoc bodies dropped."""
    lines, commands, heredoc, pending = body.splitlines(), [], None, ""
    for line in lines:
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if language == "console":
            if not line.startswith("$ ") and not pending:
                continue  # output
            line = line[2:] if line.startswith("$ ") else line
        line = re.sub(r"(^|\s+)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if not command:
            continue
        marker = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", command)
        if marker:
            heredoc = marker.group(1)
        commands.append(command)
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every command in the shell blocks of the README and docs/*.md."""
    found = []
    for path in DOCS:
        for language, body in code_blocks(path.read_text(encoding="utf-8")):
            if language in SHELL_LANGUAGES:
                found += [(path.name, c) for c in shell_commands(language, body)]
    return found


def inline_bench_commands() -> list[tuple[str, str]]:
    """(file, command) for every inline `spotguard bench ...` / `bash bench/...` span (the
    benchmark tables)."""
    return [(path.name, m.group(1)) for path in DOCS
            for m in re.finditer(r"`((?:spotguard bench|bash bench/)[^`]+)`", path.read_text(encoding="utf-8"))]


def words_of(command: str) -> list[str]:
    """The command's words without leading VAR=value assignments."""
    words = shlex.split(command)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words


def cli_parser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]] | None:
    """(the parser, its arguments) when the words are a spotguard command, else None."""
    if words and words[0] in ("spotguard", ".venv/bin/spotguard"):
        return build_parser(), words[1:]
    if words[:2] == ["kubectl", "spotguard"]:
        return build_kubectl_parser(), words[2:]
    return None


def string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def check_bench_script(script: Path, args: list[str]) -> list[str]:
    """Problems with running `script` with `args`: a missing script or a flag it does not define."""
    if not script.is_file():
        return [f"{script.relative_to(ROOT)} does not exist"]
    if script.suffix != ".py":
        return []
    known = string_constants(script)
    return [f"{script.name} defines no {flag}" for flag in (a.split("=", 1)[0] for a in args)
            if flag.startswith("--") and flag not in known]


def check_cli(words: list[str]) -> list[str]:
    """Problems with a spotguard command: what argparse refuses, and for `bench`, its script's flags."""
    parser, argv = cli_parser(words)  # type: ignore[misc]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit:
        return [f"the CLI refuses it: {errors.getvalue().strip().splitlines()[-1:]}"]
    if getattr(args, "command", None) == "bench" and args.name not in ("list", "all"):
        return check_bench_script(ROOT / "bench" / f"{args.name}.py", args.args)
    return []


def check_bench_wrapper(words: list[str]) -> list[str]:
    """`bash bench/X.sh [python3 bench/Y.py ARGS]`: the scripts exist, Y defines the flags."""
    problems = check_bench_script(ROOT / words[1], [])
    scripts = [i for i, w in enumerate(words) if w.startswith("bench/") and w.endswith(".py")]
    for i in scripts:
        problems += check_bench_script(ROOT / words[i], words[i + 1:])
    return problems


def runner_exists(runner: str) -> bool:
    """A `tests/FILE.py::FUNCTION` whose function is defined, or a CI step of .ci/run."""
    if runner.startswith(".ci/run: "):
        return runner.split(": ", 1)[1] in (ROOT / ".ci" / "run").read_text()
    file, _, function = runner.partition("::")
    path = ROOT / file
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
               for n in ast.walk(tree))


def account_for(command: str) -> list[str]:
    """Why `command` is not accounted for (empty when it is)."""
    words = words_of(command)
    if cli_parser(words) is not None:
        return check_cli(words)
    if words[:1] == ["bash"] and len(words) > 1 and words[1].startswith("bench/"):
        return check_bench_wrapper(words)
    plain = " ".join(words)
    if any(plain.startswith(prefix) for prefix in RUN_BY) or any(plain.startswith(p) for p in NOT_RUN_HERE):
        return []
    return ["no test or CI step is known to run it: add it to RUN_BY in tests/test_readme.py with the "
            "test (tests/FILE.py::FUNCTION) or CI step that runs it, write such a test, or take the "
            "command out of the docs"]


def test_the_docs_have_commands_to_check():
    commands = [c for _, c in documented_commands()]
    assert "make run" in commands and "make test" in commands
    assert any(c.startswith("spotguard launch") for c in commands)
    assert len(inline_bench_commands()) >= 10


@pytest.mark.parametrize("where, command", documented_commands() + inline_bench_commands())
def test_every_documented_command_is_accounted_for(where, command):
    problems = account_for(command)
    assert not problems, f"{where}: `{command}`: " + "; ".join(problems)


@pytest.mark.parametrize("runner", sorted(set(RUN_BY.values())))
def test_every_runner_in_the_table_exists(runner):
    assert runner_exists(runner), f"RUN_BY names {runner}, which does not exist"


def test_the_table_lists_only_commands_the_docs_still_show():
    shown = [" ".join(words_of(c)) for _, c in documented_commands()]
    for prefix in [*RUN_BY, *NOT_RUN_HERE]:
        assert any(c.startswith(prefix) for c in shown), f"{prefix!r} is in the table but in no doc"


def test_make_run_is_the_dry_run():
    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    [line] = [ln.strip() for ln in recipe.splitlines()[1:] if ln.strip()]
    assert line == "$(VENV)/bin/spotguard dry-run"
    assert not check_cli(["spotguard", "dry-run"])


@pytest.mark.parametrize("command, problem", [
    ("spotguard launch --nproc-per-nod 4 train.py", "the CLI refuses it"),
    ("spotguard no-such-command", "the CLI refuses it"),
    ("kubectl spotguard status --no-such-flag", "the CLI refuses it"),
    ("spotguard bench checkpoint_speed --size-gb 1", "checkpoint_speed.py defines no --size-gb"),
    ("spotguard bench no_such_bench", "bench/no_such_bench.py does not exist"),
    ("bash bench/on_host.sh python3 bench/membership_change.py --no-such-flag", "defines no --no-such-flag"),
    ("helm install spotguard ./chart", "no test or CI step is known to run it"),
])
def test_a_command_nothing_accounts_for_fails_saying_why(command, problem):
    problems = account_for(command)
    assert problems and problem in problems[0], problems


def test_shell_blocks_are_read_as_a_shell_would():
    body = ("make run   # a comment\n"
            "spotguard launch --nnodes 2 \\\n    --standalone train.py\n"
            "cat > f.yaml <<'EOF'\nnot: a command\nEOF\n"
            "# a comment line\n")
    assert shell_commands("bash", body) == ["make run", "spotguard launch --nnodes 2      --standalone train.py",
                                            "cat > f.yaml <<'EOF'"]
    assert shell_commands("console", "$ make test\nsome output\n") == ["make test"]


def python_blocks() -> list[tuple[str, str]]:
    return [(path.name, body) for path in DOCS
            for language, body in code_blocks(path.read_text(encoding="utf-8")) if language == "python"]


def defined_names(module: str) -> set[str] | None:
    """The top-level names a spotguard module defines (from its source), None if it does not exist."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_docs_have_python_to_check():
    assert len([1 for where, _ in python_blocks() if where == "README.md"]) >= 2


@pytest.mark.parametrize("where, source", python_blocks())
def test_python_blocks_compile_and_import_what_exists(where, source):
    tree = ast.parse(compile(source, where, "exec", ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spotguard"):
            names = defined_names(node.module)
            assert names is not None, f"{where}: no module {node.module}"
            for alias in node.names:
                if alias.name not in names:  # a lazy module (`__getattr__`): ask it
                    assert hasattr(importlib.import_module(node.module), alias.name), \
                        f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("spotguard"):
                    assert importlib.util.find_spec(alias.name) is not None, f"{where}: no module {alias.name}"
