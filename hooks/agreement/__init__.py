"""How the ranks agree, at a step boundary, to act on a notice (the Guard's mechanism).

- `base`: the `Agreement` interface, the `Verdict`, and the pure flag arithmetic.
- `collectives`: the few collectives the Guard needs on its own process group (or none, alone).
- `boundary`: `LocalAgreement` (one process), `BlockingAgreement`, `PipelinedAgreement`.
- `piggyback`: `PiggybackAgreement`, the flag carried inside DDP's gradient all_reduce.
`make_agreement` picks one for a set of collectives; a new process group gets a new agreement.
"""
from __future__ import annotations

from spotguard.hooks.agreement.base import Agreement, Verdict
from spotguard.hooks.agreement.boundary import BlockingAgreement, LocalAgreement, PipelinedAgreement
from spotguard.hooks.agreement.collectives import Collectives, GroupCollectives

__all__ = ["Agreement", "Verdict", "make_agreement"]


def make_agreement(collectives: Collectives, *, agree_every: int = 1, pipeline: bool = False) -> Agreement:
    """The Guard's own agreement for `collectives`: local alone, else blocking or pipelined."""
    if not isinstance(collectives, GroupCollectives):  # the one distributed kind
        return LocalAgreement()
    if pipeline:
        return PipelinedAgreement(collectives, agree_every)
    return BlockingAgreement(collectives, agree_every)
