"""`dcp.save`'s protocol with its coordination through a `StoreChannel` instead of a process group:
the same planner and storage writer calls in the same order (DCP's public `SavePlanner` and
`StorageWriter` interfaces), so the files and `.metadata` are what `dcp.save` writes and `dcp.load`
reads them; only the exchange of plans and write results goes through the store, so the save
needs no live group after it started (an in-place change leaves the old group while it runs).

Contract: `save_over_channel(state_dict, writer, channel)` on every rank of the channel; returns
DCP's `Metadata` on rank 0 (None elsewhere) once the rank's part is written (and on rank 0 the
metadata); a failure on any rank (a plan, a write, the finish) raises `PeerFailed` on every
other, a silent peer `ChannelError` after the channel's timeout.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageWriter

from .store_channel import ERROR, StoreChannel, error_payload, raise_if_error

T = TypeVar("T")


def save_over_channel(state_dict: dict[str, Any], writer: StorageWriter, channel: StoreChannel) -> Metadata | None:
    """See the module docstring."""
    planner = DefaultSavePlanner()
    coordinator = channel.rank == 0
    writer.reset(None)
    metadata: list[Metadata] = []

    def local_plan() -> Any:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=channel.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans: list[Any]) -> list[Any]:
        plans, global_metadata = planner.create_global_plan(plans)
        metadata.append(global_metadata)
        return writer.prepare_global_plan(plans)

    central = _reduce_scatter(channel, "plan", local_plan, global_plan)

    def write() -> Any:
        written = writer.write_data(planner.finish_plan(central), planner)
        written.wait()
        return written.value()

    def finish(results: list[Any]) -> Metadata:
        writer.finish(metadata=metadata[0], results=results)
        return metadata[0]

    finished = _all_reduce(channel, "write", write, finish)
    return finished if coordinator else None


def _reduce_scatter(channel: StoreChannel, name: str, local: Callable[[], Any],
                    combine: Callable[[list[Any]], list[Any]]) -> Any:
    """Every rank's `local()` to rank 0, `combine` there, each rank's element back (its own only)."""
    payloads = channel.gather(name, _attempt(local))
    answers = None
    if payloads is not None:
        combined = _attempt(lambda: [pickle.dumps(plan) for plan in combine(_loaded(payloads))])
        answers = pickle.loads(combined) if not combined.startswith(ERROR) else [combined] * channel.world_size
    return pickle.loads(raise_if_error(channel.scatter(name + "-answer", answers), 0))


def _all_reduce(channel: StoreChannel, name: str, local: Callable[[], Any], combine: Callable[[list[Any]], T]) -> T:
    """Every rank's `local()` to rank 0, `combine` there, its result on every rank."""
    return pickle.loads(_coordinated(channel, name, local, combine))


def _coordinated(channel: StoreChannel, name: str, local: Callable[[], Any],
                 combine: Callable[[list[Any]], Any]) -> bytes:
    """Rank 0's answer (pickled) to every rank's `local()`; a failure of any rank's `local()` or of
    `combine` is the answer instead, and raises `PeerFailed` on every rank."""
    payloads = channel.gather(name, _attempt(local))
    answer = b""
    if payloads is not None:
        answer = _attempt(lambda: combine(_loaded(payloads)))
    return raise_if_error(channel.broadcast(name + "-answer", answer), 0)


def _loaded(payloads: list[bytes]) -> list[Any]:
    """Every rank's object; `PeerFailed` for the first rank that sent its failure instead."""
    return [pickle.loads(raise_if_error(payload, rank)) for rank, payload in enumerate(payloads)]


def _attempt(make: Callable[[], Any]) -> bytes:
    """`make()` pickled, or its failure as an error payload (SystemExit and KeyboardInterrupt propagate)."""
    try:
        return pickle.dumps(make())
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        return error_payload(exc)
