"""The formation's gloo groups (`hooks/agreement/control_group.py`, kept by the process's
`hooks/group_session.py`) across 2 real gloo ranks: a job that calls torch's
`init_process_group` and makes the Guard before its adapter gets the two groups once (the
Guard's control group, the adapter's checkpoint group; a save and the Guard's agreement work on
them), and a spotguard formation (`GroupSession.reform`) makes the new group's before any user
code runs; the adapter and the Guard move to them.

Run as `python -m tests.test_control_group <out file> <port>`, the module is one rank."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from spotguard.processes import free_port
from tests.workers.launch import run_ranks

pytestmark = pytest.mark.slow


def test_one_set_of_groups_per_formation_shared_by_the_guard_and_the_adapter(tmp_path):
    rdzv = str(free_port())
    codes, tail = run_ranks(2, [str(tmp_path / "rank{rank}.json"), rdzv, str(tmp_path / "ckpt")], tmp_path / "logs",
                            timeout=300, module="tests.test_control_group")
    assert codes == [0, 0], tail
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"groups_made": 2, "guard_on_control": True, "adapter_on_checkpoint": True,
                        "distinct": True, "saved": True, "made_at_formation": True, "groups_made_after": 4,
                        "moved": True}, seen


def _worker(out: str, rdzv_port: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
    from spotguard.hooks.agreement import control_group
    from spotguard.hooks.elastic.rendezvous import Rendezvous
    from spotguard.hooks.group_session import process_session
    from spotguard.hooks.guard import Guard

    # Groups made, read from torch's own count (`get_pg_count`: every group it numbered since the
    # default group was made, that one included; a formation destroys the old default group,
    # which starts the count again): the groups of the first formation, then those of the second.
    first: list[int] = []

    def made() -> int:
        return (first[0] if first else 0) + dist.get_pg_count() - 1

    dist.init_process_group("gloo")  # torch's own, as a job that is not in place calls it
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(install_signals=False, in_place=False, exit_on_drain=False)  # the Guard first
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=ckpt)
    guard.attach(adapter)
    groups = control_group.control_groups()
    seen = {"groups_made": made(), "guard_on_control": guard.collectives.group is groups.control,
            "adapter_on_checkpoint": adapter._group is groups.checkpoint,
            "distinct": groups.control is not groups.checkpoint}
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    guard.step(0)
    adapter.save(0)
    guard.step(1)
    seen["saved"] = adapter.last_info is not None or dist.get_rank() != 0
    rank = dist.get_rank()
    session = process_session()
    session.rendezvous = Rendezvous("127.0.0.1", rdzv_port)  # in place from here: a re-form
    first.append(made())
    session.reform(f"127.0.0.1:{rdzv_port}", "m1/", rank, 2, 60.0)
    made_by_the_formation = made()
    seen["made_at_formation"] = made_by_the_formation == 4 and session.groups() is control_group.control_groups()
    seen["groups_made_after"] = made()
    adapter._setup_group()
    guard.rejoin()
    after = control_group.control_groups()
    seen["moved"] = (after is not groups and guard.collectives.group is after.control
                     and adapter._group is after.checkpoint and made() == 4)
    guard.step(2)
    Path(out).write_text(json.dumps(seen))
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1].format(rank=os.environ["RANK"]), int(sys.argv[2]), sys.argv[3])
