"""Every bundled scenario, with every framework it lists, passes as a real dry-run run by the
supervisor's own code: finished, nothing lost beyond what it allows, every deadline met (no
rank of a node trains at its deadline), its `expect` counts met, and in place where in place
applies (the survivors of every reclaim keep their processes: one generation, no relaunch); a
job that relaunches resumes from the step its ranks agreed on and saved, with the state they
saved; a maintenance is acted on no sooner than its deadline less the horizon (120 s).

The matrix is the CI's check of the scenarios users run first; it runs them as shipped. CI runs
every scenario once and every framework at least once (`ci_cases`: a scenario that lists several
frameworks runs with one no earlier scenario ran, else its first); `SPOTGUARD_FULL_MATRIX=1` runs
every scenario with every framework it lists (two more dry-runs, ~2 minutes of a CI worker). A
scenario with a test of its own (`OWN_TESTS`), which runs it once as shipped and checks what it is
about, is not run here again with the framework that test runs. The tests of two-reclaims and
preempted-twice check their report with `assert_passed_as_shipped` too (the checks this matrix
makes); long-step-short-notice's checks its own way what the watchdog's save says (no agreed step:
the ranks never agree, which this matrix's relaunch check expects).
"""
from __future__ import annotations

import os

import pytest

from spotguard.trainer.scenario import bundled_scenarios, load_scenario
from tests.helpers import passing_dry_run

pytestmark = pytest.mark.slow
HORIZON = 120.0  # seconds: a notice further ahead is held (README, the Guard)


def ci_cases(listed: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """One (scenario, framework) per scenario, in order, covering every framework some scenario lists."""
    cases: list[tuple[str, str]] = []
    for name, frameworks in listed.items():
        ran = {framework for _, framework in cases}
        cases.append((name, next((f for f in frameworks if f not in ran), frameworks[0])))
    return cases


# scenario -> (the test that runs it as shipped, the framework it runs it with)
OWN_TESTS = {"long-step-short-notice": ("tests/test_dryrun_deadline.py", "ddp"),
             "preempted-twice": ("tests/test_dryrun_truth.py", "ddp"),
             "two-reclaims": ("tests/test_dryrun_faults.py", "ddp")}
ALL_LISTED = {name: tuple(load_scenario(name).allowed_frameworks) for name in bundled_scenarios()}
LISTED = {name: frameworks for name, frameworks in ALL_LISTED.items() if name not in OWN_TESTS}
if os.environ.get("SPOTGUARD_FULL_MATRIX") == "1":
    CASES = [(name, framework) for name, frameworks in ALL_LISTED.items() for framework in frameworks
             if OWN_TESTS.get(name, ("", ""))[1] != framework]
else:
    CASES = ci_cases(LISTED)


def test_the_ci_cases_run_every_scenario_and_every_framework():
    assert ci_cases({"a": ("ddp", "fsdp2"), "b": ("ddp", "fsdp2"), "c": ("deepspeed",)}) == \
        [("a", "ddp"), ("b", "fsdp2"), ("c", "deepspeed")]
    assert set(LISTED) == set(bundled_scenarios()) - set(OWN_TESTS)
    assert set(LISTED) <= {name for name, _ in CASES} <= set(ALL_LISTED)
    assert set(OWN_TESTS) <= set(bundled_scenarios())
    assert all(framework in ALL_LISTED[name] for name, (_, framework) in OWN_TESTS.items())
    own = {framework for _, framework in OWN_TESTS.values()}
    assert {framework for _, framework in CASES} | own == {f for frameworks in ALL_LISTED.values() for f in frameworks}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name, framework", CASES, ids=[f"{n}-{f}" for n, f in CASES])
async def test_bundled_scenario_passes(tmp_path, name, framework):
    scenario = load_scenario(name).with_overrides(framework=framework)
    assert_passed_as_shipped(scenario, await passing_dry_run(scenario, tmp_path / "run"))


def assert_passed_as_shipped(scenario, report: dict) -> None:
    """The matrix's checks of a passing dry-run's `report` of the bundled `scenario` (module
    docstring); `passing_dry_run` checked that it finished, with no problem and no process left."""
    assert report["steps_lost"] <= scenario.allow_steps_lost
    for row in report["timeline"]:
        if "margin_s" in row:
            assert row["margin_s"] > 0, row
        if row["kind"] == "maintenance" and "agreed" in row:
            assert row["agreed"] >= row["deadline"] - HORIZON - 1.0, row
    paths = {row["path"] for row in report["timeline"] if "path" in row}
    if scenario.in_place:
        assert paths <= {"in-place"}, report["timeline"]
        assert len(report["generations"]) == 1, report["generations"]
        assert all(c["path"] == "in-place" for c in report["membership_changes"]), report["membership_changes"]
    else:
        assert "in-place" not in paths, report["timeline"]
    for row in report["timeline"]:
        if row.get("path") in ("relaunch", "fallback") and "resumed_step" in row:
            assert row["checkpoint_step"] == row["agreed_step"] == row["resumed_step"], row
            if row.get("saved_digest") and row.get("resumed_digest"):
                assert row["saved_digest"] == row["resumed_digest"], row
