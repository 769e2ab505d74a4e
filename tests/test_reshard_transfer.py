"""Shrink and grow through the peer-to-peer transfer across real gloo processes, DDP and FSDP2:
the new group's state is bit-identical to what the old group held at the agreed step (what its
checkpoint holds), every byte sent is one the layouts require, and the leaving rank's rows reach
the survivors before it leaves. (The Guard's whole change, with this transfer, is
tests/test_in_place.py.)"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers.launch import assert_same_state

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "workers" / "reshard.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_change(tmp_path: Path, mode: str, old: list[str], new: list[str], *extra: str) -> dict[str, int]:
    ports = [str(free_port()), str(free_port())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
           "SPOTGUARD_RESHARD_BUCKET_MB": "0.0003"}  # ~300-byte buckets: many rounds even on a tiny model
    env.pop("SPOTGUARD_RESHARD", None)
    procs = {host: subprocess.Popen([sys.executable, str(WORKER), "--mode", mode, "--out", str(tmp_path),
                                     "--old-hosts", ",".join(old), "--new-hosts", ",".join(new), "--me", host,
                                     "--old-port", ports[0], "--new-port", ports[1], *extra],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for host in dict.fromkeys(old + new)}
    codes, logs = {}, {}
    for host, proc in procs.items():
        logs[host], _ = proc.communicate(timeout=240)
        codes[host] = proc.returncode
    assert set(codes.values()) == {0}, logs
    return {host: int((tmp_path / f"sent-{host}").read_text()) for host in procs if not extra}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("old, new", [(["a", "b", "c"], ["b", "c"]),    # rank 0 leaves, the others renumbered
                                      (["b", "c"], ["b", "c", "d"]),   # grow 2 -> 3
                                      (["a", "b"], ["a", "c"])],       # b replaced by c in one change
                         ids=["shrink-3-2", "grow-2-3", "replace-2-2"])
def test_state_after_the_transfer_is_the_agreed_state(tmp_path, mode, old, new):
    sent = run_change(tmp_path, mode, old, new)
    assert_same_state(torch.load(tmp_path / "state-before.pt"), torch.load(tmp_path / "state-after.pt"))
    moved, minimum = json.loads((tmp_path / "planned").read_text())
    replacing_shards = mode == "fsdp2" and set(old) - set(new) and set(new) - set(old)
    assert sum(sent.values()) == moved  # the relayed rows (b's, through a) travel twice
    assert moved > minimum if replacing_shards else moved == minimum
    if mode == "ddp" and not set(new) - set(old):
        assert minimum == 0  # replicas: a shrink moves nothing
    else:
        assert minimum > 0


def test_an_unmappable_layout_is_refused_on_every_rank_before_anything_moves(tmp_path):
    run_change(tmp_path, "fsdp2", ["a", "b"], ["b"], "--refuse")  # 8 columns: even on 2
    for host in ("a", "b"):  # every rank of the old group refused, its state intact (checked there)
        message = (tmp_path / f"refused-{host}").read_text()
        assert "Shard(dim=1)" in message and "not supported" in message
    assert "'model/0.weight'" in (tmp_path / "refused-a").read_text()
    assert not list(tmp_path.glob("state-after.pt"))
