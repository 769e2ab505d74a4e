"""Shrink, grow and replacement through the peer-to-peer transfer across real gloo processes, DDP
and FSDP2: the new group's state is bit-identical to what the old group held at the agreed step
(what its checkpoint holds), every byte sent is one the layouts require, and the leaving rank's
rows reach the survivors before it leaves. (The Guard's whole change, with this transfer, is
tests/test_in_place.py.)

One run of five processes (hosts a..e, tests/workers/reshard.py) makes every change, one after
the other, each group on its own port: per framework, a b c -> b c (rank 0 leaves, the others
renumbered), -> b d (c replaced by d in one change), -> b d e (grow 2 -> 3); then an FSDP2 layout
the plan cannot map, a b -> b. Each change starts from the state the previous one left, trained
one step on; its checks compare that change's own before and after, so they prove what a fresh
job per change proved (one process start per host instead of one per host and change)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spotguard.processes import free_port
from tests.workers.launch import assert_same_state

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "workers" / "reshard.py"
# Each change of a chain is the previous one's new group -> the next group.
CHANGES = {"shrink-3-2": 0, "replace-2-2": 1, "grow-2-3": 2}
GROUPS = [["a", "b", "c"], ["b", "c"], ["b", "d"], ["b", "d", "e"]]
REFUSED = [["a", "b"], ["b"]]  # 8 columns: even on 2


@dataclass
class Changes:
    out: Path
    codes: dict[str, int]
    logs: dict[str, str]

    def assert_ran(self) -> None:
        assert set(self.codes.values()) == {0}, self.logs


def chain(name: str, mode: str, groups: list[list[str]], refuse: bool = False) -> dict:
    return {"name": name, "mode": mode, "groups": groups, "ports": [free_port() for _ in groups], "refuse": refuse}


@pytest.fixture(scope="module")
def changes(tmp_path_factory) -> Changes:
    out = tmp_path_factory.mktemp("reshard")
    script = [chain("ddp", "ddp", GROUPS), chain("fsdp2", "fsdp2", GROUPS), chain("refuse", "fsdp2", REFUSED, True)]
    (out / "script.json").write_text(json.dumps(script))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
           "SPOTGUARD_RESHARD_BUCKET_MB": "0.0003"}  # ~300-byte buckets: many rounds even on a tiny model
    env.pop("SPOTGUARD_RESHARD", None)
    hosts = sorted({host for c in script for group in c["groups"] for host in group})
    procs = {host: subprocess.Popen([sys.executable, str(WORKER), "--out", str(out), "--me", host,
                                     "--script", str(out / "script.json")],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for host in hosts}
    codes, logs = {}, {}
    try:
        for host, proc in procs.items():
            logs[host], _ = proc.communicate(timeout=600)
            codes[host] = proc.returncode
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return Changes(out, codes, logs)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("change", CHANGES)
def test_state_after_the_transfer_is_the_agreed_state(changes, mode, change):
    changes.assert_ran()
    k = CHANGES[change]
    old, new, tag = GROUPS[k], GROUPS[k + 1], f"{mode}-{k}"
    out = changes.out
    sent = {host: int((out / f"sent-{tag}-{host}").read_text()) for host in dict.fromkeys(old + new)}
    assert_same_state(torch.load(out / f"state-before-{tag}.pt"), torch.load(out / f"state-after-{tag}.pt"))
    moved, minimum = json.loads((out / f"planned-{tag}").read_text())
    replacing_shards = mode == "fsdp2" and set(old) - set(new) and set(new) - set(old)
    assert sum(sent.values()) == moved  # the relayed rows (c's, through b) travel twice
    assert moved > minimum if replacing_shards else moved == minimum
    if mode == "ddp" and not set(new) - set(old):
        assert minimum == 0  # replicas: a shrink moves nothing
    else:
        assert minimum > 0


def test_an_unmappable_layout_is_refused_on_every_rank_before_anything_moves(changes):
    changes.assert_ran()
    for host in REFUSED[0]:  # every rank of the old group refused, its state intact (checked there)
        message = (changes.out / f"refused-refuse-{host}").read_text()
        assert "Shard(dim=1)" in message and "not supported" in message
    assert "'model/0.weight'" in (changes.out / "refused-refuse-a").read_text()
    assert not list(changes.out.glob("state-after-refuse-*.pt"))
