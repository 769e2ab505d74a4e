"""Dry-run scenarios: YAML and spot traces, with errors that name the line and the field."""
import re
from pathlib import Path

import pytest

import spotguard.trainer
from spotguard.trainer.scenario import (DEFAULT_SCENARIO, ScenarioError, bundled_scenarios, bundled_traces,
                                        find_trace, live_at, load_scenario, parse_scenario, parse_trace,
                                        scenario_from_trace)

REPO = Path(__file__).resolve().parent.parent


def test_default_scenario_is_valid():
    s = parse_scenario(DEFAULT_SCENARIO)
    assert s.workers == 2 and [e.kind for e in s.events] == ["reclaim", "capacity"]


def test_every_bundled_scenario_loads():
    names = bundled_scenarios()
    assert {"reclaim-mid-step", "two-reclaims", "snapshot-fallback", "canceled-maintenance", "gke-15s",
            "deepspeed", "fixed-policy"} <= set(names)
    for name in names:
        assert load_scenario(name).events


@pytest.mark.parametrize("text, where, field", [
    ("name: x\nworkers: 2\nevents:\n  - {at: 1, kind: explode, node: node-0}\n", ":4", "kind"),
    ("name: x\nworkers: 2\nevents:\n  - {at: 1, kind: reclaim}\n", ":4", "node"),
    ("name: x\nworkers: 2\nevents:\n  - {at: -1, kind: reclaim, node: node-0}\n", ":4", "at"),
    ("name: x\nworkers: 2\nevents:\n  - {at: 1, kind: reclaim, node: node-7}\n", ":4", "node"),
    ("name: x\nworkers: 2\nevents:\n  - {at: 1, kind: reclaim, node: node-0, extra: 1}\n", ":4", "extra"),
    ("name: x\nworkerz: 2\n", ":2", "workerz"),
    ("name: x\ncloud: mars\n", ":2", "cloud"),
    ("name: x\nframeworks: [ddp, tensorflow]\n", ":2", "frameworks"),
    ("name: x\nframeworks: ddp\n", ":2", "frameworks"),
    ("name: x\nworkers: two\n", ":2", "workers"),
    ("name: x\nworkers: 2\nmin_workers: 3\n", "", "min_workers"),
    ("name: x\nevents: [\n", ":", "not valid YAML"),
    ("- just a list\n", ":1", "mapping"),
])
def test_bad_scenarios_name_line_and_field(text, where, field):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "s.yaml")
    message = str(info.value)
    assert message.startswith("s.yaml" + where) and field in message


def test_unreadable_file_is_a_scenario_error(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


@pytest.mark.parametrize("text, line, field", [
    ("t,e,n\n", 1, "header"),
    ("t_seconds,event,node\n0,add,a\nx,add,b\n", 3, "t_seconds"),
    ("t_seconds,event,node\n5,add,a\n3,add,b\n", 3, "t_seconds"),
    ("t_seconds,event,node\n0,add,a\nnan,add,b\n", 3, "t_seconds"),
    ("t_seconds,event,node\n-1,add,a\n", 2, "t_seconds"),
    ("t_seconds,event,node\n0,boom,a\n", 2, "event"),
    ("t_seconds,event,node\n0,add\n", 2, "row"),
    ("t_seconds,event,node\n0,add, \n", 2, "node"),
    ("t_seconds,event,node\n0,add,a\n5,add,a\n", 3, "node"),
    ("t_seconds,event,node\n0,add,a\n5,preempt,b\n", 3, "node"),
    ("t_seconds,event,node\n0,add,a\n5,preempt,a\n6,preempt,a\n", 4, "node"),
])
def test_bad_traces_name_file_line_and_field(text, line, field):
    with pytest.raises(ScenarioError) as info:
        parse_trace(text, "t.csv")
    assert str(info.value).startswith(f"t.csv:{line}: {field}: ")


def test_trace_maps_nodes_onto_slots_in_order():
    text = "t_seconds,event,node\n0,add,a\n0,add,b\n60,preempt,b\n120,add,c\n180,preempt,a\n"
    s = scenario_from_trace(text, "x.csv", workers=2, time_scale=60.0)
    assert [(e.at, e.kind, e.node) for e in s.events] == [
        (1.0, "reclaim", "node-1"), (2.0, "capacity", "node-1"), (3.0, "reclaim", "node-0")]


def test_a_mid_trace_window_starts_with_the_live_nodes_in_the_slots():
    text = ("t_seconds,event,node\n0,add,a\n0,add,b\n0,add,c\n100,preempt,a\n300,add,d\n"
            "400,preempt,c\n500,preempt,d\n")
    s = scenario_from_trace(text, "x.csv", workers=2, time_scale=100.0, start=200.0)
    # b and c are live at 200 and hold node-0 and node-1; d finds no free slot when it is added
    assert [(e.at, e.kind, e.node) for e in s.events] == [(2.0, "reclaim", "node-1")]
    assert scenario_from_trace(text, "x.csv", workers=2, time_scale=100.0, start=200.0) == s  # deterministic


def test_a_mid_trace_window_of_a_real_trace_reclaims_nodes_live_at_its_start():
    path = find_trace("gcp-n1-v100x1-bamboo")
    rows = parse_trace(path.read_text(), str(path))
    start = 20000.0
    s = scenario_from_trace(path.read_text(), str(path), workers=4, time_scale=30.0, start=start, window=3000.0)
    by_line = {r.line: r for r in rows}
    reclaimed = [by_line[e.line].node for e in s.events if e.kind == "reclaim"]
    live = live_at(rows, start)
    assert reclaimed and reclaimed[0] in live[:4]


def test_every_bundled_trace_ships_in_the_package_and_converts():
    names = bundled_traces()
    assert {"aws-p3-bamboo", "aws-g4dn-bamboo", "gcp-n1-v100x1-bamboo", "aws-g4dn.xlarge-bamboo2020-use1c",
            "aws-g4dn.xlarge-bamboo2020-use1d"} <= set(names)
    package = Path(spotguard.trainer.__file__).resolve().parent / "traces"
    assert (package / "README.md").read_text().count("MIT License") == 1
    for name in names:
        path = find_trace(name)
        assert path.resolve().parent == package and find_trace(f"{name}.csv") == path
        rows = parse_trace(path.read_text(), str(path))
        assert rows and rows[0].t == 0
        s = scenario_from_trace(path.read_text(), str(path), workers=3, time_scale=600.0)
        assert any(e.kind == "reclaim" for e in s.events)
        assert load_scenario(name).name == name  # the dry-run takes a bundled trace by name too


def test_unknown_trace_names_the_bundled_ones(tmp_path):
    with pytest.raises(ScenarioError, match="aws-p3-bamboo"):
        find_trace(tmp_path / "missing.csv")


def test_no_code_reads_traces_from_a_machine_path():
    offenders = [str(p.relative_to(REPO)) for folder in ("bench", "trainer", "tests", "spotguard")
                 for p in (REPO / folder).rglob("*.py")
                 if p.resolve() != Path(__file__).resolve()
                 and ("shared/data" in p.read_text() or "spot-traces" in p.read_text())]
    assert offenders == []


def test_frameworks_default_to_the_scenarios_framework():
    assert parse_scenario("name: x\nframework: fsdp2\n").allowed_frameworks == ("fsdp2",)
    assert parse_scenario("name: x\nframeworks: [ddp, fsdp2]\n").allowed_frameworks == ("ddp", "fsdp2")
    with pytest.raises(ScenarioError, match="frameworks"):
        parse_scenario("name: x\nmembership: in-place\nframeworks: [ddp, lightning]\n", "s.yaml")


def test_framework_integrations_take_the_restart_path_but_accelerate_changes_in_place():
    from spotguard.trainer.scenario import load_scenario

    default = load_scenario(None)
    for framework in ("hf", "lightning"):
        assert not default.with_overrides(framework=framework, policy="elastic").in_place
    assert default.with_overrides(framework="accelerate", policy="elastic").in_place
    assert default.with_overrides(framework="deepspeed", policy="elastic").in_place
    with pytest.raises(ScenarioError,
                       match="in-place needs policy elastic and framework ddp or fsdp2 or deepspeed or accelerate"):
        default.with_overrides(framework="hf", policy="elastic", membership="in-place")


def test_start_at_min_needs_in_place_and_a_boolean():
    base = "name: s\nworkers: 3\nmin_workers: 2\n"
    assert parse_scenario(base + "start_at_min: true\n", "<s>").start_at_min
    for extra in ("start_at_min: yes-please\n", "policy: fixed\nstart_at_min: true\n"):
        with pytest.raises(ScenarioError, match="start_at_min"):
            parse_scenario(base + extra, "<s>")


def test_a_long_step_and_exit_on_drain_read_and_reach_the_reference_trainer():
    from spotguard.trainer.train import compute_seconds, parse_args

    s = parse_scenario("name: x\nsteps: 30\nstep_seconds: 0.05\nlong_step: {step: 13, seconds: 15}\n"
                       "exit_on_drain: true\n")
    assert (s.long_step, s.exit_on_drain) == ((13, 15.0), True)
    assert (parse_scenario("name: x\n").long_step, parse_scenario("name: x\n").exit_on_drain) == (None, False)
    args = parse_args(["--checkpoint-dir", "/c", "--step-seconds", "0.05", "--long-step", "13:15", "--exit-on-drain"])
    assert [compute_seconds(args, step) for step in (12, 13, 14)] == [0.05, 15.0, 0.05] and args.exit_on_drain
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint-dir", "/c", "--long-step", "13"])


@pytest.mark.parametrize("text, field", [
    ("long_step: {step: 13}\n", "long_step: expected a mapping with step and seconds"),
    ("long_step: {step: 13, seconds: 0}\n", "long_step.seconds: must be > 0"),
    ("long_step: {step: -1, seconds: 5}\n", "long_step.step"),
    ("long_step: {step: 1.5, seconds: 5}\n", "long_step.step"),
    ("steps: 10\nlong_step: {step: 10, seconds: 5}\n", "long_step.step: 10 is not below steps (10)"),
    ("exit_on_drain: yes please\n", "exit_on_drain: expected true or false"),
    ("framework: hf\nexit_on_drain: true\n", "exit_on_drain: an option of the reference trainer"),
    ("frameworks: [ddp, lightning]\nlong_step: {step: 1, seconds: 5}\n", "not of lightning"),
])
def test_bad_long_steps_and_exit_on_drain_name_the_field(text, field):
    with pytest.raises(ScenarioError, match=re.escape(field)):
        parse_scenario("name: x\n" + text, "s.yaml")
