"""The product's own files name nothing outside the repository: no path of the machine it was
built on (its shared folder `../shared`, its work tree under `/work/`). A citation names the
upstream project or document instead."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_FOLDERS = ("agent", "hooks", "supervisor", "injector", "spotguard", "integrations", "trainer", "emulator",
                   "daemonset", "docs", "bench")
OUTSIDE = ("../shared", "/work/")


def product_files() -> list[Path]:
    return sorted(p for folder in PRODUCT_FOLDERS for p in (ROOT / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".png", ".pyc", ".csv"))


def test_there_are_product_files_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"hooks/elastic/nccl.py", "docs/protocols.md", "daemonset/examples/deepspeed-launcher.yaml"} <= names


@pytest.mark.parametrize("outside", OUTSIDE)
def test_no_product_file_names_a_path_outside_the_repository(outside):
    named = [f"{p.relative_to(ROOT)}:{n}" for p in product_files()
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if outside in line]
    assert not named, f"{outside!r} named in: {named}"
