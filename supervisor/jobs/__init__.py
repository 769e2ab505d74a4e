"""Job kinds the supervisor manages, behind one small adapter interface (see base.py)."""
from __future__ import annotations

from spotguard.supervisor.jobs.base import JobAdapter
from spotguard.supervisor.jobs.batch import BatchJobAdapter
from spotguard.supervisor.jobs.pytorch import PyTorchJobAdapter

ADAPTERS: tuple[JobAdapter, ...] = (BatchJobAdapter(), PyTorchJobAdapter())
BY_KIND = {a.kind: a for a in ADAPTERS}

__all__ = ["ADAPTERS", "BY_KIND", "BatchJobAdapter", "JobAdapter", "PyTorchJobAdapter"]
