"""Where a group meets: this process's rendezvous store, and forming the default process group.

Every process that can lead a group (its host's local rank 0) serves a c10d `TCPStore` on its
rendezvous port (`SPOTGUARD_RDZV_PORT`) from the moment it first leads one, and keeps it for its
lifetime, so a group led by a survivor never depends on a host that left. A group is formed on
its leader's store under a prefix unique to the formation (`m<generation>/` for a membership the
supervisor pushed, `s<...>/` for a shrink the ranks agreed on themselves), so keys of earlier
formations never collide.

Contract:
- `Rendezvous.from_env()` reads `SPOTGUARD_RDZV_HOST` / `SPOTGUARD_RDZV_PORT` (falling back to
  MASTER_ADDR / MASTER_PORT) and `SPOTGUARD_REFORM_TIMEOUT` (default 30 s); a bad value raises
  `ConfigError` naming the variable.
- `address` is "host:port" of this process's store (whether or not it serves yet).
- `form(store_address, prefix, rank, world_size)` destroys whatever default group exists (NCCL,
  `backend="nccl"`: synchronises the stream and aborts them, `nccl.quiesce_and_abort`) and
  initialises a new default group of `backend` (NCCL: communicators made eagerly, `device_id`)
  of `world_size` at `prefix` on the store at
  `store_address` (served by this process when `rank` is 0), then the formation's gloo control
  groups (`agreement.control_group`: the Guard's and the adapters'). It raises `ReformError` when the
  group is not complete within the timeout; the caller falls back. The group, and every group
  made after it, keep the re-form timeout per operation until the change commits
  (`bound.release_groups()`, done by the Guard), so a peer lost at any point of a change costs
  at most that long.
- Liveness: once a group is formed, its leader (rank 0, which serves the store) sets `LIVE_KEY`
  (unprefixed) in its store to the group's prefix, and keeps it as long as it leads a group
  there (it is removed when this process forms a group it does not lead). `live_group(address,
  timeout)` reads it from another process: the prefix of the group live at that store, or None
  when the store does not answer within `timeout` or no group was formed there (a store that a
  freshly started leader serves while its first group is still forming has no key yet).
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

from spotguard.config import ConfigError, positive_float, positive_int
from spotguard.hooks.agreement.control_group import control_groups
from spotguard.hooks.elastic.bound import bound_groups
from spotguard.hooks.elastic.caches import forget_mesh_caches
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

    def __init__(self, host: str, port: int, timeout: float = 30.0, backend: str = "gloo", local_rank: int = 0):
        self.host, self.port, self.timeout = host, port, timeout
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
        timeout = positive_float(names.ENV_REFORM_TIMEOUT, env.get(names.ENV_REFORM_TIMEOUT) or 30)
        return cls(host, port, timeout)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve(self) -> Any:
        """This process's store, started on first use (it then lives as long as the process)."""
        if self._server is None:
            from torch.distributed import TCPStore

            try:
                self._server = TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout))
            except Exception as exc:
                raise ReformError(f"cannot serve the rendezvous store on {self.address}: {exc}") from exc
            log.info("serving the rendezvous store on %s", self.address)
        return self._server

    def store_at(self, address: str, leader: bool) -> Any:
        if leader:
            return self.serve()
        from torch.distributed import TCPStore

        host, port = split_address(address)
        try:
            client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout))
        except Exception as exc:
            raise ReformError(f"cannot reach the rendezvous store at {address}: {exc}") from exc
        self._clients = [client]  # the previous formation's client goes with its group
        return client

    def form(self, store_address: str, prefix: str, rank: int, world_size: int) -> None:
        """See the module docstring."""
        import torch.distributed as dist

        extra: dict[str, Any] = {}
        if self.backend == "nccl":
            from spotguard.hooks.elastic import nccl

            nccl.quiesce_and_abort()  # never a blocking destroy while a peer may be gone
            extra = nccl.eager_kwargs(self.local_rank)
        else:
            destroy_groups()
        forget_mesh_caches()
        store = dist.PrefixStore(prefix, self.store_at(store_address, leader=rank == 0))
        try:
            bound_groups(self.timeout)  # until the change commits (`bound.release_groups`)
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=self.timeout), **extra)
            control_groups()  # the formation's gloo groups, before any code of the user's runs
        except Exception as exc:
            destroy_groups()
            raise ReformError(f"forming {prefix} (rank {rank} of {world_size}) on {store_address} failed: {exc}") \
                from exc
        self._mark_live(prefix if rank == 0 else None)

    def _mark_live(self, prefix: str | None) -> None:
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


def destroy_groups() -> None:
    """Destroys every process group of this process (none: nothing happens)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a peer may already be gone
            log.warning("process groups not destroyed cleanly: %s", exc)
