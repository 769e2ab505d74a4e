"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler started as plain processes from the folder named by `KUBEBUILDER_ASSETS` (the
envtest convention), on free 127.0.0.1 ports, with a temporary data directory.

No kubelet runs: Nodes need `Ready=True` set through their status, pods are bound but never run
(a test writes container statuses through `pods/status`), and bound pods need a grace period of 0
to disappear. Authentication uses static bearer tokens for the admin and the two controllers and
ServiceAccount tokens (TokenRequest) for spotguard's own components, so every component can be
run as the ServiceAccount its manifests give it, under the RBAC those manifests grant.

Every process is started here, ended here by PID, and dies with the test
process if that is killed (parent-death signal).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import yaml

from spotguard.processes import die_with_parent, free_port

ASSETS_ENV = "KUBEBUILDER_ASSETS"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
REPO = Path(__file__).resolve().parents[1]
BASE_MANIFESTS = REPO / "daemonset" / "base"
SPOTGUARD_NAMESPACE = "spotguard"
ADMISSION_POLICIES = BASE_MANIFESTS / "supervisor" / "admission-policy.yaml"
ENABLE_HINT = (f"set {ASSETS_ENV} to a folder with {', '.join(BINARIES)} "
               "(`make test-k8s` unpacks ../shared/tools/kube-control-plane and does it)")


def assets_dir() -> Path | None:
    """The folder named by KUBEBUILDER_ASSETS when it holds every binary, else None."""
    value = os.environ.get(ASSETS_ENV)
    if not value:
        return None
    folder = Path(value)
    return folder if all((folder / b).is_file() for b in BINARIES) else None


@dataclass
class Pki:
    """A CA, the API server's serving certificate and the ServiceAccount signing key, as files."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path

    @classmethod
    def generate(cls, folder: Path) -> Pki:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spotguard-test-ca")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                           "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")]
        ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.0.0.1")]
        serving = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
                   .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.SubjectAlternativeName(names + ips), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

        def pem_key(k) -> bytes:
            return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())

        files = {
            "ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM), "ca.key": pem_key(ca_key),
            "apiserver.crt": serving.public_bytes(serialization.Encoding.PEM), "apiserver.key": pem_key(key),
            "sa.key": pem_key(sa_key),
            "sa.pub": sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo),
        }
        for name, data in files.items():
            (folder / name).write_bytes(data)
            os.chmod(folder / name, 0o600)
        return cls(*(folder / n for n in ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "sa.key", "sa.pub")))


@dataclass
class ControlPlane:
    """A running control plane. `start()` blocks until the API server is ready and the
    controller-manager has created `default/default`; `stop()` ends every process it started."""

    assets: Path
    workdir: Path
    with_controllers: bool = True
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    url: str = ""
    admin_token: str = ""
    pki: Pki | None = None

    def start(self, timeout: float = 120.0) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = Pki.generate(self.workdir)
        self.admin_token = secrets.token_urlsafe(24)
        tokens = {"admin": self.admin_token, "kcm": secrets.token_urlsafe(24), "scheduler": secrets.token_urlsafe(24)}
        (self.workdir / "tokens.csv").write_text(
            f'{tokens["admin"]},admin,admin-uid,"system:masters"\n'
            f'{tokens["kcm"]},system:kube-controller-manager,kcm-uid\n'
            f'{tokens["scheduler"]},system:kube-scheduler,scheduler-uid\n')
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{api_port}"
        try:
            self._spawn("etcd", "--name=test", f"--data-dir={self.workdir / 'etcd'}",
                        f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                        f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                        f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                        f"--initial-cluster=test=http://127.0.0.1:{peer_port}",
                        "--unsafe-no-fsync", "--log-level=warn")
            self._spawn("kube-apiserver", "--advertise-address=127.0.0.1", "--bind-address=127.0.0.1",
                        f"--secure-port={api_port}", f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                        "--endpoint-reconciler-type=none", "--service-cluster-ip-range=10.0.0.0/24",
                        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                        "--allow-privileged=true", f"--client-ca-file={self.pki.ca_cert}",
                        f"--tls-cert-file={self.pki.serving_cert}", f"--tls-private-key-file={self.pki.serving_key}",
                        f"--token-auth-file={self.workdir / 'tokens.csv'}",
                        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                        f"--service-account-key-file={self.pki.sa_pub}",
                        f"--service-account-signing-key-file={self.pki.sa_key}",
                        "--profiling=false", "--v=0")
            self._wait(lambda: self._get("/readyz") == 200, timeout, "kube-apiserver /readyz")
            if self.with_controllers:
                self._spawn("kube-controller-manager", f"--kubeconfig={self._kubeconfig('kcm', tokens['kcm'])}",
                            "--secure-port=0", f"--root-ca-file={self.pki.ca_cert}",
                            f"--service-account-private-key-file={self.pki.sa_key}",
                            "--use-service-account-credentials=true", "--service-cluster-ip-range=10.0.0.0/24",
                            "--node-monitor-grace-period=1h", "--node-startup-grace-period=1h",
                            "--leader-elect=false", "--profiling=false", "--v=0")
                self._spawn("kube-scheduler", f"--kubeconfig={self._kubeconfig('scheduler', tokens['scheduler'])}",
                            "--secure-port=0", "--leader-elect=false", "--profiling=false", "--v=0")
                self._wait(lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default") == 200,
                           timeout, "serviceaccount default/default (kube-controller-manager)")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End every process started here (SIGKILL: the data is thrown away, and kube-apiserver
        and etcd take 15 s and more to shut down gracefully), then remove the data folder."""
        for proc in reversed(list(self.processes.values())):
            if proc.poll() is None:
                proc.kill()
        for proc in self.processes.values():
            proc.wait(timeout=30)
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # clients -------------------------------------------------------------------------------

    def api_client(self, token: str | None = None):
        """An `ApiClient` that verifies the server against the test CA and sends `token`
        (default: the admin's, group system:masters)."""
        import kubernetes

        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.pki.ca_cert)
        cfg.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return kubernetes.client.ApiClient(cfg)

    def service_account_token(self, name: str, namespace: str = SPOTGUARD_NAMESPACE,
                              audiences: list[str] | None = None, bound_pod: dict | None = None,
                              seconds: int = 3600) -> str:
        """A token for ServiceAccount `namespace/name` minted through TokenRequest (optionally
        for other audiences, optionally bound to a pod as a kubelet's projected token is)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.api_client())
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = audiences
        if bound_pod:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": bound_pod["metadata"]["name"],
                                      "uid": bound_pod["metadata"]["uid"]}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        result = core.create_namespaced_service_account_token(name, namespace, body)
        return result.status.token

    def client_as(self, service_account: str, namespace: str = SPOTGUARD_NAMESPACE):
        """An `ApiClient` authenticated as the ServiceAccount (its manifests' RBAC applies)."""
        return self.api_client(self.service_account_token(service_account, namespace))

    # manifests -----------------------------------------------------------------------------

    def apply(self, documents: Iterable[dict], namespace: str | None = None) -> None:
        """Create each object (server-side apply as the admin; idempotent)."""
        import kubernetes

        dynamic = kubernetes.dynamic.DynamicClient(self.api_client())
        for doc in documents:
            if not doc:
                continue
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            ns = None
            if resource.namespaced:
                ns = doc["metadata"].get("namespace") or namespace or "default"
                doc = {**doc, "metadata": {**doc["metadata"], "namespace": ns}}
            resource.server_side_apply(body=doc, name=doc["metadata"]["name"], namespace=ns,
                                       field_manager="spotguard-tests", force_conflicts=True)

    def apply_base_access(self) -> None:
        """The spotguard namespace, every ServiceAccount, (Cluster)Role and binding of
        `daemonset/base`, and its admission policies (what the supervisor may change), as
        `kubectl apply -k daemonset/` would create them; returns once the policies are in force."""
        import kubernetes

        self.apply(load_manifests(BASE_MANIFESTS / "namespace.yaml"))
        docs = [d for f in sorted(BASE_MANIFESTS.glob("*/rbac.yaml")) for d in load_manifests(f)]
        self.apply(docs, namespace=SPOTGUARD_NAMESPACE)
        policies = load_manifests(ADMISSION_POLICIES)
        self.apply(policies)
        admission = kubernetes.client.AdmissionregistrationV1Api(self.api_client())
        for doc in policies:
            if doc["kind"] == "ValidatingAdmissionPolicy":
                self._wait(lambda: admission.read_validating_admission_policy(doc["metadata"]["name"]).status,
                           30, f"policy {doc['metadata']['name']} type-checked")

    # internals -----------------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            self.processes[name] = subprocess.Popen([str(self.assets / name), *args], stdout=log,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    preexec_fn=die_with_parent(signal.SIGKILL), cwd=self.workdir)
        finally:
            log.close()

    def _kubeconfig(self, user: str, token: str) -> Path:
        path = self.workdir / f"{user}.kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.pki.ca_cert)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test"}))
        return path

    def kubeconfig(self, service_account: str | None = None, namespace: str = SPOTGUARD_NAMESPACE) -> Path:
        """A kubeconfig file for CLIs under test that take `--kubeconfig`: the admin's, or with
        `service_account` one that authenticates as that ServiceAccount (TokenRequest, 1 h)."""
        if service_account is None:
            return self._kubeconfig("admin", self.admin_token)
        return self._kubeconfig(
            f"{namespace}-{service_account}", self.service_account_token(service_account, namespace))

    def _get(self, path: str) -> int:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (OSError, ValueError):
            return 0

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       + self.log_tail(name))
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)


def load_manifests(path: Path) -> list[dict]:
    """The YAML documents of one manifest file, empty ones dropped."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def start_control_plane(with_controllers: bool = True) -> ControlPlane:
    """A started control plane in a fresh temporary folder (ended by `stop()`)."""
    assets = assets_dir()
    if assets is None:
        raise RuntimeError(ENABLE_HINT)
    workdir = Path(tempfile.mkdtemp(prefix="spotguard-k8s-"))
    return ControlPlane(assets=assets, workdir=workdir, with_controllers=with_controllers).start()
