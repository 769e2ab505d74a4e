"""The size rule of docs/developing.md, enforced by `make lint`: no class over 300 lines and no
function over 80 lines in the product, the integrations and the dry-run (tests are exempt).

Usage: python tools/code_size.py FOLDER...   Prints each offender as `path:line: kind name is N
lines (limit L)` and exits 1 if there is one, 0 otherwise. A file that does not parse is an
offender too (its syntax error is printed): the rule cannot be checked on it.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

LIMITS = {"class": 300, "function": 80}


def offenders(path: Path) -> Iterator[str]:
    """Each class or function in `path` longer than its limit, as a printable line."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        yield f"{path}:{exc.lineno}: does not parse: {exc.msg}"
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "function"
        else:
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > LIMITS[kind]:
            yield f"{path}:{node.lineno}: {kind} {node.name} is {lines} lines (limit {LIMITS[kind]})"


def main(folders: list[str]) -> int:
    found = [line for folder in folders for path in sorted(Path(folder).rglob("*.py"))
             for line in offenders(path)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
