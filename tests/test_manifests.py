"""Every manifest renders with `kubectl kustomize` and validates strictly against 1.30+ schemas."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1] / "daemonset"
TARGETS = [ROOT, *sorted(p for p in (ROOT / "overlays").iterdir() if p.is_dir())]
VERSIONS = ["1.30.0", "1.36.0"]  # 1.30: ValidatingAdmissionPolicy v1 (GA)
# Custom resources: no upstream schema to validate against; checked for shape only.
CUSTOM_KINDS = {"Certificate", "Issuer", "ServiceMonitor", "PrometheusRule", "PyTorchJob"}


def render(target: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomizations (it ships on these machines)"
    out = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(doc: dict, version: str) -> None:
    if doc["kind"] in CUSTOM_KINDS:
        assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), doc
        return
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name if p != ROOT else "base")
@pytest.mark.parametrize("version", VERSIONS)
def test_kustomizations_render_and_validate(target: Path, version: str):
    docs = render(target)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "ClusterRole", "MutatingWebhookConfiguration", "Namespace"} <= kinds
    for doc in docs:
        validate(doc, version)


@pytest.mark.parametrize(
    "path",
    [*sorted((ROOT / "examples").glob("*.yaml")), *sorted((ROOT / "monitoring").glob("*.yaml"))],
    ids=lambda p: p.name,
)
def test_examples_validate(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate(doc, "1.29.0")


def test_a_schema_violation_is_caught():
    """Guards the test itself: strict validation must reject an unknown field."""
    ds = next(d for d in render(ROOT) if d["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, "1.29.0", strict=True)


def test_cloud_overlays_pin_their_cloud():
    for cloud in ("aws", "gcp", "azure", "alibaba"):
        ds = next(d for d in render(ROOT / "overlays" / cloud) if d["kind"] == "DaemonSet")
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--cloud={cloud}" in args


def test_agent_runs_locked_down():
    ds = next(d for d in render(ROOT) if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    sc = container["securityContext"]
    assert pod["hostNetwork"] is True and pod["priorityClassName"] == "system-node-critical"
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"]
    assert sc["allowPrivilegeEscalation"] is False
    assert {e["name"] for e in container["env"]} >= {"NODE_NAME", "NODE_IP", "NVIDIA_VISIBLE_DEVICES"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_webhook_never_blocks_scheduling():
    hook = next(d for d in render(ROOT) if d["kind"] == "MutatingWebhookConfiguration")
    (webhook,) = hook["webhooks"]
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["objectSelector"]["matchLabels"] == {"spotguard.io/inject": "true"}


def test_no_component_may_touch_secrets_or_delete_pods():
    for doc in render(ROOT):
        if doc["kind"] not in ("ClusterRole", "Role") or doc["metadata"]["name"] == "spotguard-certgen":
            continue
        for rule in doc["rules"]:
            assert "secrets" not in rule["resources"], doc["metadata"]["name"]
            assert not ("pods" in rule["resources"] and "delete" in rule["verbs"]), doc["metadata"]["name"]
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
