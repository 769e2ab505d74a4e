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
scenario with a test of its own (`OWN_TESTS`), which runs it once and checks what it is about, is
not run here again.
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


OWN_TESTS = {"long-step-short-notice": "tests/test_dryrun_deadline.py"}
LISTED = {name: tuple(load_scenario(name).allowed_frameworks) for name in bundled_scenarios() if name not in OWN_TESTS}
if os.environ.get("SPOTGUARD_FULL_MATRIX") == "1":
    CASES = [(name, framework) for name, frameworks in LISTED.items() for framework in frameworks]
else:
    CASES = ci_cases(LISTED)


def test_the_ci_cases_run_every_scenario_and_every_framework():
    assert ci_cases({"a": ("ddp", "fsdp2"), "b": ("ddp", "fsdp2"), "c": ("deepspeed",)}) == \
        [("a", "ddp"), ("b", "fsdp2"), ("c", "deepspeed")]
    assert {name for name, _ in CASES} == set(LISTED) == set(bundled_scenarios()) - set(OWN_TESTS)
    assert set(OWN_TESTS) <= set(bundled_scenarios())
    assert {framework for _, framework in CASES} == {f for frameworks in LISTED.values() for f in frameworks}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name, framework", CASES, ids=[f"{n}-{f}" for n, f in CASES])
async def test_bundled_scenario_passes(tmp_path, name, framework):
    scenario = load_scenario(name).with_overrides(framework=framework)
    report = await passing_dry_run(scenario, tmp_path / "run")
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
