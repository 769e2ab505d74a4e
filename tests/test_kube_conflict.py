"""The one conflict-retry helper: re-read and write again on 409, a bounded number of times."""
from __future__ import annotations

import pytest

from spotguard.kube.api import ApiError, Conflict
from spotguard.kube.conflict import TooManyConflicts, retry_on_conflict


def test_a_conflict_is_retried_from_a_fresh_read_until_the_write_succeeds():
    versions = iter(["1", "2", "3"])
    writes, conflicts = [], []

    def attempt() -> str:
        version = next(versions)  # each attempt reads again
        writes.append(version)
        if version != "3":
            raise Conflict(409, "the object has been modified")
        return version

    assert retry_on_conflict(attempt, attempts=5, on_conflict=lambda: conflicts.append(1)) == "3"
    assert writes == ["1", "2", "3"] and len(conflicts) == 2


def test_conflicts_beyond_the_bound_raise_and_other_errors_pass_through_at_once():
    calls = []

    def always_conflicts() -> None:
        calls.append(1)
        raise Conflict(409, "busy")

    with pytest.raises(TooManyConflicts):
        retry_on_conflict(always_conflicts, attempts=3)
    assert len(calls) == 3

    def fails() -> None:
        calls.append(2)
        raise ApiError(500, "boom")

    with pytest.raises(ApiError) as info:
        retry_on_conflict(fails, attempts=3)
    assert info.value.status == 500 and calls.count(2) == 1
