"""`spotguard status` and `kubectl spotguard status` against a real kube-apiserver: managed jobs
listed from what the supervisor wrote (the decision record, steps lost, its Events), unmanaged
ones left out, `-o json`, one job in detail with its Events, a missing job (exit 3), and a
caller with only Kubernetes' built-in `view` role in the namespace."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kubernetes
import pytest

from spotguard.wire import names
from tests.k8s_world import wait_service_account, wait_until

pytestmark = pytest.mark.k8s
VENV_BIN = Path(sys.executable).parent
RECORD = {"v": 1, "phase": "Suspended", "event": "SpotguardSuspended", "reason": "BelowMin",
          "message": "below min", "decided_at": "2026-11-25T21:55:00Z", "reclaims_survived": 2,
          "cost": {"spot_hours": 3.0, "on_demand_hours": 1.0, "cost": 6.0, "on_demand_equivalent": 12.0}}


def managed_job(name: str, annotations: dict, managed: bool = True) -> dict:
    labels = {names.LABEL_MANAGED: "true"} if managed else {}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed", "suspend": True,
                     "template": {"spec": {"restartPolicy": "Never",
                                           "containers": [{"name": "train", "image": "train:1"}]}}}}


def status(*args: str, program: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([*(program or [sys.executable, "-m", "spotguard"]), "status", *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def jobs(control_plane, k8s_namespace):
    ns = k8s_namespace
    batch = kubernetes.client.BatchV1Api(control_plane.api_client())
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    batch.create_namespaced_job(ns, managed_job("llm", {
        names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1", names.ANN_STATUS: json.dumps(RECORD),
        names.ANN_STEPS_LOST: "5"}))
    batch.create_namespaced_job(ns, managed_job("fresh", {}))
    batch.create_namespaced_job(ns, managed_job("unmanaged", {}, managed=False))
    job = batch.read_namespaced_job("llm", ns)
    core.create_namespaced_event(ns, {
        "metadata": {"name": "llm.k1"}, "type": "Warning", "reason": "SpotguardSuspended",
        "message": "notice r1 on n2: only 0 replicas on unaffected nodes", "source": {"component": names.COMPONENT},
        "lastTimestamp": "2026-11-25T21:55:00Z", "firstTimestamp": "2026-11-25T21:55:00Z", "count": 1,
        "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "name": "llm", "namespace": ns,
                           "uid": job.metadata.uid}})
    return ns


def test_status_lists_the_managed_jobs_and_shows_one_with_its_events(control_plane, jobs):
    ns, kubeconfig = jobs, str(control_plane.kubeconfig())
    result = status("-n", ns, "--kubeconfig", kubeconfig)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAMESPACE", "KIND", "NAME"] and len(lines) == 3
    llm = next(line.split() for line in lines if " llm " in line)
    assert llm[3:10] == ["elastic", "Suspended", "0/1/2", "0/0", "2", "5", "4.00"] and llm[10] == "50%"
    assert llm[11] == "Suspended"

    as_json = status("-n", ns, "--kubeconfig", kubeconfig, "-o", "json")
    items = {i["name"]: i for i in json.loads(as_json.stdout)["items"]}
    assert set(items) == {"llm", "fresh"} and items["llm"]["steps_lost"] == 5
    assert (items["fresh"]["phase"], items["fresh"]["replicas"]) == ("Suspended", 0)  # suspended by its owner

    everywhere = status("--kubeconfig", kubeconfig, "-o", "json")  # all namespaces: ours are among them
    assert {(i["namespace"], i["name"]) for i in json.loads(everywhere.stdout)["items"]} >= {(ns, "llm"), (ns, "fresh")}

    one = status("llm", "-n", ns, "--kubeconfig", kubeconfig)
    assert one.returncode == 0, one.stderr
    assert re.search(r"^Phase:\s+Suspended$", one.stdout, re.M)
    assert re.search(r"^Reclaims survived:\s+2$", one.stdout, re.M)
    events = one.stdout.split("Events:\n")[1]
    assert "SpotguardSuspended" in events and "only 0 replicas on unaffected nodes" in events

    missing = status("nope", "-n", ns, "--kubeconfig", kubeconfig)
    assert missing.returncode == 3 and "no managed job named 'nope'" in missing.stderr


def test_as_a_kubectl_plugin_and_with_the_view_role(control_plane, jobs):
    ns = jobs
    rbac = kubernetes.client.RbacAuthorizationV1Api(control_plane.api_client())
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    core.create_namespaced_service_account(ns, {"metadata": {"name": "reader"}})
    wait_service_account(control_plane, ns, "reader")
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "reader-view"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                        "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]})
    reader = str(control_plane.kubeconfig("reader", namespace=ns))
    deadline = time.monotonic() + 30
    while True:  # the binding reaches the authorizer's cache
        result = status("-n", ns, "--kubeconfig", reader, "-o", "json")
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert result.returncode == 0, result.stderr
    assert {i["name"] for i in json.loads(result.stdout)["items"]} == {"llm", "fresh"}
    denied = status("--kubeconfig", reader)  # all namespaces: not granted
    assert denied.returncode == 1 and "403" in denied.stderr

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the plugin's own entry point was run above")
    plugin = status("llm", "-n", ns, "--kubeconfig", reader, program=[kubectl, "spotguard"])
    assert plugin.returncode == 0, plugin.stderr
    assert "Events:" in plugin.stdout and "SpotguardSuspended" in plugin.stdout
    direct = status("-n", ns, "--kubeconfig", reader, program=[str(VENV_BIN / "kubectl-spotguard")])
    assert direct.returncode == 0 and " llm " in direct.stdout
    everywhere = status("-A", "--kubeconfig", str(control_plane.kubeconfig()), "-o", "json",
                        program=[kubectl, "spotguard"])  # as kubectl users type it
    assert everywhere.returncode == 0, everywhere.stderr
    assert {(i["namespace"], i["name"]) for i in json.loads(everywhere.stdout)["items"]} >= {(ns, "llm"), (ns, "fresh")}


def test_without_a_supervisor_pending_pods_are_starting_and_an_invalid_policy_says_why(control_plane, k8s_namespace):
    """No supervisor runs: a managed Job whose 2 pods stay Pending (no node matches) is `Starting`
    with 0 replicas and no spot/on-demand count (nothing placed, nothing decided); a Job whose
    policy does not parse is `invalid` in the table, and stderr says why."""
    ns = k8s_namespace
    batch = kubernetes.client.BatchV1Api(control_plane.api_client())
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    pending = managed_job("pending", {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"})
    pending["spec"]["suspend"] = False
    pending["spec"]["template"]["spec"]["nodeSelector"] = {"spotguard-test/no-such-pool": ns}
    batch.create_namespaced_job(ns, pending)
    batch.create_namespaced_job(ns, managed_job("bad-annot", {names.ANN_POLICY: "elastic",
                                                             names.ANN_MIN_REPLICAS: "two"}))

    def both_pods_pending():
        pods = core.list_namespaced_pod(ns, label_selector="job-name=pending").items
        job = batch.read_namespaced_job("pending", ns)
        return len(pods) == 2 and all(p.status.phase == "Pending" for p in pods) and job.status.active == 2
    wait_until(both_pods_pending, 30, "the Job's 2 pods, Pending")
    result = status("-n", ns, "--kubeconfig", str(control_plane.kubeconfig()))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[2]: line.split() for line in result.stdout.splitlines()[1:]}
    assert rows["pending"][3:7] == ["elastic", "Starting", "0/1/2", "-"], rows["pending"]
    assert rows["bad-annot"][3] == "invalid"
    assert (f"spotguard status: warning: Job {ns}/bad-annot: invalid policy annotation spotguard.io/min-replicas: "
            "expected a whole number >= 1, got 'two'") in result.stderr.splitlines()


def client_certificate(plane, folder: Path, user: str, group: str) -> tuple[Path, Path]:
    """A client certificate for `user` in `group`, signed by the test CA (the API server's client CA)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert = x509.load_pem_x509_certificate(plane.pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(plane.pki.ca_key.read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, user),
                                     x509.NameAttribute(NameOID.ORGANIZATION_NAME, group)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = folder / "client.crt", folder / "client.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_the_plain_reader_authenticates_as_kubectl_does(control_plane, jobs, tmp_path):
    """Client certificates, an exec plugin, a token file and `tls-server-name`, each against the real
    server; a wrong token and a wrong server name are refused with the server and the reason."""
    ns = jobs
    shutil.copy(control_plane.pki.ca_cert, tmp_path / "ca.crt")
    client_certificate(control_plane, tmp_path, "cert-admin", "system:masters")
    (tmp_path / "token").write_text(control_plane.admin_token)
    (tmp_path / "plugin.py").write_text(
        "import json, os\nassert json.loads(os.environ['KUBERNETES_EXEC_INFO'])['kind'] == 'ExecCredential'\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        f" 'status': {{'token': {control_plane.admin_token!r}}}}}))\n")
    users = {
        "cert": {"client-certificate": "client.crt", "client-key": "client.key"},
        "exec": {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                          "args": [str(tmp_path / "plugin.py")], "interactiveMode": "Never"}},
        "token-file": {"tokenFile": "token"},
        "wrong-token": {"token": "not-a-token"},
    }
    clusters = {"right": {"server": control_plane.url, "certificate-authority": "ca.crt",
                          "tls-server-name": "kubernetes.default"},
                "wrong-name": {"server": control_plane.url, "certificate-authority": "ca.crt",
                               "tls-server-name": "elsewhere.example"}}
    contexts = [{"name": user, "context": {"cluster": "right", "user": user}} for user in users]
    contexts.append({"name": "wrong-name", "context": {"cluster": "wrong-name", "user": "token-file"}})
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({  # JSON is YAML: kubectl reads it too
        "apiVersion": "v1", "kind": "Config", "current-context": "cert",
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()], "contexts": contexts}))

    for context in ("cert", "exec", "token-file"):
        result = status("-n", ns, "--kubeconfig", str(config), "--context", context, "-o", "json")
        assert result.returncode == 0, (context, result.stderr)
        assert {i["name"] for i in json.loads(result.stdout)["items"]} == {"llm", "fresh"}, context
    refused = status("-n", ns, "--kubeconfig", str(config), "--context", "wrong-token")
    assert refused.returncode == 1 and "401" in refused.stderr and control_plane.url in refused.stderr
    mismatch = status("-n", ns, "--kubeconfig", str(config), "--context", "wrong-name")
    assert mismatch.returncode == 1 and "cannot reach it" in mismatch.stderr
    assert "elsewhere.example" in mismatch.stderr or "CERTIFICATE_VERIFY_FAILED" in mismatch.stderr
