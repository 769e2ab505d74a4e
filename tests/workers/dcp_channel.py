"""One rank of tests/test_dcp_over_channel.py: an FSDP2 model on gloo trained one step; its state
saved by `dcp.save` on the group, then the group destroyed, then the same state saved by
`save_over_channel` through the TCPStore alone. Writes <out>/result-<rank>.json.

    dcp_channel.py --out DIR --rank R --world N --port P --mode ok|fail|silent

- ok: both saves; the test compares them.
- fail: rank 1's storage writer raises in its write: every rank must raise.
- silent: rank 2 never takes part: the others must give up after the channel's timeout.
- early: rank 1 gives up before the first round (its copy failed): the others must learn it
  from the store (PeerFailed), not from the timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from spotguard.hooks.checkpoint.dcp_over_channel import save_over_channel
from spotguard.hooks.checkpoint.store_channel import StoreChannel

TIMEOUT = 20.0
SILENT_TIMEOUT = 3.0


class FailingWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError("disk full (the test's writer)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, args.rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("group/", store), rank=args.rank, world_size=args.world)
    mesh = init_device_mesh("cpu", (args.world,))
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(6, 24)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    result: dict = {"rank": args.rank}
    if args.mode == "ok":
        dcp.save(state, storage_writer=FileSystemWriter(args.out / "group", single_file_per_rank=True),
                 process_group=dist.group.WORLD)
    dist.destroy_process_group()  # from here on there is no group: only the store
    timeout = SILENT_TIMEOUT if args.mode == "silent" else (600.0 if args.mode == "early" else TIMEOUT)
    channel = StoreChannel(store, "save/1/", args.rank, args.world, timeout)
    if args.mode == "silent" and args.rank == 2:
        os._exit(0)
    writer = FileSystemWriter(args.out / "channel", single_file_per_rank=True)
    if args.mode == "fail" and args.rank == 1:
        writer = FailingWriter(args.out / "channel", single_file_per_rank=True)
    t0 = time.monotonic()
    try:
        if args.mode == "early" and args.rank == 1:  # as a rank whose copy failed: no round taken
            channel.abort("its snapshot of the step failed")
        metadata = save_over_channel(state, writer, channel)
        result.update(ok=True, metadata=metadata is not None)
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    result["seconds"] = time.monotonic() - t0
    (args.out / f"result-{args.rank}.json").write_text(json.dumps(result))
    channel.close()
    if args.rank == 0:  # it serves the store: the others read their last round first
        channel.wait_closed(TIMEOUT)
    os._exit(0)


if __name__ == "__main__":
    main()
