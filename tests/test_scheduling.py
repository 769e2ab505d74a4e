"""The suite's own schedule (tests/scheduling.py): worksteal's slices, dealt by recorded seconds."""
from __future__ import annotations

import json

from tests.scheduling import deal, load_durations, slice_sizes


def test_slices_have_worksteals_sizes():
    assert slice_sizes(10, 3) == [3, 3, 4]
    assert slice_sizes(2218, 3) == [739, 739, 740]
    assert slice_sizes(5, 1) == [5]


def test_each_slice_gets_a_share_of_the_seconds_and_runs_its_longest_first():
    units = [(60.0, ["a"]), (50.0, ["b"]), (40.0, ["c"]), (0.0, ["d"]), (0.0, ["e"]), (0.0, ["f"])]
    assert deal(units, 3) == ["a", "f", "b", "e", "c", "d"]


def test_a_module_sharing_a_run_stays_together_in_one_slice():
    units = [(90.0, ["m1", "m2", "m3"]), (10.0, ["x"]), (0.0, ["y"]), (0.0, ["z"])]
    dealt = deal(units, 2)
    assert dealt[:3] == ["m1", "m2", "m3"] and sorted(dealt[3:]) == ["x", "y", "z"]


def test_an_unreadable_durations_file_orders_by_collection(tmp_path):
    bad = tmp_path / "durations.json"
    bad.write_text("{not json")
    assert load_durations(bad) == {}
    bad.write_text(json.dumps({"t::a": 1.5, "t::b": "slow"}))
    assert load_durations(bad) == {"t::a": 1.5}
    assert load_durations(tmp_path / "missing.json") == {}
