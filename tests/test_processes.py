"""spotguard.processes.free_port: a port a server can still bind, below the kernel's ephemeral
range where that range is known (the ports outgoing connections take their local end from), and
never the same one to two callers of the machine while it is claimed."""
from __future__ import annotations

import socket

import pytest

from spotguard import processes


@pytest.fixture(autouse=True)
def own_claims(tmp_path, monkeypatch):
    """Each test keeps its port claims in a folder of its own (the machine's is shared by every
    test run on it)."""
    folder = tmp_path / "claims"
    monkeypatch.setattr(processes, "PORT_CLAIMS", str(folder))
    return folder


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", str(range_file))
    ports = [processes.free_port() for _ in range(20)]
    assert all(processes.LOWEST_PORT <= p < 32768 for p in ports), ports
    assert all(_bindable(p) for p in ports)


@pytest.mark.parametrize("content", [None, "", "garbage", "1024 2048"])
def test_an_unknown_or_too_low_range_leaves_the_choice_to_the_kernel(tmp_path, monkeypatch, content):
    range_file = tmp_path / "ip_local_port_range"
    if content is not None:
        range_file.write_text(content)
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", str(range_file))
    assert processes._ephemeral_low() is None
    assert _bindable(processes.free_port())


def test_a_taken_candidate_is_skipped(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{processes.LOWEST_PORT + processes.PORT_TRIES + 2} 60999")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", str(range_file))
    held = []
    try:
        for port in range(processes.LOWEST_PORT, processes.LOWEST_PORT + processes.PORT_TRIES + 1):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        got = processes.free_port()
        assert got not in {s.getsockname()[1] for s in held}
        assert _bindable(got)
    finally:
        for s in held:
            s.close()


def test_a_claimed_port_goes_to_no_other_caller_until_its_claim_is_stale(tmp_path, monkeypatch, own_claims):
    """Two test runs at once (ci: EADDRINUSE when both started a server on one port): with 66
    ports below the range, two processes taking 20 each never get one twice; once every port
    there is claimed the kernel chooses; a claim older than PORT_CLAIM_SECONDS is taken over."""
    import os
    import subprocess
    import sys

    low = processes.LOWEST_PORT + processes.PORT_TRIES + 2
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{low} 60999")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", str(range_file))
    script = (f"from spotguard import processes; processes.PORT_CLAIMS = {str(own_claims)!r}; "
              f"processes.EPHEMERAL_RANGE_FILE = {str(range_file)!r}; "
              "print(' '.join(str(processes.free_port()) for _ in range(20)))")
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    mine = [processes.free_port() for _ in range(20)]
    theirs = [int(p) for p in other.communicate(timeout=60)[0].split()]
    below = [p for p in mine + theirs if p < low]
    assert len(set(below)) == len(below) and len(below) >= 38, (mine, theirs)  # the odd port may be in use
    rest = [processes.free_port() for _ in range(low - processes.LOWEST_PORT)]
    assert rest[-1] >= low  # every port below the range claimed: the kernel's choice
    # Another test of the suite may bind a port of this range between the two lines below (its
    # claims are in another folder): then the next stale port is tried; a claim still fresh is
    # never given, and a stale one still free always is.
    for stale in (p for p in below if _bindable(p)):
        os.utime(os.path.join(own_claims, str(stale)), (0, 0))
        got = processes.free_port()
        assert got == stale or got >= low, (got, stale)  # below the range every other claim is fresh
        if got == stale:
            break
        assert not _bindable(stale), (got, stale)  # taken by another process meanwhile: not ours to give
    else:
        raise AssertionError(f"no stale claim was taken over ({below})")


def test_without_a_writable_claims_folder_ports_are_still_given(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(processes, "PORT_CLAIMS", str(blocker / "claims"))
    assert _bindable(processes.free_port())
