"""Worker for tests/test_guard_piggyback.py: one rank of a 2-rank gloo job.

Checks that gradients reduced through the Guard's piggyback hook equal plain DDP's, and that a
notice held by one rank makes every rank drain at the same step. Writes result-<rank>.json.
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from spotguard.hooks.guard import Guard
from spotguard.wire.notice import Notice, now_utc


def main(out: Path) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)), bucket_cap_mb=0.001)  # several buckets
    torch.manual_seed(0)
    piggy = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)), bucket_cap_mb=0.001)
    guard = Guard(install_signals=False, exit_on_drain=False)
    attached = guard.piggyback_on(piggy)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
    result = {"attached": attached, "equal": [], "drained_at": None, "counts": [], "carriers": []}
    for step in range(4):
        for model in (plain, piggy):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        result["equal"].append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), piggy.parameters())))
        result["counts"].append(guard.agreement.reduced_count)
        result["carriers"].append(guard.agreement.carrier.data_ptr())
        if step == 1 and rank == 1:  # a notice that only rank 1 has, before step 2's backward
            now = now_utc()
            guard.offer(Notice(id="test:1", kind="reclaim", source="test", node="n1", detected_at=now,
                               deadline=now + timedelta(seconds=60)))
        if guard.step(step):
            result["drained_at"] = step
            break
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    guard.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
