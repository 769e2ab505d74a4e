"""The RBAC in daemonset/ grants exactly the Kubernetes API calls the code makes, per ServiceAccount.

Two independent views of "what the code calls", both compared with the rendered manifests
(`kubectl kustomize daemonset`):
- static: the AST of every module a component can import (the import closure of its entry
  module, lazy imports and importlib module strings included) is searched for calls of the
  official client's API methods; each method's HTTP verb and path come from the client's own
  generated code (`_<method>_serialize`), so no hand-written name table can drift. Agent,
  supervisor and injector go through the one dict facade (`spotguard/kube/api.py`, `Kube`); its calls are
  resolved to the `Resource` constants they pass (through adapters and informers), and a
  calibration test checks the facade model against real requests;
- dynamic: the real processes run against kmock's HTTP server with the manifests' own args,
  and every request they send is turned into RBAC request attributes and authorized against
  the rendered Roles/ClusterRoles (namespace and resourceNames included).
The test asserts, per ServiceAccount: used == granted (static), dynamic <= static, every
dynamic request is authorized, and no API call in the code base escapes attribution.
"""
from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable

import aiohttp
import kmock
import kubernetes
import pytest
import yaml

from spotguard.kube import load_api_client
from spotguard.kube import api as kubeapi
from spotguard.kube.api import Kube, Resource

from tests.agent_helpers import AgentProcess, wait_for

REPO = Path(__file__).resolve().parents[1]
PARTS = ("agent", "hooks", "trainer", "supervisor", "emulator", "injector", "spotguard")
# Code that never runs in the cluster under one of our ServiceAccounts.
TEST_SUPPORT = {"spotguard.supervisor.testing"}
# The dry-run's own Kubernetes (trainer/cluster/, trainer/local_cluster.py) and the goodput bench's
# termination handler: in-process stand-ins for Kubernetes' own components (the Job controller, the
# scheduler, the kubelet, the pod GC, an eviction) over LocalKube, never a real API server, so no
# ServiceAccount of ours runs them.
LOCAL_CLUSTER = ("spotguard.trainer.cluster", "spotguard.trainer.local_cluster", "spotguard.trainer.goodput")
FACADE_MODULE = "spotguard.kube.api"
# Entry modules of what each workload runs, keyed by the container's leading args.
COMPONENTS = {
    ("agent",): ["spotguard.agent.cli"],
    ("supervisor",): ["spotguard.supervisor.cli"],
    ("injector", "serve"): ["spotguard.injector.server"],
    ("injector", "certgen"): ["spotguard.injector.certs"],
}
# Commands a person runs with their own kubeconfig, under no ServiceAccount of ours: they may only
# read, exactly what their docstrings tell the user to grant (test_user_tools_only_read).
USER_TOOLS = {
    "spotguard.supervisor.status_cli": {("batch", "jobs", "list"), ("kubeflow.org", "pytorchjobs", "list"),
                                        ("", "events", "list")},
}
# Modules the brief names: the closure must reach them (guards the import walk itself).
MUST_REACH = {
    ("agent",): {"spotguard.agent.sources.k8s_node", "spotguard.agent.node_marker", "spotguard.agent.auth",
                 "spotguard.agent.app"},
    ("supervisor",): {"spotguard.supervisor.controller", "spotguard.supervisor.leader",
                      "spotguard.supervisor.informer", "spotguard.supervisor.jobs.pytorch"},
}
TEST_HEADER = "X-Spotguard-Test"  # marks the test's own setup requests (not the component's)

Triple = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


# ---- RBAC request attributes ---------------------------------------------------------------

@dataclass(frozen=True)
class ApiRequest:
    """What the API server's authorizer sees of a request. namespace/name None: none in the path."""

    group: str
    resource: str
    verb: str
    namespace: str | None = None
    name: str | None = None

    @property
    def triple(self) -> Triple:
        return (self.group, self.resource, self.verb)


def request_info(method: str, path: str, params: dict | None = None) -> ApiRequest:
    """Kubernetes' RequestInfo rules for a resource path (templates like `{name}` allowed)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return ApiRequest("<non-resource>", "/" + "/".join(parts), method.lower())
    watch = str((params or {}).get("watch", "")).lower() in ("true", "1")
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    method = method.upper()
    if method == "GET":
        verb = "watch" if watch else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}[method]
    return ApiRequest(group, resource, verb, namespace, name)


# ---- the manifests --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def rendered() -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomization (it ships on these machines)"
    out = subprocess.run([kubectl, "kustomize", str(REPO / "daemonset")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@dataclass(frozen=True)
class Rule:
    """One (group, resource, verb) of a PolicyRule; namespace None = cluster-wide (ClusterRole)."""

    group: str
    resource: str
    verb: str
    names: frozenset[str] | None
    namespace: str | None

    def allows(self, req: ApiRequest) -> bool:
        if (self.group, self.resource, self.verb) != req.triple:
            return False
        if self.namespace is not None and req.namespace != self.namespace:
            return False
        # resourceNames never match a request without a name (create, list, watch).
        return self.names is None or (req.name is not None and req.name in self.names)


def grants() -> dict[str, list[Rule]]:
    """ServiceAccount name -> its rules, through every (Cluster)RoleBinding."""
    docs = rendered()
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out: dict[str, list[Rule]] = {d["metadata"]["name"]: [] for d in docs if d["kind"] == "ServiceAccount"}
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        ref = binding["roleRef"]
        bound_ns = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], bound_ns if ref["kind"] == "Role" else None, ref["name"])]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", subject
            assert subject["namespace"] == "spotguard", subject
            for rule in role["rules"]:
                names = frozenset(rule["resourceNames"]) if rule.get("resourceNames") else None
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            out[subject["name"]].append(Rule(group, resource, verb, names, bound_ns))
    return out


@dataclass(frozen=True)
class Workload:
    kind: str
    namespace: str
    service_account: str
    args: tuple[str, ...]
    env: tuple[dict, ...]

    @property
    def component(self) -> tuple[str, ...]:
        return next(k for k in COMPONENTS if self.args[:len(k)] == k)

    def expanded_args(self, fields: dict[str, str]) -> list[str]:
        """The args as the kubelet passes them: $(VAR) from the container's env."""
        values = self.env_values(fields)
        return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), a) for a in self.args]

    def env_values(self, fields: dict[str, str]) -> dict[str, str]:
        """The container's env; fieldRef values come from `fields` (fieldPath -> value)."""
        out = {}
        for var in self.env:
            if "value" in var:
                out[var["name"]] = var["value"]
            elif "fieldRef" in (var.get("valueFrom") or {}):
                out[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        return out


def workloads() -> list[Workload]:
    out = []
    for doc in rendered():
        if doc["kind"] not in ("DaemonSet", "Deployment", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        out.append(Workload(doc["kind"], doc["metadata"]["namespace"], pod.get("serviceAccountName", "default"),
                            tuple(container["args"]), tuple(container.get("env") or ())))
    return out


def workload(component: tuple[str, ...]) -> Workload:
    (found,) = [w for w in workloads() if w.component == component]
    return found


# ---- static scan: the client's endpoints ----------------------------------------------------

@functools.lru_cache(maxsize=1)
def api_sources() -> dict[str, Path]:
    """Client API class name -> its generated source file (read, not imported: importing every
    API module costs seconds)."""
    folder = Path(kubernetes.client.__file__).parent / "api"
    out = {}
    for path in folder.glob("*.py"):
        for m in re.finditer(r"^class (\w+Api)\b", path.read_text(), re.M):
            out[m.group(1)] = path
    return out


SERIALIZE = re.compile(r"def _(\w+)_serialize\(.*?method='(\w+)',\s*resource_path='([^']+)'", re.S)


@functools.cache
def endpoints(cls_name: str) -> dict[str, tuple[str, str]]:
    """API method -> (HTTP method, path template), read from the generated client's
    `_<method>_serialize` functions (one `param_serialize(method=..., resource_path=...)` each)."""
    return {m.group(1): (m.group(2), m.group(3)) for m in SERIALIZE.finditer(api_sources()[cls_name].read_text())}


def endpoint(cls_name: str, method: str) -> tuple[str, str] | None:
    return endpoints(cls_name).get(re.sub(r"_(with_http_info|without_preload_content)$", "", method))


@functools.lru_cache(maxsize=1)
def method_index() -> dict[str, set[str]]:
    """API method name (and its _with_http_info forms) -> the client classes that have it."""
    index: dict[str, set[str]] = {}
    for name in api_sources():
        for method in endpoints(name):
            for variant in (method, f"{method}_with_http_info", f"{method}_without_preload_content"):
                index.setdefault(variant, set()).add(name)
    return index


# ---- static scan: modules and their import closure -----------------------------------------

@functools.cache
def module_path(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imports_of(name: str) -> set[str]:
    """Every spotguard module `name` may import: top-level or lazy imports, `from x import mod`,
    and importlib strings ("spotguard.a.b" or "spotguard.a.b:func")."""
    package = name if module_path(name) and module_path(name).name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse(module_path(name))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.fullmatch(r"(spotguard(?:\.\w+)+)(?::\w+)?", node.value)
            if m:
                found.add(m.group(1))
    out = set()
    for mod in found:
        if mod.split(".")[0] != "spotguard":
            continue
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # parents run too
            if module_path(".".join(parts[:i])):
                out.add(".".join(parts[:i]))
    return out


def closure(roots: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen or module_path(mod) is None:
            continue
        seen.add(mod)
        todo.extend(imports_of(mod) - seen)
    return seen


def all_modules() -> dict[str, Path]:
    """Every module of the distribution (setup.py maps folder <part> to spotguard.<part>)."""
    out = {}
    for part in PARTS:
        for path in (REPO / part).rglob("*.py"):
            rel = path.relative_to(REPO / part).with_suffix("")
            pieces = [p for p in rel.parts if p != "__init__"]
            out[".".join(["spotguard"] + ([part] if part != "spotguard" else []) + pieces)] = path
    return out


# ---- static scan: API uses ------------------------------------------------------------------

class Unresolved(AssertionError):
    pass


@dataclass(frozen=True)
class Use:
    module: str
    line: int
    triples: frozenset[Triple]

    def __str__(self) -> str:
        return f"{self.module}:{self.line} -> {sorted(self.triples)}"


def _terminal(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Call):
        return _terminal(expr.func)
    return None


class ModuleScan:
    """One module's AST with parents, enclosing classes and the names bound to client APIs."""

    def __init__(self, name: str, path: Path | None = None):
        self.name = name
        self.tree = parse(path or module_path(name))
        self.parent: dict[ast.AST, ast.AST] = {}
        self.klass: dict[ast.AST, str | None] = {}
        self._index(self.tree, None)
        self.receivers: dict[str, str] = {}  # variable/attribute name -> client API class
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
                cls = _terminal(node.value.func)
                if cls in api_sources():
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        if _terminal(target):
                            self.receivers[_terminal(target)] = cls

    def _index(self, node: ast.AST, klass: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            self.parent[child] = node
            inner = child.name if isinstance(child, ast.ClassDef) else klass
            self.klass[child] = inner
            self._index(child, inner)

    def call_shape(self, ref: ast.Attribute) -> tuple[str, list[ast.expr], list[ast.keyword]]:
        """How a method reference is used: ("call", args, keywords) for `x.m(...)` and for
        `to_thread(x.m, ...)`-style hand-offs, ("stream", ...) for `Watch().stream(x.m, ...)`,
        ("ref", [], []) otherwise."""
        parent = self.parent.get(ref)
        if isinstance(parent, ast.Call):
            if parent.func is ref:
                return "call", list(parent.args), list(parent.keywords)
            if ref in parent.args:
                rest = list(parent.args[parent.args.index(ref) + 1:])
                kind = "stream" if _terminal(parent.func) == "stream" else "call"
                return kind, rest, list(parent.keywords)
        return "ref", [], []


def _bool_values(keywords: list[ast.keyword], name: str) -> set[bool]:
    for kw in keywords:
        if kw.arg == name:
            return {bool(kw.value.value)} if isinstance(kw.value, ast.Constant) else {False, True}
    return {False}


def _string_value(expr: ast.expr, scan: ModuleScan) -> str:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        value = getattr(importlib.import_module(scan.name), expr.id, None)
        if isinstance(value, str):
            return value
    raise Unresolved(f"{scan.name}:{expr.lineno}: cannot resolve {ast.unparse(expr)!r} to a string")


def client_use(scan: ModuleScan, ref: ast.Attribute) -> Use:
    """The triples of one reference to an official client API method."""
    candidates = method_index()[ref.attr]
    receiver = _terminal(ref.value)
    cls = receiver if receiver in api_sources() else scan.receivers.get(receiver)
    classes = {cls} if cls in candidates else candidates
    kind, args, keywords = scan.call_shape(ref)
    triples: set[Triple] = set()
    for cls_name in classes:
        http, path = endpoint(cls_name, ref.attr)
        placeholders = set(re.findall(r"\{(\w+)\}", path)) - {"namespace", "name"}
        if placeholders:  # CustomObjectsApi: group/version/plural come from the call's arguments
            if kind == "ref":
                raise Unresolved(f"{scan.name}:{ref.lineno}: {ref.attr} passed around; cannot see its group/plural")
            method = re.sub(r"_(with_http_info|without_preload_content)$", "", ref.attr)
            signature = inspect.signature(getattr(getattr(kubernetes.client, cls_name), method))
            params = [p for p in signature.parameters if p != "self"]
            bound = dict(zip(params, args))
            bound.update({kw.arg: kw.value for kw in keywords if kw.arg})
            for p in placeholders:
                if p not in bound:
                    raise Unresolved(f"{scan.name}:{ref.lineno}: {ref.attr} without {p}")
                path = path.replace(f"{{{p}}}", _string_value(bound[p], scan))
        watches = _bool_values(keywords, "watch") if kind == "call" else {False}
        for watch in watches | ({True} if kind == "stream" else set()):
            triples.add(request_info(http, path, {"watch": "true"} if watch else {}).triple)
    return Use(scan.name, ref.lineno, frozenset(triples))


# The facade: Kube.<method> -> the verb of the one request it sends.
FACADE_VERBS = {"list": "list", "get": "get", "patch": "patch", "create": "create", "watch": "watch"}
FACADE_RECEIVER = "kube"  # every component holds its Kube as `kube` / `self.kube` throughout


def facade_triple(res: Resource, method: str, status: bool) -> Triple:
    return (res.group, res.plural + ("/status" if status else ""), FACADE_VERBS[method])


class Component:
    """The modules one workload can run, with resolution of facade resource arguments."""

    def __init__(self, roots: list[str]):
        self.modules = closure(roots)
        self.scans = {m: ModuleScan(m) for m in sorted(self.modules)}

    def resolve(self, expr: ast.expr, scan: ModuleScan, depth: int = 0) -> set[Resource]:
        """The Resource values an expression can hold: a module constant, `x.attr` (any class
        attribute `attr` in the component), or `self.attr` (traced to the constructor calls)."""
        where = f"{scan.name}:{getattr(expr, 'lineno', '?')}"
        if depth > 5:
            raise Unresolved(f"{where}: resource argument too indirect")
        if isinstance(expr, ast.Name):
            value = getattr(importlib.import_module(scan.name), expr.id, None)
            if isinstance(value, Resource):
                return {value}
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            klass = scan.klass.get(expr)
            if klass is not None:
                return self._through_constructor(scan, klass, expr.attr, depth)
        elif isinstance(expr, ast.Attribute):
            found = set()
            for other in self.scans.values():
                module = importlib.import_module(other.name)
                for node in ast.walk(other.tree):
                    if isinstance(node, ast.ClassDef) and any(
                            isinstance(s, (ast.Assign, ast.AnnAssign)) and getattr(s, "value", None) is not None
                            and expr.attr in {_terminal(t)
                                              for t in (s.targets if isinstance(s, ast.Assign) else [s.target])}
                            for s in node.body):
                        value = getattr(getattr(module, node.name, None), expr.attr, None)
                        if isinstance(value, Resource):
                            found.add(value)
            if found:
                return found
        raise Unresolved(f"{where}: cannot resolve the resource argument {ast.unparse(expr)!r}")

    def _through_constructor(self, scan: ModuleScan, klass: str, attr: str, depth: int) -> set[Resource]:
        cls_node = next(n for n in ast.walk(scan.tree) if isinstance(n, ast.ClassDef) and n.name == klass)
        init = next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            raise Unresolved(f"{scan.name}: {klass}.{attr} has no constructor to trace")
        param = None
        for node in ast.walk(init):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                        node.value, ast.Tuple) else [(target, node.value)]
                    for t, v in pairs:
                        if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(v, ast.Name):
                            param = v.id
        params = [a.arg for a in init.args.args][1:]
        if param not in params:
            raise Unresolved(f"{scan.name}: {klass}.{attr} is not set from a constructor argument")
        position = params.index(param)
        found: set[Resource] = set()
        for other in self.scans.values():
            for node in ast.walk(other.tree):
                if (isinstance(node, ast.Call) and _terminal(node.func) == klass
                        and not isinstance(node.func, ast.Attribute)):
                    arg = node.args[position] if len(node.args) > position else next(
                        (k.value for k in node.keywords if k.arg == param), None)
                    if arg is None:
                        raise Unresolved(f"{other.name}:{node.lineno}: {klass}(...) without {param}")
                    found |= self.resolve(arg, other, depth + 1)
        return found

    def facade_use(self, scan: ModuleScan, ref: ast.Attribute) -> Use:
        kind, args, keywords = scan.call_shape(ref)
        res_expr = args[0] if args else next((k.value for k in keywords if k.arg == "res"), None)
        if kind != "call" or res_expr is None:
            raise Unresolved(f"{scan.name}:{ref.lineno}: facade method {ref.attr} used without its resource")
        statuses = _bool_values(keywords, "status") if ref.attr == "patch" else {False}
        triples = {facade_triple(res, ref.attr, status)
                   for res in self.resolve(res_expr, scan) for status in statuses}
        return Use(scan.name, ref.lineno, frozenset(triples))

    def uses(self) -> list[Use]:
        out = []
        for name, scan in self.scans.items():
            if name == FACADE_MODULE or name in TEST_SUPPORT:
                continue
            out += direct_uses(scan)
            for node in ast.walk(scan.tree):
                if (isinstance(node, ast.Attribute) and node.attr in FACADE_VERBS
                        and _terminal(node.value) == FACADE_RECEIVER):
                    out.append(self.facade_use(scan, node))
        return out

    def triples(self) -> set[Triple]:
        return set().union(*(u.triples for u in self.uses()))


def direct_uses(scan: ModuleScan) -> list[Use]:
    """Calls (or hand-offs) of official client API methods, and `call_api` with a literal path."""
    out = []
    for node in ast.walk(scan.tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in method_index():
            out.append(client_use(scan, node))
        elif node.attr in ("call_api", "param_serialize"):
            _kind, args, keywords = scan.call_shape(node)
            kw = {k.arg: k.value for k in keywords}
            path = args[0] if args else kw.get("resource_path")
            verb = args[1] if len(args) > 1 else kw.get("method")
            if path is None or verb is None:
                raise Unresolved(f"{scan.name}:{node.lineno}: {node.attr} without a literal path and method")
            out.append(Use(scan.name, node.lineno, frozenset(
                {request_info(_string_value(verb, scan), _string_value(path, scan)).triple})))
    return out


@functools.lru_cache(maxsize=1)
def static_by_component() -> dict[tuple[str, ...], Component]:
    return {key: Component(roots) for key, roots in COMPONENTS.items()}


def granted_triples(service_account: str) -> set[Triple]:
    return {(r.group, r.resource, r.verb) for r in grants()[service_account]}


# ---- static tests ---------------------------------------------------------------------------

def test_every_workload_is_a_known_component_with_its_own_service_account():
    seen = {}
    for w in workloads():
        assert w.namespace == "spotguard"
        assert w.component in COMPONENTS, w.args
        assert w.component not in seen, f"two workloads run {w.component}"
        seen[w.component] = w.service_account
    assert set(seen) == set(COMPONENTS)
    assert len(set(seen.values())) == len(seen), f"components share a ServiceAccount: {seen}"
    assert set(grants()) == set(seen.values()), "a ServiceAccount without a workload, or the reverse"
    accounts = {d["metadata"]["name"]: d for d in rendered() if d["kind"] == "ServiceAccount"}
    for component, sa in seen.items():
        if not static_by_component()[component].triples():  # no API use: no token in the pod either
            assert accounts[sa].get("automountServiceAccountToken") is False, sa


@pytest.mark.parametrize("component", list(COMPONENTS), ids=" ".join)
def test_static_calls_equal_granted_rules(component):
    comp = static_by_component()[component]
    assert MUST_REACH.get(component, set()) <= comp.modules, MUST_REACH[component] - comp.modules
    used = comp.triples()
    sa = workload(component).service_account
    granted = granted_triples(sa)
    uses = "\n".join(str(u) for u in comp.uses())
    assert used - granted == set(), (
        f"{sa}: the code calls these but RBAC denies them:\n{sorted(used - granted)}\n{uses}")
    assert granted - used == set(), f"{sa}: granted but never called (least privilege):\n{sorted(granted - used)}"


def test_no_api_call_escapes_attribution():
    """Every module that calls the Kubernetes API belongs to a component checked above."""
    covered = set().union(*(c.modules for c in static_by_component().values()), USER_TOOLS)
    stray = []
    modules = all_modules()
    assert covered <= set(modules)
    local = {name for name in modules if name.startswith(LOCAL_CLUSTER)}
    assert local, "LOCAL_CLUSTER names no module: the exemption would hide nothing, remove it"
    for name in sorted(set(modules) - covered - TEST_SUPPORT - local - {FACADE_MODULE}):
        scan = ModuleScan(name, modules[name])
        stray += [str(u) for u in direct_uses(scan)]
        stray += [f"{name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(scan.tree)
                  if isinstance(n, ast.Attribute) and n.attr in FACADE_VERBS and _terminal(n.value) == FACADE_RECEIVER]
    assert not stray, "API calls outside every component (no ServiceAccount would allow them):\n" + "\n".join(stray)


@pytest.mark.parametrize("module", sorted(USER_TOOLS))
def test_user_tools_only_read(module):
    used = Component([module]).triples()
    assert used == USER_TOOLS[module], f"{module} calls {sorted(used)}"
    assert {verb for _group, _resource, verb in used} <= {"get", "list", "watch"}
    doc = importlib.import_module(module).__doc__ or ""
    for _group, resource, verb in used:
        assert resource in doc, f"{module}'s docstring does not tell the user it needs {verb} on {resource}"


def test_the_scanner_sees_what_it_must():
    """Guards the scanner: the known call sites resolve to the known triples."""
    agent = static_by_component()[("agent",)].uses()
    by_module = {}
    for use in agent:
        by_module.setdefault(use.module, set()).update(use.triples)
    assert by_module["spotguard.agent.sources.k8s_node"] == {("", "nodes", "list"), ("", "nodes", "watch")}
    assert by_module["spotguard.agent.auth"] == {("authentication.k8s.io", "tokenreviews", "create")}
    sup = static_by_component()[("supervisor",)].uses()
    informer = set().union(*(u.triples for u in sup if u.module == "spotguard.supervisor.informer"))
    assert ("kubeflow.org", "pytorchjobs", "watch") in informer and ("", "nodes", "list") in informer
    assert request_info("GET", "/apis/batch/v1/jobs", {"watch": "1"}).triple == ("batch", "jobs", "watch")
    assert request_info("PATCH", "/apis/batch/v1/namespaces/a/jobs/b/status") == \
        ApiRequest("batch", "jobs/status", "patch", "a", "b")


def test_the_facade_model_is_complete():
    """A new Kube method would be invisible to the scan: the model must list every one."""
    public = {n for n, f in vars(Kube).items() if callable(f) and not n.startswith("_")}
    assert public == set(FACADE_VERBS)


async def test_the_facade_model_matches_the_requests_it_sends():
    """Calibration: every facade method on every Resource sends the request the model says."""
    resources = [v for v in vars(kubeapi).values() if isinstance(v, Resource)]
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        kube = Kube(load_api_client(host=str(srv.url).rstrip("/")), request_timeout=5)
        try:
            for res in resources:
                ns = "ns1" if res.namespaced else None
                body = {"apiVersion": res.api_version, "kind": res.kind, "metadata": {"name": "x"},
                        **({"involvedObject": {"kind": "Pod", "name": "p"}} if res.kind == "Event" else {}),
                        **({"spec": {"token": "t"}} if res.kind == "TokenReview" else {})}
                calls = [("list", False, lambda: kube.list(res, ns)), ("list", False, lambda: kube.list(res, None)),
                         ("get", False, lambda: kube.get(res, ns, "x")),
                         ("create", False, lambda: kube.create(res, ns, body)),
                         ("patch", False, lambda: kube.patch(res, ns, "x", {"metadata": {}})),
                         ("patch", True, lambda: kube.patch(res, ns, "x", {"status": {}}, status=True)),
                         ("watch", False, lambda: kube.watch(res, ns, "", timeout_seconds=1).close())]
                for method, status, call in calls:
                    before = len(list(km))
                    expected = [facade_triple(res, method, status)]
                    try:
                        await asyncio.to_thread(call)
                    except kubeapi.ApiError:
                        pass  # the request was sent; kmock may not know the resource
                    except AttributeError:  # no such subresource in the client (events/status): nothing sent
                        expected = []
                    sent = [request_info(r.method.value, r.url.path, dict(r.params)).triple for r in list(km)[before:]]
                    assert sent == expected, (res, method, status, sent)
        finally:
            kube.api_client.close()


def test_no_component_gets_secrets_or_pod_deletion():
    certgen = workload(("injector", "certgen"))
    secret_name = next(a.split("=", 1)[1] for a in certgen.args if a.startswith("--secret="))
    for sa, rules in grants().items():
        for rule in rules:
            assert "*" not in (rule.group, rule.resource, rule.verb), (sa, rule)
            assert rule.verb not in ("escalate", "bind", "impersonate"), (sa, rule)
            deletes_pods = rule.resource.split("/")[0] == "pods" and rule.verb in ("delete", "deletecollection")
            assert not deletes_pods, (sa, rule)
            if rule.resource.split("/")[0] == "secrets":
                assert sa == certgen.service_account, (sa, rule)
                assert rule.namespace == certgen.namespace, rule
                # No create: certgen could mint a service-account-token Secret and read its token.
                assert rule.verb in ("get", "patch") and rule.names == {secret_name}, rule
    pre_created = [d for d in rendered() if d["kind"] == "Secret" and d["metadata"]["name"] == secret_name]
    assert [d["metadata"]["namespace"] for d in pre_created] == [certgen.namespace], "the manifests create it"
    assert pre_created[0]["type"] == "Opaque" and not pre_created[0].get("data"), "re-applying never wipes it"


def test_resource_names_match_the_names_the_workloads_use():
    sup = workload(("supervisor",))
    args = dict(a.split("=", 1) for a in sup.expanded_args({"metadata.name": "p", "metadata.namespace": sup.namespace})
                if a.startswith("--"))
    lease_rules = [r for r in grants()[sup.service_account] if r.resource == "leases"]
    assert lease_rules and all(r.namespace == args["--lease-namespace"] for r in lease_rules)
    assert all(r.names in (None, {args["--lease-name"]}) for r in lease_rules)
    assert all(r.names is not None for r in lease_rules if r.verb != "create"), "renewal must be pinned to one Lease"
    certgen = workload(("injector", "certgen"))
    cargs = dict(a.split("=", 1) for a in certgen.args if a.startswith("--"))
    assert cargs["--namespace"] == certgen.namespace
    webhooks = {d["metadata"]["name"] for d in rendered() if d["kind"] == "MutatingWebhookConfiguration"}
    assert webhooks == {cargs["--webhook"]}
    for rule in grants()[certgen.service_account]:
        if rule.resource == "mutatingwebhookconfigurations":
            assert rule.names == {cargs["--webhook"]}, rule


# ---- dynamic: the real processes against kmock ----------------------------------------------

def component_requests(km) -> list[ApiRequest]:
    return [request_info(r.method.value, r.url.path, dict(r.params)) for r in list(km)
            if r.headers.get(TEST_HEADER) != "setup"]


def setup_client(url: str):
    api = load_api_client(host=url)
    api.set_default_header(TEST_HEADER, "setup")
    return api


def assert_authorized(requests: list[ApiRequest], component: tuple[str, ...]) -> set[Triple]:
    sa = workload(component).service_account
    rules = grants()[sa]
    denied = [r for r in requests if not any(rule.allows(r) for rule in rules)]
    assert not denied, f"{sa} would be denied: {denied}"
    observed = {r.triple for r in requests}
    static = static_by_component()[component].triples()
    assert observed <= static, f"the static scan missed {sorted(observed - static)}"
    return observed


async def test_agent_requests_are_all_authorized(make_emulator):
    emu, control = await make_emulator("aws")
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        url = str(srv.url).rstrip("/")
        kube = Kube(setup_client(url))
        await asyncio.to_thread(kube.create, kubeapi.NODES, None,
                                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        await asyncio.to_thread(kube.create, kubeapi.PODS, "train", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer-0", "namespace": "train", "labels": {"spotguard.io/inject": "true"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "t", "image": "x"}]}, "status": {"phase": "Running"}})
        ds = workload(("agent",))
        fields = {"spec.nodeName": "n1", "status.hostIP": "127.0.0.1", "metadata.namespace": ds.namespace}
        args = [*ds.expanded_args(fields)[1:],
                "--cloud=aws", f"--metadata-url={emu.url}", "--gpu=off", "--listen=127.0.0.1:0",
                f"--kube-host={url}", "--ready-grace=1"]
        proc = AgentProcess(*args, env=ds.env_values(fields))
        try:
            await proc.started()
            await control.schedule("reclaim", lead=120)

            async def marked_and_evented():
                node = await asyncio.to_thread(kube.get, kubeapi.NODES, None, "n1")
                if "spotguard.io/notice" not in (node["metadata"].get("annotations") or {}):
                    return False
                try:
                    events, _ = await asyncio.to_thread(kube.list, kubeapi.EVENTS, None)
                except kubeapi.NotFound:  # kmock knows a resource once an object of it exists
                    return False
                return {(e.get("involvedObject") or {}).get("kind") for e in events} >= {"Node", "Pod"}
            await wait_for(marked_and_evented, timeout=20, pause=0.1)
            async with aiohttp.ClientSession(trust_env=False) as http:
                async with http.post(proc.url + "/v1/reports", headers={"Authorization": "Bearer not-a-real-token"},
                                     json={"v": 1}) as resp:
                    assert resp.status in (401, 403, 503)
            assert await asyncio.to_thread(proc.terminate, 10) == 0
        finally:
            proc.kill()
            kube.api_client.close()
        observed = assert_authorized(component_requests(km), ("agent",))
    assert observed == static_by_component()[("agent",)].triples(), "every agent call path ran"


async def test_supervisor_requests_are_all_authorized():
    from spotguard.wire import names
    from spotguard.kube.api import JOBS, NODES, PODS, PYTORCHJOBS
    from spotguard.supervisor.testing import VersionedKubernetesEmulator

    emulator = VersionedKubernetesEmulator()
    emulator.resources["kubeflow.org/v1/pytorchjobs"] = emulator.ResourceInfo(
        kind="PyTorchJob", namespaced=True, verbs=["get", "list", "watch", "patch", "create"])
    async with emulator, kmock.Server(emulator) as srv:
        url = str(srv.url).rstrip("/")
        kube = Kube(setup_client(url))
        call = asyncio.to_thread
        for i in range(4):
            await call(kube.create, NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"n{i}"},
                                                  "status": {"allocatable": {"nvidia.com/gpu": "1", "cpu": "8"},
                                                             "conditions": [{"type": "Ready", "status": "True"}]}})
        template = {"spec": {"containers": [{"name": "t", "image": "x",
                                             "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}}
        jobs = [("scaled", "Job", "2"), ("suspended", "Job", "4"), ("pt", "PyTorchJob", "4")]
        for name, kind, minimum in jobs:
            meta = {"name": name, "namespace": "train", "uid": f"uid-{name}", "labels": {names.LABEL_MANAGED: "true"},
                    "annotations": {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: minimum}}
            if kind == "Job":
                await call(kube.create, JOBS, "train", {
                    "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                    "spec": {"parallelism": 4, "completions": 4, "completionMode": "Indexed", "suspend": False,
                             "template": template}})
            else:
                await call(kube.create, PYTORCHJOBS, "train", {
                    "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
                    "spec": {"runPolicy": {"suspend": False},
                             "pytorchReplicaSpecs": {"Worker": {"replicas": 4, "template": template}}}})
            for i in range(4):
                await call(kube.create, PODS, "train", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{name}-{i}", "namespace": "train",
                                 "labels": {"training.kubeflow.org/replica-type": "worker"},
                                 "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                                 "ownerReferences": [{"apiVersion": "batch/v1" if kind == "Job" else "kubeflow.org/v1",
                                                      "kind": kind, "name": name, "uid": f"uid-{name}",
                                                      "controller": True}]},
                    "spec": {"nodeName": f"n{i}", **template["spec"]},
                    "status": {"phase": "Running", "podIP": f"10.0.0.{i + 1}"}})

        deploy = workload(("supervisor",))
        fields = {"metadata.name": "spotguard-supervisor-0", "metadata.namespace": deploy.namespace}
        args = [*deploy.expanded_args(fields), f"--kube-host={url}", "--listen=127.0.0.1:0", "--log-level=warning"]
        proc = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-m", "spotguard", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **deploy.env_values(fields)})
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert line, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no announcement"
            assert json.loads(line)["event"] == "listening"
            from datetime import UTC, datetime, timedelta

            from spotguard.wire.notice import format_time
            seen = datetime.now(UTC)  # a departure now (a deadline beyond the horizon would be held)
            notice = {"v": 1, "id": "aws.spot:rbac", "kind": "reclaim", "source": "aws.spot", "node": "n0",
                      "detected_at": format_time(seen), "deadline": format_time(seen + timedelta(seconds=60)),
                      "detail": {}}
            await call(kube.patch, NODES, None, "n0", {
                "metadata": {"annotations": {names.ANN_NOTICE: json.dumps(notice)}},
                "spec": {"taints": [{"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"}]}})

            async def acted():
                scaled = await call(kube.get, JOBS, "train", "scaled")
                suspended = await call(kube.get, JOBS, "train", "suspended")
                pt = await call(kube.get, PYTORCHJOBS, "train", "pt")
                member = await call(kube.get, PODS, "train", "scaled-1")
                return (scaled["spec"]["parallelism"] == 3 and suspended["spec"]["suspend"] is True
                        and pt["spec"]["runPolicy"]["suspend"] is True
                        and (suspended.get("status") or {}).get("conditions")
                        and (pt.get("status") or {}).get("conditions")
                        and names.ANN_MEMBERSHIP in (member["metadata"].get("annotations") or {}))
            await wait_for(acted, timeout=30, pause=0.2)
            proc.send_signal(signal.SIGTERM)  # releases the Lease: get + patch
            assert await asyncio.to_thread(proc.wait, 15) == 0, proc.stderr.read().decode()[-2000:]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            proc.stdout.close()
            proc.stderr.close()
            kube.api_client.close()
        requests = component_requests(emulator)
    observed = assert_authorized(requests, ("supervisor",))
    lease = {r.verb for r in requests if r.resource == "leases"}
    assert lease == {"get", "create", "patch"}, lease
    # Only the re-read after a 409 may stay unexercised in one run.
    missed = static_by_component()[("supervisor",)].triples() - observed
    assert missed <= {("batch", "jobs", "get"), ("kubeflow.org", "pytorchjobs", "get")}, sorted(missed)


async def test_certgen_requests_are_all_authorized():
    from spotguard.injector.certs import ensure_secret_and_ca_bundle

    job = workload(("injector", "certgen"))
    args = dict(a.split("=", 1) for a in job.args if a.startswith("--"))
    webhook = next(d for d in rendered() if d["kind"] == "MutatingWebhookConfiguration")
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        url = str(srv.url).rstrip("/")
        setup = setup_client(url)
        admission = kubernetes.client.AdmissionregistrationV1Api(setup)
        await asyncio.to_thread(admission.create_mutating_webhook_configuration, webhook)
        secret = next(d for d in rendered() if d["kind"] == "Secret" and d["metadata"]["name"] == args["--secret"])
        await asyncio.to_thread(kubernetes.client.CoreV1Api(setup).create_namespaced_secret,
                                secret["metadata"]["namespace"], secret)
        api = load_api_client(host=url)
        try:
            assert await asyncio.to_thread(ensure_secret_and_ca_bundle, api, args["--namespace"], args["--secret"],
                                           args["--service"], args["--webhook"]) is True
            assert await asyncio.to_thread(ensure_secret_and_ca_bundle, api, args["--namespace"], args["--secret"],
                                           args["--service"], args["--webhook"]) is False
        finally:
            api.close()
            setup.close()
        observed = assert_authorized(component_requests(km), ("injector", "certgen"))
    assert observed == static_by_component()[("injector", "certgen")].triples()


def test_every_unpinned_write_of_the_supervisor_is_fenced_by_an_admission_policy():
    """RBAC cannot say which fields: each object kind the supervisor may patch anywhere (not one
    named object, not a status subresource) has a ValidatingAdmissionPolicy for its
    ServiceAccount, bound with Deny (tests/test_k8s_supervisor_admission.py checks them on a
    real API server)."""
    sa = workload(("supervisor",)).service_account
    bound = {d["spec"]["policyName"] for d in rendered()
             if d["kind"] == "ValidatingAdmissionPolicyBinding" and "Deny" in d["spec"]["validationActions"]}
    fenced = set()
    for policy in rendered():
        if policy["kind"] != "ValidatingAdmissionPolicy" or policy["metadata"]["name"] not in bound:
            continue
        conditions = " ".join(c["expression"] for c in policy["spec"].get("matchConditions") or [])
        if f":{sa}'" not in conditions:
            continue
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
            if "UPDATE" in rule["operations"]:
                fenced |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    writes = {(r.group, r.resource) for r in grants()[sa]
              if r.verb in ("patch", "update") and "/" not in r.resource and r.names is None}
    assert writes == {("", "pods"), ("batch", "jobs"), ("kubeflow.org", "pytorchjobs")}, writes
    assert writes <= fenced, f"writes without an admission policy: {sorted(writes - fenced)}"
