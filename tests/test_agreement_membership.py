"""A pushed membership is agreed through its own field of the agreement vector (pure arithmetic
and the one-process agreement): the newest generation and the lowest rank holding it, a real
notice at the same boundary first."""
from __future__ import annotations

import math
from datetime import timedelta

from spotguard.hooks.agreement.base import agreed_membership, contribution, outcome, verdict_of
from spotguard.hooks.agreement.boundary import LocalAgreement
from spotguard.wire.names import MEMBERSHIP_SOURCE
from spotguard.wire.notice import Kind, Notice, now_utc


def reclaim(seconds: float = 60.0) -> Notice:
    now = now_utc()
    return Notice("aws.spot:1", Kind.RECLAIM, "aws.spot", "a", now, now + timedelta(seconds=seconds), {})


def membership(generation: int) -> Notice:
    return Notice(f"membership-{generation}", Kind.DRAIN, MEMBERSHIP_SOURCE, "b", now_utc(), None,
                  {"generation": generation, "membership": "{}"})


def combined(*flags: list[float]) -> list[float]:
    return [max(column) for column in zip(*flags)]


def test_the_newest_generation_and_its_lowest_holder_are_agreed():
    world = 4
    flags = [contribution(None, 0, world), contribution(None, 1, world, 5), contribution(None, 2, world, 6),
             contribution(None, 3, world, 6)]
    both = combined(*flags)
    assert outcome(both, world) is None
    assert agreed_membership(both, world) == (6, 2)
    verdict = verdict_of(both, world, None, membership(6))
    assert verdict is not None and not verdict.on_notice and verdict.membership_source == 2


def test_a_real_notice_is_agreed_first_and_no_priority_is_encoded_in_the_rank():
    world = 3
    flags = [contribution(None, 0, world, 9), contribution(reclaim(), 2, world), contribution(None, 1, world)]
    both = combined(*flags)
    verdict = verdict_of(both, world, None, membership(9))
    assert verdict is not None and verdict.on_notice and verdict.source_rank == 2
    assert agreed_membership(both, world) == (9, 0)  # still pending for a later boundary


def test_idle_ranks_agree_on_nothing():
    world = 2
    assert verdict_of(combined(contribution(None, 0, world), contribution(None, 1, world)), world, None, None) is None


def test_alone_a_membership_is_acted_on_at_once_after_any_notice():
    agreement = LocalAgreement()
    pushed = membership(3)
    verdict = agreement.at_boundary(0, None, pushed)
    assert verdict is not None and (verdict.on_notice, verdict.membership, verdict.deadline_ts) == \
        (False, pushed, math.inf)
    first = agreement.at_boundary(1, reclaim(), pushed)
    assert first is not None and first.on_notice
