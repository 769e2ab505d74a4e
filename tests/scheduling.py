"""The order in which the suite's tests reach the xdist workers: each worker's longest first.

`make test` runs the suite with `--dist worksteal`: xdist hands worker i the i-th contiguous
slice of the collection (equal counts), each worker runs its slice in order, and a worker that
runs dry steals the second half of the longest queue left. `longest_first` deals the tests into
those slices so that each holds a similar share of the recorded seconds
(`tests/durations.json`) and runs its longest tests first: the 30-80 s dry-runs start at once on
every worker, steals take short tests from the ends, and the suite does not end with one worker
in a long test beside idle ones.

A unit is one test, or a whole module whose tests share a module- or class-scoped fixture of
that module (a run several checks read): its tests stay together, in their order, so the fixture
runs once. The order depends only on the collection, the durations file and the worker count, so
every worker computes the same one, as xdist requires.

`SPOTGUARD_TEST_DURATIONS_OUT=tests/durations.json make test` records a run's durations
(`record_duration`, `write_durations`); a test missing from the file counts as `UNKNOWN_LONG`
seconds if `runs_long` says its module is one of multi-process runs, and as 0 otherwise.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).with_name("durations.json")
DURATIONS_OUT_ENV = "SPOTGUARD_TEST_DURATIONS_OUT"
UNKNOWN_LONG = 20.0  # seconds: a test not yet recorded, in a module of multi-process runs
_recorded: dict[str, float] = {}


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """{node id: seconds} from the last recording, or {} when there is none or it is unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a module- or class-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module_id = item.nodeid.split("::", 1)[0]
    return any(fixturedef.scope in ("module", "class") and fixturedef.baseid.startswith(module_id)
               for defs in info.name2fixturedefs.values() for fixturedef in defs)


def slice_sizes(count: int, workers: int) -> list[int]:
    """The item counts of worksteal's first hand-out: each worker, in turn, gets an equal share
    of what is left."""
    sizes, left = [], count
    for remaining in range(workers, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    return sizes


def deal(units: list[tuple[float, list]], workers: int) -> list:
    """The items of `units` ((seconds, items), the longest first) as `workers` consecutive slices
    of worksteal's sizes: each unit to the slice with the fewest seconds that has room for it, or
    to the one with the most room left; each slice keeps the longest first."""
    sizes = slice_sizes(sum(len(items) for _, items in units), workers)
    slices: list[list] = [[] for _ in range(workers)]
    seconds = [0.0] * workers
    for cost, items in units:
        room = [sizes[i] - len(slices[i]) for i in range(workers)]
        fits = [i for i in range(workers) if room[i] >= len(items)]
        chosen = min(fits, key=lambda i: (seconds[i], i)) if fits else max(range(workers), key=lambda i: (room[i], -i))
        slices[chosen].extend(items)
        seconds[chosen] += cost
    return [item for items in slices for item in items]


def longest_first(items: list, durations: dict[str, float], runs_long: Callable[[pytest.Item], bool],
                  workers: int = 1) -> None:
    """Reorders `items` in place for `workers` worksteal workers (module docstring); ties keep
    the collection's order."""
    units: dict[str, list] = {}
    for item in items:
        key = item.nodeid.split("::", 1)[0] if shares_a_module_fixture(item) else item.nodeid
        units.setdefault(key, []).append(item)

    def seconds(item: pytest.Item) -> float:
        known = durations.get(item.nodeid)
        if known is not None:
            return known
        return UNKNOWN_LONG if runs_long(item) else 0.0

    costed = [(sum(seconds(item) for item in unit), index, unit) for index, unit in enumerate(units.values())]
    costed.sort(key=lambda entry: (-entry[0], entry[1]))
    items[:] = deal([(cost, unit) for cost, _, unit in costed], max(1, workers))


def xdist_workers() -> int:
    """How many workers this run has (1 without xdist): the same on every worker."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def record_duration(report: pytest.TestReport) -> None:
    """Adds a finished phase's seconds (setup, call, teardown) to this run's recording, when
    $SPOTGUARD_TEST_DURATIONS_OUT asks for one."""
    if not os.environ.get(DURATIONS_OUT_ENV):
        return
    _recorded[report.nodeid] = round(_recorded.get(report.nodeid, 0.0) + report.duration, 2)


def write_durations(keep_at_least: float = 0.5) -> None:
    """Writes this run's recording to $SPOTGUARD_TEST_DURATIONS_OUT: the tests that took at least
    `keep_at_least` seconds (the others count as 0), sorted by node id."""
    out = os.environ.get(DURATIONS_OUT_ENV)
    if not out or not _recorded:
        return
    kept = {k: v for k, v in sorted(_recorded.items()) if v >= keep_at_least}
    Path(out).write_text(json.dumps(kept, indent=0) + "\n")
