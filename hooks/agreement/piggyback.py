"""`PiggybackAgreement`: the "notice pending here" flag rides in DDP's own gradient all_reduce.

Contract: `PiggybackAgreement.attach(collectives, ddp_model, notice_here)` registers a DDP
communication hook on the model (every rank, once, before the first backward) and returns the
agreement, or None (logged) when the model takes no hook (it already has one, or is no DDP
model). The hook does DDP's default mean all_reduce (scaled by 1/world before summing:
bit-identical gradients) and appends one element, 1 when `notice_here()` is true, to the last
bucket; the carrier buffer (last bucket + flag) is allocated once on the bucket's device and
reused (again only if DDP rebuilds its buckets). `reduced_count` is the count the last gradient
all_reduce carried, the same on every rank. At a boundary with a non-zero count every rank runs
the blocking agreement together; a step without a notice costs no collective of the Guard's own,
and a notice is acted on at the boundary of the step it arrived in (or the next, if it came after
that step's last bucket was sent).
"""
from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable

from spotguard.hooks.agreement.base import Verdict
from spotguard.hooks.agreement.boundary import BlockingAgreement
from spotguard.hooks.agreement.collectives import GroupCollectives
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.guard")


class PiggybackAgreement(BlockingAgreement):
    def __init__(self, collectives: GroupCollectives, notice_here: Callable[[], bool]):
        super().__init__(collectives, agree_every=1)
        self._notice_here = notice_here
        self.reduced_count = 0.0
        self.carrier: Any = None  # last gradient bucket + the flag, reused every step

    @classmethod
    def attach(cls, collectives: GroupCollectives, ddp_model: Any,
               notice_here: Callable[[], bool]) -> PiggybackAgreement | None:
        agreement = cls(collectives, notice_here)
        try:
            ddp_model.register_comm_hook(ddp_model.process_group, agreement._gradient_hook)
        except (RuntimeError, AttributeError) as exc:
            log.info("not piggybacking on the model's all_reduce (%s): using the Guard's own agreement", exc)
            return None
        return agreement

    def at_boundary(self, step: int, pending: Notice | None, membership: Notice | None = None) -> Verdict | None:
        count, self.reduced_count = self.reduced_count, 0.0
        if count > 0:  # the same reduced count on every rank: all take this path together
            return self.agree_now(pending, membership)
        return None

    def _gradient_hook(self, group, bucket):  # no annotations: DDP checks them against its own types
        """DDP communication hook: the default mean all_reduce, plus the flag on the last bucket."""
        dist = self.collectives.dist
        tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
        last = bucket.is_last()
        if last:
            n = tensor.numel()
            carrier = self.carrier
            if carrier is None or carrier.numel() != n + 1 or carrier.dtype != tensor.dtype \
                    or carrier.device != tensor.device:
                carrier = self.carrier = self._torch.empty(n + 1, dtype=tensor.dtype, device=tensor.device)
            carrier[:n].copy_(tensor)
            carrier[n] = 1.0 if self._notice_here() else 0.0
            tensor = carrier
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finish(done):
            out = done.value()[0]
            if last:
                self.reduced_count = float(out[-1].item())
                out = out[:-1]
            return out

        return future.then(finish)
