"""A read-only Kubernetes client for commands a person runs (`spotguard status`): plain HTTPS GETs
with the credentials of a kubeconfig or of the pod, without the official `kubernetes` package,
whose import alone costs about 0.7 s of CPU before the first request.

Contract:
- `RestReader.list` / `get` answer as `Kube.list` / `Kube.get` do (dicts, `(items, resourceVersion)`)
  and raise the same `ApiError` / `NotFound` / `MalformedResponse` (status 0: no answer);
- `from_kubeconfig(path, context)` understands what kubectl's common configurations use: a
  server with `certificate-authority(-data)`, `insecure-skip-tls-verify` or `tls-server-name`;
  a user with `token`, `tokenFile`, `client-certificate(-data)` + `client-key(-data)`,
  `username` + `password`, or an `exec` credential plugin (client.authentication.k8s.io v1 and
  v1beta1: the EKS, GKE and AKS plugins). Relative file names are read from the kubeconfig's
  folder, as kubectl does. A configuration it does not understand (a legacy `auth-provider`, a
  `proxy-url`) raises `Unsupported`: the caller then uses the official client, which does;
- `in_cluster(environ)`: the pod's ServiceAccount token and CA;
- a broken kubeconfig (unreadable, not YAML, a context, cluster or user that is not there, an
  exec plugin that fails) raises `ConfigError` naming `--kubeconfig` and the cause.
Every call blocks: run it in a thread from async code.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import subprocess
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError
from spotguard.kube.api import ApiError, MalformedResponse, NotFound, Resource, selector_text, error_for_status

FLAG = "--kubeconfig"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_TIMEOUT_S = 60.0


class Unsupported(Exception):
    """The configuration needs something this client does not do; use the official client."""


@dataclass(frozen=True)
class Endpoint:
    """Where the API is and how to prove who is asking: `server` (https://host[:port]), TLS
    settings, and at most one of a bearer token, a client certificate (PEM) or basic auth."""

    server: str
    ca_pem: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    token: str | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    basic: tuple[str, str] | None = None


def _read(path: str, base: Path, what: str) -> bytes:
    full = Path(path) if os.path.isabs(path) else base / path
    try:
        return full.read_bytes()
    except OSError as exc:
        raise ConfigError(FLAG, f"{what} {full}: cannot be read ({exc.strerror or exc})") from None


def _data(entry: Mapping[str, Any], key: str, base: Path, what: str) -> bytes | None:
    """`key-data` (base64) or the file `key` names, or None."""
    inline = entry.get(f"{key}-data")
    if inline:
        try:
            return base64.b64decode(str(inline), validate=True)
        except ValueError:
            raise ConfigError(FLAG, f"{key}-data of {what} is not base64") from None
    if entry.get(key):
        return _read(str(entry[key]), base, f"{key} of {what}")
    return None


def _named(doc: Mapping[str, Any], section: str, name: str, key: str, path: Path) -> dict[str, Any]:
    for item in doc.get(section) or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(key)
            if not isinstance(value, dict):
                raise ConfigError(FLAG, f"{path}: {section} entry {name!r} has no {key} map")
            return value
    raise ConfigError(FLAG, f"{path}: no {section[:-1]} named {name!r}")


def from_kubeconfig(path: str, context: str | None = None, environ: Mapping[str, str] = os.environ) -> Endpoint:
    """The endpoint of `context` (default: current-context) of the kubeconfig at `path`."""
    import yaml

    file = Path(path)
    try:
        doc = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ConfigError(FLAG, f"{file}: cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(FLAG, f"{file}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(FLAG, f"{file}: not a kubeconfig (expected a map)")
    name = context or doc.get("current-context")
    if not name:
        raise ConfigError(FLAG, f"{file}: no current-context; pass --context")
    ctx = _named(doc, "contexts", str(name), "context", file)
    cluster = _named(doc, "clusters", str(ctx.get("cluster")), "cluster", file)
    user = _named(doc, "users", str(ctx.get("user")), "user", file) if ctx.get("user") else {}
    if cluster.get("proxy-url"):
        raise Unsupported("proxy-url")
    if user.get("auth-provider"):
        raise Unsupported("auth-provider")
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ConfigError(FLAG, f"{file}: cluster {ctx.get('cluster')!r} has no https:// server")
    base = file.parent
    endpoint = Endpoint(
        server=server, ca_pem=_data(cluster, "certificate-authority", base, f"cluster {ctx.get('cluster')!r}"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")), tls_server_name=cluster.get("tls-server-name"))
    return _with_user(endpoint, user, base, f"user {ctx.get('user')!r}", cluster, environ)


def _with_user(endpoint: Endpoint, user: Mapping[str, Any], base: Path, what: str,
               cluster: Mapping[str, Any], environ: Mapping[str, str]) -> Endpoint:
    cert, key = _data(user, "client-certificate", base, what), _data(user, "client-key", base, what)
    if (cert is None) != (key is None):
        raise ConfigError(FLAG, f"{what}: a client certificate needs both client-certificate and client-key")
    if user.get("token"):
        return replace(endpoint, token=str(user["token"]), cert_pem=cert, key_pem=key)
    if user.get("tokenFile"):
        token = _read(str(user["tokenFile"]), base, f"tokenFile of {what}").decode().strip()
        return replace(endpoint, token=token, cert_pem=cert, key_pem=key)
    if cert is not None:
        return replace(endpoint, cert_pem=cert, key_pem=key)
    if user.get("username"):
        return replace(endpoint, basic=(str(user["username"]), str(user.get("password") or "")))
    if isinstance(user.get("exec"), dict):
        return _exec_credential(endpoint, user["exec"], what, cluster, environ)
    return endpoint


def _exec_credential(endpoint: Endpoint, spec: Mapping[str, Any], what: str, cluster: Mapping[str, Any],
                     environ: Mapping[str, str]) -> Endpoint:
    """Runs the exec credential plugin as kubectl does and takes its token or certificate."""
    api_version = str(spec.get("apiVersion") or "")
    if api_version not in EXEC_API_VERSIONS:
        raise Unsupported(f"exec apiVersion {api_version!r}")
    command = spec.get("command")
    if not command:
        raise ConfigError(FLAG, f"{what}: exec has no command")
    info: dict[str, Any] = {"apiVersion": api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
    if spec.get("provideClusterInfo"):
        info["spec"]["cluster"] = {k: cluster[k] for k in ("server", "certificate-authority-data",
                                                          "insecure-skip-tls-verify", "tls-server-name")
                                   if k in cluster}
    env = {**environ, **{str(e.get("name")): str(e.get("value", "")) for e in spec.get("env") or []
                         if isinstance(e, dict)}, "KUBERNETES_EXEC_INFO": json.dumps(info)}
    argv = [str(command), *(str(a) for a in spec.get("args") or [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=EXEC_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(FLAG, f"{what}: exec plugin {command!r} did not run ({exc})") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(FLAG, f"{what}: exec plugin {command!r} exited {done.returncode}: {tail}")
    try:
        status = json.loads(done.stdout)["status"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(FLAG, f"{what}: exec plugin {command!r} printed no ExecCredential status") from None
    if not isinstance(status, dict):
        raise ConfigError(FLAG, f"{what}: exec plugin {command!r} printed no ExecCredential status")
    if status.get("token"):
        return replace(endpoint, token=str(status["token"]))
    if status.get("clientCertificateData") and status.get("clientKeyData"):
        return replace(endpoint, cert_pem=str(status["clientCertificateData"]).encode(),
                       key_pem=str(status["clientKeyData"]).encode())
    raise ConfigError(FLAG, f"{what}: exec plugin {command!r} gave neither a token nor a client certificate")


def in_cluster(environ: Mapping[str, str] = os.environ, folder: Path = SERVICE_ACCOUNT) -> Endpoint:
    """The pod's own API endpoint and ServiceAccount credentials."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError(FLAG, "not in a pod: KUBERNETES_SERVICE_HOST is not set")
    host = f"[{host}]" if ":" in host else host
    token = _read("token", folder, "the ServiceAccount").decode().strip()
    return Endpoint(server=f"https://{host}:{port}", ca_pem=_read("ca.crt", folder, "the ServiceAccount"),
                    token=token)


def _ssl_context(endpoint: Endpoint) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificates and host names
    if endpoint.ca_pem is None and not endpoint.insecure:
        ctx.load_default_certs()  # the system's CAs only when the kubeconfig names none (tens of ms)
    if endpoint.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif endpoint.ca_pem is not None:
        try:
            ctx.load_verify_locations(cadata=endpoint.ca_pem.decode())
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(FLAG, f"the certificate authority of {endpoint.server} is not a PEM certificate "
                                    f"({exc})") from None
    if endpoint.cert_pem is not None and endpoint.key_pem is not None:
        # ssl loads a client certificate only from files: written for the call, 0600, then removed.
        with tempfile.TemporaryDirectory(prefix="spotguard-kube-") as folder:
            cert, key = Path(folder, "client.crt"), Path(folder, "client.key")
            for path, data in ((cert, endpoint.cert_pem), (key, endpoint.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            try:
                ctx.load_cert_chain(cert, key)
            except ssl.SSLError as exc:
                raise ConfigError(FLAG, f"the client certificate or key is not usable ({exc})") from None
    return ctx


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS that checks the server's certificate for `server_name` (a kubeconfig's
    `tls-server-name`), which may differ from the host it connects to."""

    def __init__(self, host: str, port: int | None, *, timeout: float, context: ssl.SSLContext | None,
                 server_name: str):
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls = context or ssl.create_default_context()
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_name)


class RestReader:
    """GETs against one API server (see the module docstring). One connection, reused."""

    def __init__(self, endpoint: Endpoint, request_timeout: float = 10.0):
        self.endpoint = endpoint
        self.server = endpoint.server
        self.timeout = request_timeout
        url = urllib.parse.urlsplit(endpoint.server)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "", url.port
        self._prefix = url.path.rstrip("/")
        self._ssl = _ssl_context(endpoint) if self._https else None
        self._conn: http.client.HTTPConnection | None = None
        self._headers = {"Accept": "application/json", "User-Agent": "spotguard-status"}
        if endpoint.token:
            self._headers["Authorization"] = f"Bearer {endpoint.token}"
        elif endpoint.basic:
            pair = f"{endpoint.basic[0]}:{endpoint.basic[1]}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = _HTTPSConnection(self._host, self._port, timeout=self.timeout, context=self._ssl,
                                              server_name=self.endpoint.tls_server_name or self._host)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _get(self, path: str, query: Mapping[str, str]) -> Any:
        target = self._prefix + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more, on a fresh one
            conn = self._connection()
            try:
                conn.request("GET", target, headers=self._headers)
                response = conn.getresponse()
                body = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if attempt:
                    raise ApiError(0, f"{type(exc).__name__}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise ApiError(0, f"{type(exc).__name__}: {exc}") from None
        if not 200 <= response.status < 300:
            raise error_for_status(response.status, body.decode(errors="replace"))
        try:
            return json.loads(body) if body else {}
        except ValueError:
            raise MalformedResponse(0, f"GET {path}: the body is not JSON") from None

    @staticmethod
    def _path(res: Resource, namespace: str | None, name: str | None = None) -> str:
        root = "/api/v1" if not res.group else f"/apis/{res.group}/{res.version}"
        where = f"/namespaces/{urllib.parse.quote(namespace)}" if namespace and res.namespaced else ""
        return f"{root}{where}/{res.plural}" + (f"/{urllib.parse.quote(name)}" if name else "")

    def list(self, res: Resource, namespace: str | None = None, *, label_selector: Mapping[str, str] | None = None,
             field_selector: str | None = None) -> tuple[list[dict], str]:
        """(items, list resourceVersion), as `Kube.list`."""
        query = {}
        if label_selector:
            query["labelSelector"] = selector_text(label_selector) or ""
        if field_selector:
            query["fieldSelector"] = field_selector
        body = self._get(self._path(res, namespace), query)
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise MalformedResponse(0, f"list of {res}: no items array")
        return [i for i in items if isinstance(i, dict)], str((body.get("metadata") or {}).get("resourceVersion") or "")

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        body = self._get(self._path(res, namespace, name), {})
        if not isinstance(body, dict):
            raise MalformedResponse(0, f"GET {res} {name}: not an object")
        return body


__all__ = ["Endpoint", "NotFound", "RestReader", "Unsupported", "from_kubeconfig", "in_cluster"]
