"""Builds DeepSpeed's CPU ops once, at install, into TORCH_EXTENSIONS_DIR: the shared-memory op and
the CPU Adam op.

DeepSpeed JIT-compiles the shared-memory op (`deepspeed_shm_comm`) the first time a process
initialises its communication on CPU: about two minutes of compiler time, under a lock file that
every other DeepSpeed start then waits on; and the CPU Adam op (`cpu_adam`, about 30 s) the first
time a process makes DeepSpeed's Adam with `offload_optimizer` to the CPU. `make install` runs
this script so that no test (and no rank of a dry-run with a deadline) pays for the compiles or
waits on their locks; the tests point TORCH_EXTENSIONS_DIR at the same per-checkout folder
(tests/conftest.py).
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("prebuild_deepspeed_op: set TORCH_EXTENSIONS_DIR to the folder the tests use", file=sys.stderr)
        return 2
    from deepspeed.accelerator import get_accelerator

    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"prebuild_deepspeed_op: this DeepSpeed has no compatible {name}: nothing to build")
            continue
        builder.load(verbose=False)
        print(f"prebuild_deepspeed_op: {builder.absolute_name()} ready in {os.environ['TORCH_EXTENSIONS_DIR']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
