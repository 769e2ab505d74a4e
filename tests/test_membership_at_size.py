"""One in-place shrink and one grow at the memory bench's size: FSDP2 on 4 gloo processes with
1.0 GiB of parameters + AdamW moments (1 x Linear(9460, 9460)), 4 -> 3 then 3 -> 4, through the
real transfer (reshard plan, bucketed peer-to-peer moves) exactly as bench/membership_memory.py
runs it (the bench's workers and its RSS sampler). Checked from outside the change:
- the whole state after each change is bit-identical to the state before it (a digest of every
  row of every parameter and moment, read from the live model and optimizer on each side, rows
  placed by FSDP2's own sharding rule, not by the reshard plan);
- no rank's peak extra memory during the change (RSS sampled every 10 ms from outside the
  process) reaches the whole state, which the old transfer (the full state gathered on every
  rank) holds on every rank by construction;
- only the bytes the layouts require move;
- training goes on from the step handed over: every rank of the new group received the agreed
  step, and the next step counts on from it (after the shrink an optimizer step, after the grow
  a real FSDP2 step: forward, backward, AdamW, joiner included).
It costs 36-96 s on 2 cores at load 6-13 (five torch processes started at once, the real step
over 1 GiB of state ~10 s, each change 2-4 s); a transfer that skips one tensor's kept rows fails
it (checked by hand)."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "membership_memory.py"
DIM = 9460  # 12 bytes (a parameter and two moments) x (9460^2 + 9460) = 1.0003 GiB


def bench_module():
    spec = importlib.util.spec_from_file_location("membership_memory", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("membership_memory", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_shrink_and_grow_at_size_keep_the_state_bit_identical_within_a_shards_memory(tmp_path):
    bench = bench_module()
    args = bench.parse(["--dim", str(DIM), "--layers", "1", "--transfers", "shards", "--check", "--timeout", "240"])
    total = bench.state_bytes(args)
    assert total >= 2**30
    results = bench.run_transfer("shards", args, tmp_path / "shards")

    agreed = None
    for change, world in (("shrink", 3), ("grow", 4)):
        assert bench.changed_tensors(tmp_path / "shards", change) == []
        names = bench.merged_digests(tmp_path / "shards", change, "after")
        assert len(names) == 8, sorted(names)  # weight and bias: the parameter, exp_avg, exp_avg_sq, step
        rows = results[change]
        staying = {host: row for host, row in rows.items() if not row["left"]}
        assert len(staying) == world
        for host, row in rows.items():
            assert row["extra_bytes"] < total, (change, host, row)  # the gather transfer: >= total
        shard = math.ceil(total / world)
        for host, row in staying.items():
            assert row["new_shard_bytes"] <= shard * 1.01, (change, host, row)
        assert sum(row["sent_bytes"] for row in rows.values()) == next(iter(staying.values()))["minimum_bytes"]
        survivors = [row["agreed_step"] for row in staying.values() if row["agreed_step"] is not None]
        assert survivors and len(set(survivors)) == 1
        agreed = survivors[0]
        for host, row in staying.items():
            assert row["held_step"] == agreed, (change, host, row)
            assert row["trained_step"] == agreed + 1 and row["adam_step"] == agreed + 2, (change, host, row)
            if change == "grow":  # a real step
                assert math.isfinite(row["loss"]), (host, row)
        print(f"{change}: peak extra / new shard " + ", ".join(f"{h} {r['ratio']:.2f}x" for h, r in staying.items())
              + f"; seconds {max(r['seconds'] for r in staying.values()):.1f}")
    assert agreed == 1  # the grow took the step the shrink's new group trained


def write_digests(folder: Path, change: str, when: str, pieces: dict[str, dict[str, dict]]) -> None:
    for host, tensors in pieces.items():
        (folder / f"{host}-{change}-{when}.json").write_text(json.dumps(tensors))


def sharded(start: int, rows: list[str], total: int) -> dict:
    return {"start": start, "rows": rows, "total": total, "replica": False}


def test_the_digest_check_sees_a_moved_row_a_missing_row_and_differing_replicas(tmp_path):
    """The checker the size test relies on, on hand-made row digests: the same rows cut at
    another world size are the same tensor; a row out of place, a row nobody holds, or two
    replicas that differ are not."""
    bench = bench_module()
    step = {"start": 0, "rows": ["s"], "total": 1, "replica": True}
    write_digests(tmp_path, "shrink", "before", {"a": {"w": sharded(0, ["r0", "r1"], 3), "step": step},
                                                 "b": {"w": sharded(2, ["r2"], 3), "step": step}})
    write_digests(tmp_path, "shrink", "after", {"a": {"w": sharded(0, ["r0"], 3), "step": step},
                                                "b": {"w": sharded(1, ["r1", "r2"], 3), "step": step}})
    assert bench.changed_tensors(tmp_path, "shrink") == []
    write_digests(tmp_path, "grow", "before", {"a": {"w": sharded(0, ["r0", "r1", "r2"], 3), "step": step}})
    write_digests(tmp_path, "grow", "after", {"a": {"w": sharded(0, ["r1", "r0"], 3), "step": step},
                                              "b": {"w": sharded(2, ["r2"], 3), "step": dict(step, rows=["t"])}})
    with pytest.raises(ValueError, match="step: the replicas differ"):
        bench.merged_digests(tmp_path, "grow", "after")
    write_digests(tmp_path, "grow", "after", {"a": {"w": sharded(0, ["r1", "r0"], 3), "step": step},
                                              "b": {"w": sharded(2, ["r2"], 3), "step": step}})
    assert bench.changed_tensors(tmp_path, "grow") == ["w"]  # rows 0 and 1 swapped
    write_digests(tmp_path, "grow", "after", {"a": {"w": sharded(0, ["r0"], 3), "step": step},
                                              "b": {"w": sharded(2, ["r2"], 3), "step": step}})
    with pytest.raises(ValueError, match="w: rows from 2 follow 1 rows"):
        bench.merged_digests(tmp_path, "grow", "after")
