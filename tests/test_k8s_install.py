"""The README's "Install on a cluster", run with kubectl against a real kube-apiserver of its own
(etcd + kube-apiserver only, nothing applied: a cluster spotguard was never installed on).

- The README's commands, in its order, from a copy of `daemonset/`: the kustomization of one's own
  (`my-spotguard/`, the images pointed at another registry), the namespace, the server-side dry
  run, the install; the objects exist with that registry's image, the sidecar's included. The
  dry run before the namespace fails as the README says it would. Then its upgrade to another
  tag (the certgen Job deleted first: a plain apply fails on it, as the README says).
- Every kustomization to build on dry-runs on the server; the cert-manager overlay only once
  cert-manager's CRDs are there (before: the error the README quotes).
- Every example applies (dry run) into a namespace given with `-n` (the PyTorchJob ones once
  the Kubeflow CRD is there).
The image builds (`docker build`) do not run here: there is no container engine
(tests/test_images.py builds the wheel each Dockerfile builds).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes
import pytest

from tests.control_plane import REPO, start_control_plane
from tests.k8s_world import PYTORCHJOB_CRD, wait_until
from tests.test_manifests import install_blocks

pytestmark = pytest.mark.k8s
REGISTRY_IMAGE = "registry.example.com/ml/spotguard:0.1.0"
NO_NAMESPACE = 'namespaces "spotguard" not found'
NO_CERT_MANAGER = 'no matches for kind "Issuer" in version "cert-manager.io/v1"'


def crd(group: str, kind: str, plural: str) -> dict:
    """A CustomResourceDefinition of `kind` that keeps any spec (cert-manager's own cannot be fetched here)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {
                             "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                             "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}


@pytest.fixture
def bare_plane():
    """An API server nothing was installed on (no controllers: nothing here needs them); one per
    test, so that none sees what another installed."""
    plane = start_control_plane(with_controllers=False)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def clone(tmp_path, bare_plane) -> tuple[Path, dict[str, str]]:
    """(a folder holding a copy of daemonset/, the environment that points kubectl at the plane)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (it ships on these machines; tests/test_manifests.py renders with it)"
    shutil.copytree(REPO / "daemonset", tmp_path / "daemonset")
    env = {**os.environ, "KUBECONFIG": str(bare_plane.kubeconfig()), "HOME": str(tmp_path),
           "KUBECACHEDIR": str(tmp_path / "kube-cache")}
    return tmp_path, env


def sh(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def commands(block: str) -> list[str]:
    """A block's commands, one per line, comments dropped."""
    return [line.split("  #", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def test_the_readme_install_on_a_cluster_it_was_never_installed_on(bare_plane, clone):
    folder, env = clone
    build, overlay, install, upgrade, *_ = install_blocks()
    assert all(c.startswith("docker ") for c in commands(build))  # no container engine here: not run
    made = sh(overlay, folder, env)
    assert made.returncode == 0, made.stderr
    steps = commands(install)
    assert steps == ["kubectl apply -f daemonset/base/namespace.yaml",
                     "kubectl apply -k my-spotguard/ --dry-run=server", "kubectl apply -k my-spotguard/"]

    early = sh(steps[1], folder, env)  # the dry run before the namespace: why the README puts it first
    assert early.returncode != 0 and NO_NAMESPACE in early.stderr
    for step in steps:
        done = sh(step, folder, env)
        assert done.returncode == 0, f"{step}: {done.stderr}"
    assert "(server dry run)" in sh(steps[1], folder, env).stdout

    api = bare_plane.api_client()
    apps = kubernetes.client.AppsV1Api(api)
    agent = apps.read_namespaced_daemon_set("spotguard-agent", "spotguard")
    assert agent.spec.template.spec.containers[0].image == REGISTRY_IMAGE
    [injector] = apps.read_namespaced_deployment("spotguard-injector", "spotguard").spec.template.spec.containers
    assert injector.image == REGISTRY_IMAGE
    assert {e.name: e.value for e in injector.env}["SPOTGUARD_SIDECAR_IMAGE"] == REGISTRY_IMAGE
    webhook = kubernetes.client.AdmissionregistrationV1Api(api).read_mutating_webhook_configuration(
        "spotguard-injector")
    assert webhook.webhooks[0].failure_policy == "Ignore"

    # An upgrade: another tag. The certgen Job of the install is still there (no controller here
    # runs its TTL), so a plain apply fails on it, as the README says; its upgrade steps pass.
    kustomization = folder / "my-spotguard" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace('newTag: "0.1.0"', 'newTag: "0.2.0"'))
    refused = sh(steps[2], folder, env)
    assert refused.returncode != 0 and "field is immutable" in refused.stderr
    assert commands(upgrade) == ["kubectl -n spotguard delete job spotguard-injector-certgen --ignore-not-found",
                                 "kubectl apply -k my-spotguard/"]
    for step in commands(upgrade):
        done = sh(step, folder, env)
        assert done.returncode == 0, f"{step}: {done.stderr}"
    agent = apps.read_namespaced_daemon_set("spotguard-agent", "spotguard")
    assert agent.spec.template.spec.containers[0].image == "registry.example.com/ml/spotguard:0.2.0"


def test_every_kustomization_dry_runs_cert_manager_once_its_crds_are_there(bare_plane, clone):
    folder, env = clone
    assert sh("kubectl apply -f daemonset/base/namespace.yaml", folder, env).returncode == 0
    for target in ("daemonset", "daemonset/overlays/aws", "daemonset/overlays/gcp", "daemonset/overlays/azure",
                   "daemonset/overlays/alibaba"):
        done = sh(f"kubectl apply -k {target} --dry-run=server", folder, env)
        assert done.returncode == 0, f"{target}: {done.stderr}"

    cert_manager = "kubectl apply -k daemonset/overlays/cert-manager --dry-run=server"
    before = sh(cert_manager, folder, env)
    assert before.returncode != 0 and NO_CERT_MANAGER in before.stderr
    assert NO_CERT_MANAGER in (REPO / "README.md").read_text()  # the README quotes what the user sees
    bare_plane.apply([crd("cert-manager.io", "Issuer", "issuers"), crd("cert-manager.io", "Certificate",
                                                                        "certificates")])
    after = wait_until(lambda: (lambda r: r if r.returncode == 0 else None)(sh(cert_manager, folder, env)), 30,
                       "the cert-manager overlay accepted once the CRDs are served")
    assert "certificate.cert-manager.io/spotguard-injector created (server dry run)" in after.stdout


def test_every_example_applies_into_the_namespace_given(bare_plane, clone):
    folder, env = clone
    namespace = "team-ml"
    kubernetes.client.CoreV1Api(bare_plane.api_client()).create_namespace({"metadata": {"name": namespace}})
    bare_plane.apply([PYTORCHJOB_CRD])
    examples = sorted((folder / "daemonset" / "examples").glob("*.yaml"))
    assert len(examples) == 5
    for path in examples:
        command = f"kubectl apply -n {namespace} -f daemonset/examples/{path.name} --dry-run=server"
        done = wait_until(lambda: (lambda r: r if r.returncode == 0 else None)(sh(command, folder, env)), 30,
                          f"{path.name} accepted in {namespace}")
        assert "(server dry run)" in done.stdout, done.stdout
