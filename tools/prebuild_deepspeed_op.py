"""Builds DeepSpeed's CPU shared-memory op once, at install, into TORCH_EXTENSIONS_DIR.

DeepSpeed JIT-compiles this op (`deepspeed_shm_comm`) the first time a process initialises its
communication on CPU: about two minutes of compiler time, under a lock file that every other
DeepSpeed start then waits on. `make install` runs this script so that no test (and no rank of
a dry-run with a deadline) pays for the compile or waits on the lock; the tests point
TORCH_EXTENSIONS_DIR at the same per-checkout folder (tests/conftest.py).
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("prebuild_deepspeed_op: set TORCH_EXTENSIONS_DIR to the folder the tests use", file=sys.stderr)
        return 2
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible():
        print("prebuild_deepspeed_op: this DeepSpeed has no compatible CPU shared-memory op: nothing to build")
        return 0
    builder.load(verbose=False)
    print(f"prebuild_deepspeed_op: {builder.absolute_name()} ready in {os.environ['TORCH_EXTENSIONS_DIR']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
