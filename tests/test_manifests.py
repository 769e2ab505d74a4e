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
        validate(doc, "1.31.0")  # the torchrun example's successPolicy: on by default from 1.31


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


README = Path(__file__).resolve().parents[1] / "README.md"
PUBLISHED_NAME = "ghcr.io/spotguard/spotguard"


def install_blocks() -> list[str]:
    """The code blocks of the README's "Install on a cluster" section, in order, without their
    fence's language tag (```bash)."""
    section = README.read_text(encoding="utf-8").split("\n## Install on a cluster\n", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1] for block in section.split("```")[1::2]]


def readme_overlay() -> str:
    """The kustomization the README's install writes (`my-spotguard/kustomization.yaml`)."""
    [block] = [b for b in install_blocks() if "my-spotguard/kustomization.yaml" in b]
    return block.split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0] + "\n"


def images_of(docs: list[dict]) -> dict[str, str]:
    """`<kind>/<name>/<container>` -> image, for every container and init container, plus
    `.../SPOTGUARD_SIDECAR_IMAGE` -> the image the injector injects."""
    found = {}
    for doc in docs:
        spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            found[where] = container["image"]
            for env in container.get("env", []):
                if env["name"] == "SPOTGUARD_SIDECAR_IMAGE":
                    found[f"{where}/SPOTGUARD_SIDECAR_IMAGE"] = env["value"]
    return found


def test_every_image_is_the_one_the_base_names_the_sidecar_too():
    images = images_of(render(ROOT))
    assert "Deployment/spotguard-injector/injector/SPOTGUARD_SIDECAR_IMAGE" in images
    assert len(images) == 5 and set(images.values()) == {f"{PUBLISHED_NAME}:0.1.0"}, images


@pytest.mark.parametrize("target", ["daemonset", "daemonset/overlays/aws", "daemonset/overlays/cert-manager"])
def test_the_readmes_images_override_reaches_every_container_and_the_sidecar(tmp_path, target):
    shutil.copytree(ROOT, tmp_path / "daemonset")
    overlay = tmp_path / "my-spotguard"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(readme_overlay().replace("../daemonset ", f"../{target} ", 1))
    images = images_of(render(overlay))
    # the sidecar image used to stay ghcr.io/spotguard/spotguard:0.1.0 (unpublished) under an override
    assert len(images) >= 4 and set(images.values()) == {"registry.example.com/ml/spotguard:0.1.0"}, images


def test_examples_name_no_namespace_and_the_training_image():
    """So `kubectl apply -n NS -f` puts them where the user says (a namespace in the file wins or fails)."""
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert [d["metadata"]["name"] for d in docs if "namespace" in d["metadata"]] == [], path.name
        assert "ghcr.io/spotguard/spotguard-train:0.1.0" in path.read_text()
