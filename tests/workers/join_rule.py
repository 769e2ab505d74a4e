"""One worker of tests/test_join_rule.py: `init_process_group()` (the join rule decides whether it
starts the job's group or joins a live one), an all-reduce of a 1, and what it saw as JSON.

    python -m tests.workers.join_rule <out file>

JOIN_TEST_JOIN_TIMEOUT: the join's timeout (600 s by default); JOIN_TEST_HOLD_FILE: once it wrote
its result, the worker stays in its group until that file exists (120 s at most). It imports only
torch.distributed and spotguard's elastic hooks: each test starts several.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

HOLD_FILE = "JOIN_TEST_HOLD_FILE"


def main(result: str) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.elastic import elastic_process, init_process_group

    init_process_group(join_timeout=float(os.environ.get("JOIN_TEST_JOIN_TIMEOUT", "600")))
    total = torch.ones(1)
    dist.all_reduce(total)
    process = elastic_process()
    seen = {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "joined": process is not None and process.joined is not None, "sum": total.item()}
    Path(result).write_text(json.dumps(seen))
    hold = os.environ.get(HOLD_FILE)
    deadline = time.monotonic() + 120
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1])
