"""This process's groups as one object for its whole life: the rendezvous, each formation's
default group and gloo control and checkpoint groups, the Guard's collectives on them, the
membership the process started or joined with, and every timeout of a wait on a peer.

The session is re-formed in place (torchft's reconfigurable process group): whatever holds it
keeps working across formations. It is the only process-wide state of the in-place machinery:
`process_session()` returns the one `hooks.elastic.init_process_group` made, or, in a job that
called torch's own `init_process_group`, one made on first use around the default group, so
the adapter and the Guard (made in either order, without being handed anything) share one set
of groups per formation.

Contract:
- `Timeouts.from_env()`: every named wait. `reform` (`SPOTGUARD_REFORM_TIMEOUT`, 30 s): the
  longest any wait on a peer in a change lasts (each collective, each formation); `change`
  (`SPOTGUARD_CHANGE_TIMEOUT`, 3 x reform): the longest a change lasts on any rank, so no wait
  of it runs past its start + `change` and a rank that finds that time passed (it was stopped)
  leaves at once; `durable` (`SPOTGUARD_DURABLE_TIMEOUT`, 600 s): the longest a rank waits for
  its checkpoint's durable write (a drain's collectives included); `on_connect` (1.5 s): how
  long a starting worker waits for the membership its sidecar sends on connect; `live_probe`
  (5 s, at most a third of `reform`): how long it asks a membership's store whether its group
  lives. A bad value raises `ConfigError` naming the variable.
- `groups()`: the current formation's `ControlGroups` (None alone or without torch.distributed),
  made on the first call after a formation (collective, in one order on every rank); the same
  until the default group is formed again. `collectives(process_group)`: the Guard's
  collectives on the control group (or on `process_group` when given), local alone.
- `reform(store_address, prefix, rank, world_size, timeout)`: leaves the current formation
  (`leave()`), forms the new default group of the rendezvous backend at `prefix` on the store at
  `store_address` (served by this process for rank 0), then its control groups; raises
  `ReformError` when it is not complete within `timeout`. Only an in-place session (made with a
  `Rendezvous`) re-forms. `meeting` is then (store_address, prefix) until the formation is left,
  and `meeting_store(timeout)` a client of its own there, at the prefix: where a save that must
  outlive the groups coordinates (`machine.table`).
- `leave()`: this formation's groups are gone, without a last agreement (NCCL: the stream
  synchronised and the communicators aborted; gloo: destroyed). Idempotent; a rank that failed
  its part never votes again after it. Safe to call from another thread.
- `bound(seconds)`: every live group of this process, and every group made from now on, waits at
  most `seconds` per operation; `release()` gives torch's own default back (live and new);
  `bounded(seconds)` is both around a block, released in its `finally`. `bounded_now()` tells.
  This module is the only place that touches torch's `default_pg_timeout`.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from spotguard.config import positive_float
from spotguard.hooks.agreement.collectives import Collectives, GroupCollectives
from spotguard.hooks.agreement.control_group import ControlGroups, make_control_groups
from spotguard.wire import names

if TYPE_CHECKING:
    from spotguard.hooks.elastic.rendezvous import Rendezvous
    from spotguard.wire.membership import Membership

log = logging.getLogger("spotguard.hooks.elastic")

CHANGE_REFORMS = 3.0  # a change's default budget, in re-form timeouts


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the agreed-step machine and the formations, named (module docstring)."""

    reform: float = 30.0
    change: float = 90.0
    durable: float = 600.0
    on_connect: float = 1.5
    live_probe: float = 5.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Timeouts:
        env = dict(os.environ if env is None else env)
        reform = positive_float(names.ENV_REFORM_TIMEOUT, env.get(names.ENV_REFORM_TIMEOUT) or 30)
        return cls.of(reform, change=positive_float(names.ENV_CHANGE_TIMEOUT, env.get(names.ENV_CHANGE_TIMEOUT) or
                                                    CHANGE_REFORMS * reform),
                      durable=positive_float(names.ENV_DURABLE_TIMEOUT, env.get(names.ENV_DURABLE_TIMEOUT) or 600))

    @classmethod
    def of(cls, reform: float, *, change: float | None = None, durable: float = 600.0) -> Timeouts:
        """The timeouts for a re-form timeout of `reform` seconds (the others derived from it)."""
        return cls(reform, CHANGE_REFORMS * reform if change is None else change, durable,
                   live_probe=min(5.0, reform / 3))


class GroupSession:
    """See the module docstring."""

    def __init__(self, timeouts: Timeouts | None = None, rendezvous: Rendezvous | None = None):
        self.timeouts = timeouts if timeouts is not None else Timeouts.from_env()
        self.rendezvous = rendezvous
        self.joined: Membership | None = None  # the membership this process joined (None: it started)
        self.started: Membership | None = None  # start at min: the membership this process started with
        self.state_received = False  # a joiner received its state from a live peer
        self._torch_default: timedelta | None = None  # torch's own default while a bound replaces it
        self._formation: tuple[Any, ControlGroups] | None = None  # (the default group, its gloo groups)
        self.meeting: tuple[str, str] | None = None  # (store address, prefix) of the in-place formation
        self._collectives: tuple[Any, Collectives] | None = None  # (the group they run on, the collectives)
        self._lock = threading.Lock()

    # ---- the process --------------------------------------------------------------------------
    @property
    def in_place(self) -> bool:
        return self.rendezvous is not None

    def owes_state(self) -> bool:
        """This process joined a running group and has not received its state yet."""
        return self.joined is not None and not self.state_received

    def first_generation(self) -> int | None:
        """The generation this process joined or started with (None: the launcher's group)."""
        first = self.joined or self.started
        return None if first is None else first.generation

    # ---- the formation ------------------------------------------------------------------------
    def groups(self) -> ControlGroups | None:
        """See the module docstring."""
        world = default_group()
        if world is None:
            return None
        with self._lock:
            if self._formation is None or self._formation[0] is not world:
                self._formation = (world, make_control_groups())
            return self._formation[1]

    def collectives(self, process_group: Any = None) -> Collectives:
        """The Guard's collectives (module docstring). Raises RuntimeError when WORLD_SIZE > 1
        but torch.distributed has no group yet."""
        try:
            import torch.distributed as dist
        except ImportError:
            return Collectives()
        if not (dist.is_available() and dist.is_initialized()):
            if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
                raise RuntimeError("create the Guard after torch.distributed.init_process_group (WORLD_SIZE > 1)")
            return Collectives()
        if dist.get_world_size() < 2:
            return Collectives()
        if process_group is None:
            groups = self.groups()
            assert groups is not None
            process_group = groups.control
        if self._collectives is None or self._collectives[0] is not process_group:
            self._collectives = (process_group, GroupCollectives(process_group))
        return self._collectives[1]

    def reform(self, store_address: str, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        """See the module docstring."""
        import torch.distributed as dist

        from spotguard.hooks.elastic.caches import forget_mesh_caches
        from spotguard.hooks.elastic.rendezvous import ReformError

        rendezvous = self.rendezvous
        if rendezvous is None:
            raise ReformError("only an in-place session (hooks.elastic.init_process_group) re-forms")
        self.leave()
        forget_mesh_caches()
        extra: dict[str, Any] = {}
        if rendezvous.backend == "nccl":
            from spotguard.hooks.elastic import nccl

            extra = nccl.eager_kwargs(rendezvous.local_rank)
        try:
            store = dist.PrefixStore(prefix, rendezvous.store_at(store_address, rank == 0, timeout))
            dist.init_process_group(rendezvous.backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout), **extra)
            self.groups()  # the formation's gloo groups, before any code of the user's runs
        except Exception as exc:
            self.leave()
            raise ReformError(f"forming {prefix} (rank {rank} of {world_size}) on {store_address} failed: {exc}") \
                from exc
        rendezvous.mark_live(prefix if rank == 0 else None)
        self.meeting = (store_address, prefix)

    def meeting_store(self, timeout: float) -> Any:
        """A client of its own (connected within `timeout`) to the current formation's store, at
        its prefix: what a save that must outlive the formation's groups coordinates through."""
        import torch.distributed as dist

        from spotguard.hooks.elastic.rendezvous import open_client

        if self.meeting is None:
            raise RuntimeError("no in-place formation: nothing to meet at")
        address, prefix = self.meeting
        return dist.PrefixStore(prefix, open_client(address, timeout))

    def leave(self) -> None:
        """See the module docstring."""
        import torch.distributed as dist

        with self._lock:
            self._formation, self._collectives, self.meeting = None, None, None
            if not (dist.is_available() and dist.is_initialized()):
                return
            if self.rendezvous is not None and self.rendezvous.backend == "nccl":
                from spotguard.hooks.elastic import nccl

                nccl.quiesce_and_abort()  # never a blocking destroy while a peer may be gone
                return
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a peer may already be gone
                log.warning("process groups not destroyed cleanly: %s", exc)

    # ---- timeouts ------------------------------------------------------------------------------
    def bound(self, seconds: float) -> None:
        """See the module docstring."""
        import torch.distributed.distributed_c10d as c10d

        if self._torch_default is None:
            self._torch_default = c10d.default_pg_timeout
        from spotguard.hooks.elastic.torch_private import set_live_group_timeouts

        bound = timedelta(seconds=max(seconds, 0.001))
        c10d.default_pg_timeout = bound  # read by torch whenever a group is made without a timeout
        set_live_group_timeouts(bound)

    def release(self) -> None:
        """See the module docstring."""
        if self._torch_default is None:
            return
        import torch.distributed.distributed_c10d as c10d

        from spotguard.hooks.elastic.torch_private import set_live_group_timeouts

        default, self._torch_default = self._torch_default, None
        c10d.default_pg_timeout = default
        set_live_group_timeouts(default)

    @contextmanager
    def bounded(self, seconds: float) -> Iterator[GroupSession]:
        """See the module docstring."""
        self.bound(seconds)
        try:
            yield self
        finally:
            self.release()

    def bounded_now(self) -> bool:
        return self._torch_default is not None


def default_group() -> Any:
    """The default group when torch.distributed runs more than one rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


_this_process: list[GroupSession] = []  # the process's one session (see the module docstring)


def process_session() -> GroupSession:
    """This process's session: the one `hooks.elastic.init_process_group` made, else one made now."""
    if not _this_process:
        _this_process.append(GroupSession())
    return _this_process[0]


def use_session(session: GroupSession) -> GroupSession:
    """Makes `session` this process's (`hooks.elastic.init_process_group`); returns it."""
    _this_process[:] = [session]
    return session
