"""Where a group meets: this process's rendezvous store, and the liveness of a group at a store.

Every process that can lead a group (its host's local rank 0) serves a c10d `TCPStore` on its
rendezvous port (`SPOTGUARD_RDZV_PORT`) from the moment it first leads one, and keeps it for its
lifetime, so a group led by a survivor never depends on a host that left. A group is formed
(`group_session.GroupSession.reform`) on its leader's store under a prefix unique to the
formation (`m<generation>/` for a membership the supervisor pushed, `s<...>/` for a shrink the
ranks agreed on themselves), so keys of earlier formations never collide.

Contract:
- `Rendezvous.from_env()` reads `SPOTGUARD_RDZV_HOST` / `SPOTGUARD_RDZV_PORT` (falling back to
  MASTER_ADDR / MASTER_PORT); a bad value raises `ConfigError` naming the variable. `backend`
  ("gloo" or "nccl") and `local_rank` say what the formations make.
- `address` is "host:port" of this process's store (whether or not it serves yet).
- `serve(timeout)`: this process's store, started on first use; `store_at(address, leader,
  timeout)`: the store a formation meets at (this process's own when it leads), a client waiting
  at most `timeout` for it; both raise `ReformError`. `open_client(address, timeout)`: a client
  of its own (a thread that blocks on the store must not share one).
- Liveness: once a group is formed, its leader (rank 0, which serves the store) sets `LIVE_KEY`
  (unprefixed) in its store to the group's prefix, and keeps it as long as it leads a group
  there (`mark_live(None)` removes it when this process forms a group it does not lead).
  `live_group(address, timeout)` reads it from another process: the prefix of the group live at
  that store, or None when the store does not answer within `timeout` or no group was formed
  there (a store that a freshly started leader serves while its first group is still forming
  has no key yet).
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

from spotguard.config import ConfigError, positive_int
from spotguard.wire import names

log = logging.getLogger("spotguard.hooks.elastic")

LIVE_KEY = "spotguard/live-group"


class ReformError(RuntimeError):
    """A group could not be formed (a peer missing, the store unreachable)."""


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


class Rendezvous:
    """This process's side of every formation; see the module docstring."""

    def __init__(self, host: str, port: int, backend: str = "gloo", local_rank: int = 0):
        self.host, self.port = host, port
        self.backend, self.local_rank = backend, local_rank  # "nccl": see `nccl` (eager, abort)
        self._server: Any = None  # the TCPStore this process serves, once it led a group
        self._clients: list[Any] = []

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Rendezvous:
        env = dict(os.environ if env is None else env)
        host = env.get(names.ENV_RDZV_HOST) or env.get("MASTER_ADDR") or "127.0.0.1"
        port_text = env.get(names.ENV_RDZV_PORT) or env.get("MASTER_PORT") or str(names.RDZV_PORT)
        port = positive_int(names.ENV_RDZV_PORT, port_text)
        if not 0 < port < 65536:
            raise ConfigError(names.ENV_RDZV_PORT, f"expected a port in 1..65535, got {port_text!r}")
        return cls(host, port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve(self, timeout: float) -> Any:
        """This process's store, started on first use (it then lives as long as the process)."""
        if self._server is None:
            from torch.distributed import TCPStore

            try:
                self._server = TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout))
            except Exception as exc:
                raise ReformError(f"cannot serve the rendezvous store on {self.address}: {exc}") from exc
            log.info("serving the rendezvous store on %s", self.address)
        return self._server

    def store_at(self, address: str, leader: bool, timeout: float) -> Any:
        if leader:
            return self.serve(timeout)
        client = open_client(address, timeout)
        self._clients = [client]  # the previous formation's client goes with its group
        return client

    def mark_live(self, prefix: str | None) -> None:
        """Sets (leader) or removes (not the leader) the liveness key in this process's own store."""
        if self._server is None:
            return
        try:
            if prefix is not None:
                self._server.set(LIVE_KEY, prefix)
            else:
                self._server.delete_key(LIVE_KEY)
        except Exception as exc:  # the store is this process's own: nothing should fail here
            log.warning("liveness key of %s not updated: %s", self.address, exc)


def open_client(address: str, timeout: float) -> Any:
    """A new client connection to the store at `address` ("host:port"), waiting at most `timeout`
    to connect; raises `ReformError`. One client's calls wait for each other, so a thread that
    blocks on the store (a save's channel) needs its own."""
    from torch.distributed import TCPStore

    host, port = split_address(address)
    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as exc:
        raise ReformError(f"cannot reach the rendezvous store at {address}: {exc}") from exc


def live_group(address: str, timeout: float) -> str | None:
    """The prefix of the group live at the store at `address` (module docstring), or None."""
    from torch.distributed import TCPStore

    try:
        host, port = split_address(address)
    except ValueError:
        return None
    deadline = time.monotonic() + timeout
    try:
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception:  # refused, unreachable or too slow: nothing lives there
        return None
    while True:
        try:
            if client.check([LIVE_KEY]):
                return client.get(LIVE_KEY).decode(errors="replace")
        except Exception:  # the store went away while we asked
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
