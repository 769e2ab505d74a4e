"""spotguard.processes.free_port: a port a server can still bind, below the kernel's ephemeral
range where that range is known (the ports outgoing connections take their local end from)."""
from __future__ import annotations

import socket

import pytest

from spotguard import processes


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
