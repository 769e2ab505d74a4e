"""Builds the import layout of the `spotguard` distribution as a tree of per-file symlinks.

The repository keeps the parts as top-level folders (agent/, hooks/, ...) that setup.py maps to
`spotguard.<part>`; static tools (import-linter, mypy) read packages from the filesystem and
cannot follow that mapping. `python tools/package_tree.py DIR` makes DIR/spotguard/... with real
directories and symlinked .py files (paths in the tools' messages resolve to the repository's
files), removing whatever DIR held before. Put DIR on PYTHONPATH / mypy_path.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_PARTS = {"spotguard", "tests", "bench", "tools"}


def parts() -> dict[Path, Path]:
    """Repository folder -> its place under the package root (setup.py's rule: `spotguard/` is
    the root, every other top-level folder with an `__init__.py` is `spotguard.<folder>`)."""
    mapping = {REPO / "spotguard": Path()}
    for folder in sorted(REPO.iterdir()):
        if folder.name not in NOT_PARTS and (folder / "__init__.py").is_file():
            mapping[folder] = Path(folder.name)
    return mapping


def build(target: Path) -> Path:
    root = target / "spotguard"
    shutil.rmtree(root, ignore_errors=True)
    for source, place in parts().items():
        for path in source.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            link = root / place / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return root


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else REPO / ".cache" / "package-tree")))
