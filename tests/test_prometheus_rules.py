"""The alerts in daemonset/monitoring/prometheus-rule.yaml: `promtool check rules` accepts them,
`promtool test rules` (tests/promtool/alerts_test.yaml) fires each one when it should and not
before, and every metric and label they read is one the agent or the supervisor exports.

promtool comes from Debian's `prometheus` package, unpacked by `make promtool` into .cache (no
root). Without it the promtool tests skip, saying so; CI (.ci/run) runs `make promtool` and sets
SPOTGUARD_REQUIRE_PROMTOOL=1, so there they fail instead.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from spotguard.agent.metrics import AgentMetrics
from spotguard.supervisor.metrics import SupervisorMetrics

REPO = Path(__file__).resolve().parents[1]
RULE_FILE = REPO / "daemonset" / "monitoring" / "prometheus-rule.yaml"
UNIT_TESTS = REPO / "tests" / "promtool" / "alerts_test.yaml"
SCRAPE_LABELS = {"job", "instance", "pod", "namespace"}  # added by Prometheus / the ServiceMonitor


def promtool() -> str:
    found = os.environ.get("SPOTGUARD_PROMTOOL") or shutil.which("promtool")
    local = REPO / ".cache" / "prometheus" / "usr" / "bin" / "promtool"
    if not found and local.exists():
        found = str(local)
    if not found:
        if os.environ.get("SPOTGUARD_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required here (SPOTGUARD_REQUIRE_PROMTOOL=1): run `make promtool`")
        pytest.skip("promtool not found: `make promtool` unpacks Debian's prometheus package into .cache")
    return found


def rule_groups() -> list[dict]:
    doc = yaml.safe_load(RULE_FILE.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return doc["spec"]["groups"]


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    """The CRD's groups as a plain rule file (what promtool reads), beside the unit tests."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    return tmp_path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules(rules_dir: Path):
    result = run_promtool("check", "rules", "rules.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in result.stdout


def test_promtool_unit_tests_pass(rules_dir: Path):
    result = run_promtool("test", "rules", UNIT_TESTS.name, cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_can_fail(rules_dir: Path):
    """Guards the unit tests: a rule that waits longer than they expect makes them fail."""
    groups = rule_groups()
    for group in groups:
        for rule in group["rules"]:
            if rule["alert"] == "SpotguardJobSuspendedTooLong":
                rule["for"] = "45m"
    (rules_dir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    result = run_promtool("test", "rules", UNIT_TESTS.name, cwd=rules_dir)
    assert result.returncode != 0 and "SpotguardJobSuspendedTooLong" in result.stdout + result.stderr


def test_every_alert_is_unit_tested():
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert alerts == tested
    assert {"SpotguardJobSuspendedTooLong", "SpotguardStepsLost", "SpotguardFallbackActiveTooLong",
            "SpotguardAgentNotReady"} <= alerts


def test_rules_read_only_exported_metrics_and_labels():
    exported = {**SupervisorMetrics().registry.families(), **AgentMetrics().registry.families()}
    services = {d["metadata"]["name"] for path in (REPO / "daemonset" / "base").rglob("*service*.yaml")
                for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "Service"}
    for group in rule_groups():
        for rule in group["rules"]:
            expr = rule["expr"]
            used = set(re.findall(r"\bspotguard_[a-z_]+\b", expr))
            if not used:  # Prometheus' own `up` of a scrape job: the Service the ServiceMonitor finds
                scrape_job = re.fullmatch(r'up\{job="([a-z-]+)"\} == 0', expr)
                assert scrape_job and scrape_job.group(1) in services, rule["alert"]
                continue
            assert used <= set(exported), f"{rule['alert']}: not exported: {used - set(exported)}"
            labels = set().union(*(exported[name] for name in used)) | SCRAPE_LABELS
            for grouping in re.findall(r"by \(([^)]*)\)", expr):
                named = {label.strip() for label in grouping.split(",")}
                assert named <= labels, f"{rule['alert']}: {named - labels} is on none of {used}"
