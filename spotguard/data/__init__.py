"""spotguard.data: the elastic sampler (every sample exactly once per epoch at any world size).

A layer of its own at the bottom of the package (docs/developing.md): it imports only the shared
modules (`spotguard.config`) and torch; the hooks' adapters keep its position in their
checkpoints, the integrations drive it, users import it in training code.
"""
from __future__ import annotations

from spotguard.data.sampler import DataPositionError, DatasetLengthChanged, ElasticSampler, GlobalOrder

__all__ = ["DataPositionError", "DatasetLengthChanged", "ElasticSampler", "GlobalOrder"]
