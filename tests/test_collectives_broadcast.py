"""`GroupCollectives.broadcast_bytes` across 2 real gloo ranks: a payload up to the inline size
arrives in one broadcast, a larger one in two; empty, boundary-sized and large payloads arrive
intact from either source rank.

Run as `python -m tests.test_collectives_broadcast <out file>`, the module is one rank."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.processes import free_port
from tests.workers.launch import ROOT, base_env

pytestmark = pytest.mark.slow


def payloads(inline: int) -> list[tuple[int, bytes]]:
    """(source rank, payload) in the order every rank broadcasts them."""
    body = bytes(range(256)) * 80  # 20480 bytes, not a multiple of the inline size
    return [(0, b""), (1, b"{}"), (0, body[:inline - 8]), (1, body[:inline - 7]), (0, body), (1, b"x" * 3)]


def test_broadcast_bytes_small_in_one_broadcast_large_in_two(tmp_path):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = base_env()
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_collectives_broadcast",
                                       str(tmp_path / f"rank{rank}.json")], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], outputs
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["ok"] == [True] * len(seen["ok"]), seen
        assert seen["broadcasts"] == [1, 1, 1, 2, 2, 1], seen


def _worker(out: str) -> None:
    import torch.distributed as dist

    from spotguard.hooks.agreement.collectives import INLINE_BYTES, GroupCollectives

    dist.init_process_group("gloo")
    collectives = GroupCollectives()
    calls = []
    real = collectives.dist.broadcast

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    collectives.dist = type("CountingDist", (), {"broadcast": staticmethod(counting)})()
    ok, broadcasts = [], []
    for src, payload in payloads(INLINE_BYTES):
        before = len(calls)
        got = collectives.broadcast_bytes(payload if collectives.rank == src else b"ignored", src)
        ok.append(got == payload)
        broadcasts.append(len(calls) - before)
    Path(out).write_text(json.dumps({"ok": ok, "broadcasts": broadcasts}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
