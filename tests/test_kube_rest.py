"""`spotguard.kube.rest`, the plain-HTTPS reader behind `spotguard status`, without a server:
how it reads kubeconfigs (paths relative to the file, inline data, each kind of user), the
errors that name `--kubeconfig` and the cause, what it hands to the official client instead,
the pod's own credentials, and answers it must not take (a plain HTTP server on a real socket
answering non-JSON, 500 and 404)."""
from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from spotguard.config import ConfigError
from spotguard.kube import rest
from spotguard.kube.api import JOBS, PODS, ApiError, Kube, MalformedResponse, NotFound
from spotguard.supervisor import status_cli


def kubeconfig(folder: Path, cluster: dict, user: dict, name: str = "config") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}},
                     {"name": "other", "context": {"cluster": "missing", "user": "u"}}]}))
    return path


def test_paths_are_read_from_the_kubeconfig_folder_and_data_is_inline(tmp_path):
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "token").write_text("from-file\n")
    path = kubeconfig(tmp_path, {"server": "https://k:6443/", "certificate-authority": "ca.pem",
                                 "tls-server-name": "api.internal"}, {"tokenFile": "token"})
    endpoint = rest.from_kubeconfig(str(path))
    assert endpoint == rest.Endpoint(server="https://k:6443", ca_pem=b"CA", tls_server_name="api.internal",
                                     token="from-file")
    inline = kubeconfig(tmp_path, {"server": "https://k", "certificate-authority-data": base64.b64encode(b"CA2")
                                   .decode()}, {"client-certificate-data": base64.b64encode(b"C").decode(),
                                                "client-key-data": base64.b64encode(b"K").decode()}, "inline")
    endpoint = rest.from_kubeconfig(str(inline))
    assert (endpoint.ca_pem, endpoint.cert_pem, endpoint.key_pem, endpoint.token) == (b"CA2", b"C", b"K", None)
    basic = kubeconfig(tmp_path, {"server": "https://k", "insecure-skip-tls-verify": True},
                       {"username": "ann", "password": "pw"}, "basic")
    endpoint = rest.from_kubeconfig(str(basic))
    assert endpoint.insecure and endpoint.basic == ("ann", "pw")


@pytest.mark.parametrize(("cluster", "user", "context", "expected"), [
    ({"server": "https://k"}, {}, "other", "no cluster named 'missing'"),
    ({"server": "https://k"}, {}, "nope", "no context named 'nope'"),
    ({"server": "k:6443"}, {}, None, "has no https:// server"),
    ({"server": "https://k", "certificate-authority-data": "%%%"}, {}, None, "certificate-authority-data"),
    ({"server": "https://k", "certificate-authority": "gone.pem"}, {}, None, "gone.pem: cannot be read"),
    ({"server": "https://k"}, {"client-certificate-data": "Qw=="}, None, "needs both"),
    ({"server": "https://k"}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1"}}, None,
     "exec has no command"),
])
def test_a_broken_kubeconfig_names_the_flag_and_the_cause(tmp_path, cluster, user, context, expected):
    path = kubeconfig(tmp_path, cluster, user)
    with pytest.raises(ConfigError, match=expected) as err:
        rest.from_kubeconfig(str(path), context)
    assert err.value.field == "--kubeconfig"


def test_not_a_kubeconfig(tmp_path):
    (tmp_path / "bad").write_text("clusters: [unclosed\n")
    with pytest.raises(ConfigError, match="not YAML"):
        rest.from_kubeconfig(str(tmp_path / "bad"))
    (tmp_path / "list").write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a map"):
        rest.from_kubeconfig(str(tmp_path / "list"))
    with pytest.raises(ConfigError, match="cannot be read"):
        rest.from_kubeconfig(str(tmp_path / "absent"))


def plugin(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "plugin.py"
    script.write_text(body)
    return [sys.executable, str(script)]


def test_an_exec_plugin_gets_the_exec_info_and_its_env_and_gives_a_token(tmp_path):
    seen = tmp_path / "seen.json"
    argv = plugin(tmp_path, f"""import json, os
open({str(seen)!r}, "w").write(json.dumps({{"info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]),
                                            "region": os.environ.get("REGION")}}))
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": "t0ken"}}}}))
""")
    path = kubeconfig(tmp_path, {"server": "https://k", "certificate-authority-data": base64.b64encode(b"CA").decode()},
                      {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": argv[0],
                                "args": argv[1:], "env": [{"name": "REGION", "value": "eu"}],
                                "provideClusterInfo": True}})
    assert rest.from_kubeconfig(str(path)).token == "t0ken"
    got = json.loads(seen.read_text())
    assert got["region"] == "eu"
    assert got["info"]["spec"]["interactive"] is False
    assert got["info"]["spec"]["cluster"]["server"] == "https://k"


@pytest.mark.parametrize(("body", "expected"), [
    ("import sys; print('expired', file=sys.stderr); sys.exit(3)", "exited 3: expired"),
    ("print('not json')", "no ExecCredential status"),
    ("import json; print(json.dumps({'status': {}}))", "neither a token nor a client certificate"),
])
def test_a_failing_exec_plugin_stops_with_its_reason(tmp_path, body, expected):
    argv = plugin(tmp_path, body)
    path = kubeconfig(tmp_path, {"server": "https://k"}, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": argv[0], "args": argv[1:]}})
    with pytest.raises(ConfigError, match=expected):
        rest.from_kubeconfig(str(path))


@pytest.mark.parametrize("user_or_cluster", [
    {"user": {"auth-provider": {"name": "oidc", "config": {}}}},
    {"cluster": {"proxy-url": "http://proxy:3128"}},
    {"user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}}},
])
def test_what_it_does_not_do_is_handed_to_the_official_client(tmp_path, user_or_cluster):
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443", **user_or_cluster.get("cluster", {})},
                      user_or_cluster.get("user", {"token": "t"}))
    with pytest.raises(rest.Unsupported):
        rest.from_kubeconfig(str(path))
    if "proxy-url" in str(user_or_cluster):  # the official client takes this one as it is
        args = argparse.Namespace(kube_host=None, kubeconfig=str(path), context=None, request_timeout=5.0)
        assert isinstance(status_cli.reader(args), Kube)


def test_in_cluster_reads_the_service_account_folder(tmp_path):
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_bytes(b"CA")
    endpoint = rest.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert endpoint == rest.Endpoint(server="https://[fd00::1]:443", ca_pem=b"CA", token="sa-token")
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        rest.in_cluster({}, tmp_path)


class Answers(BaseHTTPRequestHandler):
    """Answers by path: what the reader must turn into errors, never into rows."""

    def do_GET(self):
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        status, body = {"/api/v1/pods": (200, b"<html>proxy login</html>"),
                        "/api/v1/namespaces/a/pods": (500, b'{"message": "etcd timeout"}'),
                        "/apis/batch/v1/namespaces/a/jobs": (200, b'{"items": {"not": "a list"}}'),
                        }.get(self.path.split("?")[0], (404, b'{"reason": "NotFound"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_bad_answers_are_errors_and_the_query_is_sent(answers):
    reader = rest.RestReader(rest.Endpoint(server=f"http://127.0.0.1:{answers.server_address[1]}"), 5.0)
    try:
        with pytest.raises(MalformedResponse):
            reader.list(PODS)
        with pytest.raises(ApiError, match="etcd timeout") as err:
            reader.list(PODS, "a", label_selector={"x": "1"}, field_selector="spec.nodeName=n")
        assert err.value.status == 500
        with pytest.raises(MalformedResponse, match="no items array"):
            reader.list(JOBS, "a")
        with pytest.raises(NotFound):
            reader.get(JOBS, "a", "j")
    finally:
        reader.close()
    assert "/api/v1/namespaces/a/pods?labelSelector=x%3D1&fieldSelector=spec.nodeName%3Dn" in answers.paths
    gone = rest.RestReader(rest.Endpoint(server="http://127.0.0.1:1"), 2.0)
    with pytest.raises(ApiError) as err:
        gone.list(PODS)
    assert err.value.status == 0
