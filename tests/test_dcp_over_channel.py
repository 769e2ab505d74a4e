"""hooks/checkpoint/dcp_over_channel.py across three real gloo processes: after the process group is
destroyed, an FSDP2 state saved through the TCPStore alone is, byte for byte, the checkpoint
`dcp.save` wrote on the group (data files and the state in `.metadata`); a write failing on one
rank fails the save on every rank; a rank that never takes part makes the others give up after
the channel's timeout instead of hanging. (tests/workers/dcp_channel.py is one rank.)"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.processes import free_port

WORKER = Path(__file__).parent / "workers" / "dcp_channel.py"
WORLD = 3


def run(tmp_path: Path, mode: str) -> dict[int, dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--out", str(tmp_path), "--rank", str(rank), "--world",
                               str(WORLD), "--port", str(port), "--mode", mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(WORLD)]
    try:
        logs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * WORLD, logs
    return {rank: json.loads(path.read_text()) for rank in range(WORLD)
            if (path := tmp_path / f"result-{rank}.json").exists()}


def test_a_save_through_the_store_after_the_group_is_gone_is_the_checkpoint_dcp_save_writes(tmp_path):
    results = run(tmp_path, "ok")
    assert all(results[rank]["ok"] for rank in range(WORLD)), results
    assert [results[rank]["metadata"] for rank in range(WORLD)] == [True, False, False]
    group, channel = tmp_path / "group", tmp_path / "channel"
    data = sorted(path.name for path in group.glob("*.distcp"))
    assert len(data) >= WORLD and data == sorted(path.name for path in channel.glob("*.distcp"))
    for name in data:
        assert (group / name).read_bytes() == (channel / name).read_bytes(), name
    ours = pickle.loads((channel / ".metadata").read_bytes())
    theirs = pickle.loads((group / ".metadata").read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    results = run(tmp_path, "fail")
    assert set(results) == set(range(WORLD))
    assert not any(result["ok"] for result in results.values()), results
    assert "disk full" in results[0]["error"] and "disk full" in results[2]["error"], results


def test_a_rank_that_never_takes_part_makes_the_others_give_up_after_the_timeout(tmp_path):
    results = run(tmp_path, "silent")
    assert set(results) == {0, 1}
    for rank in (0, 1):
        assert not results[rank]["ok"] and "ChannelError" in results[rank]["error"], results
    assert not (tmp_path / "channel" / ".metadata").exists()


def test_a_rank_that_gives_up_before_the_first_round_fails_the_others_at_once(tmp_path):
    """Rank 1 aborts its channel before any round (a copy that failed): ranks 0 and 2 end with
    `PeerFailed` naming why (their channel timeout is 600 s: only the store's word ends them)."""
    results = run(tmp_path, "early")
    for rank in (0, 2):
        assert not results[rank]["ok"] and "PeerFailed" in results[rank]["error"], results
        assert "snapshot of the step failed" in results[rank]["error"], results
    assert not (tmp_path / "channel" / ".metadata").exists()


@pytest.mark.parametrize("payloads", [[b"1", b"1"], [b"1", b"0"]])
def test_the_vote_over_a_store_in_one_process(payloads):
    """The channel's rounds on a real TCPStore, two ranks played by two threads."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from spotguard.hooks.checkpoint.store_channel import StoreChannel

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30)) for _ in (0, 1)]
    answers: dict[int, tuple] = {}

    def rank(r: int) -> None:  # a client per rank: one client's calls wait for each other
        channel = StoreChannel(clients[r], "v/", r, 2, 20.0)
        answers[r] = (channel.all_ok(payloads[r] == b"1"), channel.max([float(r), -float(r)]),
                      channel.broadcast("b", b"from-0" if r == 0 else b""))
        channel.close()
        if r == 0:
            assert channel.wait_closed(20.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    expected_ok = all(p == b"1" for p in payloads)
    assert answers == {r: (expected_ok, [1.0, 0.0], b"from-0") for r in (0, 1)}
    # the rounds' keys deleted by the last to close: "closed", "all-closed" and the store's own key stay
    assert server.num_keys() == 2 + 1


def test_abort_ends_a_wait_in_another_thread_and_every_later_operation():
    """A rank that gives up on the save (its `finish` timed out) must not leave its write thread
    waiting out the channel's timeout at each round: `abort` ends the wait in progress."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from spotguard.hooks.checkpoint.store_channel import ChannelError, StoreChannel

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    channel = StoreChannel(server, "a/", 0, 2, 600.0)  # rank 1 never comes: only abort ends the wait
    ended: list[BaseException] = []

    def waiting() -> None:
        try:
            channel.all_ok(True)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=waiting)
    thread.start()
    assert not ended
    channel.abort("the rank gave up")
    thread.join(120)  # far below the channel's 600 s: only the abort can end it this soon
    assert not thread.is_alive() and isinstance(ended[0], ChannelError) and "gave up" in str(ended[0])
    with pytest.raises(ChannelError, match="gave up"):
        channel.max([1.0])
