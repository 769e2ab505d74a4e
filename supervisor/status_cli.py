"""`spotguard status` (also `kubectl spotguard status`, installed as `kubectl-spotguard`): the
managed jobs as a table like `kubectl get`, as `-o json|yaml`, or one job in detail with its Events.

It reads only what the supervisor writes on the jobs (spec, status, the `spotguard.io/status`
record and `spotguard.io/steps-lost`) and the supervisor's Events, with the caller's own
credentials (plain HTTPS GETs, `spotguard.kube.rest`; the official client only for a kubeconfig
that needs it): one list of Jobs and one of PyTorchJobs (skipped where the CRD is not served) for the
table; one job and its Events for the detail. RBAC it needs: list on jobs, pytorchjobs and
events (Kubernetes' built-in `view` role has jobs and events; without pytorchjobs they are left
out with a warning).

The table shows why a job's policy is `invalid` (or its record unreadable) on stderr, one
warning line per job. `-A` / `--all-namespaces` is accepted as kubectl users type it (all
namespaces is the default; it overrides `-n`, as in kubectl).

Exit status: 0 with the output; 1 when the API cannot be reached or refuses (the message names
the server and the reason); 2 for bad input (no kubeconfig, unknown output format), naming it;
3 when the one job asked for is not found.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from spotguard.config import ConfigError
from spotguard.kube import rest
from spotguard.kube.api import EVENTS, ApiError, Kube, NotFound, Resource
from spotguard.wire import names
from spotguard.wire.notice import now_utc
from spotguard.supervisor import status_render
from spotguard.supervisor.jobs import ADAPTERS, BY_KIND, JobAdapter
from spotguard.supervisor.status_rows import JobRow, job_row

OUTPUTS = ("table", "json", "yaml")
EXIT_API, EXIT_NOT_FOUND = 1, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", default=None, help="one job's name: show it in detail with its Events")
    p.add_argument("-n", "--namespace", default=None, help="only this namespace (default: all namespaces)")
    p.add_argument("-A", "--all-namespaces", action="store_true",
                   help="all namespaces, as kubectl says it (the default; overrides -n, as in kubectl)")
    p.add_argument("--kind", default=None, choices=sorted(BY_KIND), help="the job's kind when a name is ambiguous")
    p.add_argument("-o", "--output", default="table", help="table (default), json or yaml")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else in-cluster)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("--kube-host", default=None, help="Kubernetes API URL without credentials (tests)")
    p.add_argument("--request-timeout", default=10.0, type=float, help="seconds per API request (default 10)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show the managed jobs: policy, phase, replicas, reclaims, cost",
        description="List the jobs spotguard manages, like `kubectl get`, or show one in detail with its Events. "
                    "Reads what the supervisor writes on the jobs, with your own kubeconfig.")
    add_arguments(p)
    p.set_defaults(func=run)


def kubeconfig_path(flag: str | None, environ=os.environ) -> str | None:
    """The kubeconfig to load: the flag, $KUBECONFIG's first file, ~/.kube/config; None: in-cluster."""
    if flag:
        return flag
    env = environ.get("KUBECONFIG", "")
    for path in env.split(os.pathsep):
        if path and os.path.exists(path):
            return path
    home = os.path.join(os.path.expanduser("~"), ".kube", "config")
    return home if os.path.exists(home) else None


def api_client(args: argparse.Namespace, environ=os.environ):
    """An ApiClient for the caller; ConfigError (exit 2) when no configuration is usable."""
    import kubernetes

    cfg = kubernetes.client.Configuration()
    if args.kube_host:
        cfg.host = args.kube_host.rstrip("/")
        return kubernetes.client.ApiClient(cfg)
    path = kubeconfig_path(args.kubeconfig, environ)
    try:
        if path is not None:
            kubernetes.config.load_kube_config(config_file=path, context=args.context, client_configuration=cfg)
        elif environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        else:
            raise ConfigError("--kubeconfig", "no kubeconfig: pass --kubeconfig FILE or set KUBECONFIG "
                                              "(~/.kube/config does not exist and this is not a pod)")
    except (kubernetes.config.ConfigException, OSError, ValueError) as exc:
        raise ConfigError("--kubeconfig", f"{path or 'in-cluster config'}: not usable ({exc})") from None
    return kubernetes.client.ApiClient(cfg)


class Reader(Protocol):
    """What the command needs of an API client: `Kube` and `rest.RestReader` both answer it."""

    def list(self, res: Resource, namespace: str | None = None, *, label_selector: dict[str, str] | None = None,
             field_selector: str | None = None) -> tuple[list[dict], str]: ...


def reader(args: argparse.Namespace, environ=os.environ) -> Reader:
    """The caller's API reader: plain HTTPS GETs (`spotguard.kube.rest`, no import of the official
    client, which costs most of a cold start), or the official client for a kubeconfig that
    needs what the plain reader does not do (a legacy auth-provider, a proxy)."""
    timeout = args.request_timeout
    try:
        if args.kube_host:
            return rest.RestReader(rest.Endpoint(server=args.kube_host.rstrip("/")), timeout)
        path = kubeconfig_path(args.kubeconfig, environ)
        if path is not None:
            return rest.RestReader(rest.from_kubeconfig(path, args.context, environ), timeout)
        if environ.get("KUBERNETES_SERVICE_HOST"):
            return rest.RestReader(rest.in_cluster(environ), timeout)
    except rest.Unsupported:
        return Kube(api_client(args, environ), request_timeout=timeout)
    raise ConfigError("--kubeconfig", "no kubeconfig: pass --kubeconfig FILE or set KUBECONFIG "
                                      "(~/.kube/config does not exist and this is not a pod)")


def list_rows(kube: Reader, namespace: str | None, kinds: Sequence[JobAdapter] = ADAPTERS) -> list[JobRow]:
    """Every managed job's row, sorted by namespace, kind and name. An optional kind whose resource
    the server does not serve (404: no PyTorchJob CRD) is skipped, and one the caller may not
    list (403) too, with a warning on stderr; other API errors propagate."""
    rows = []
    for adapter in kinds:
        try:
            items, _ = kube.list(adapter.resource, namespace, label_selector={names.LABEL_MANAGED: "true"})
        except NotFound:
            if adapter.optional:
                continue
            raise
        except ApiError as exc:
            if not (adapter.optional and exc.status == 403):
                raise
            print(f"spotguard status: warning: not allowed to list {adapter.resource.plural}; "
                  f"{adapter.kind}s are not shown", file=sys.stderr)
            continue
        rows += [job_row(obj, adapter) for obj in items
                 if ((obj.get("metadata") or {}).get("labels") or {}).get(names.LABEL_MANAGED) == "true"]
    return sorted(rows, key=lambda r: (r.namespace, r.kind, r.name))


def job_events(kube: Reader, row: JobRow) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={row.name},involvedObject.kind={row.kind}"
    items, _ = kube.list(EVENTS, row.namespace, field_selector=selector)
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == row.name]


def render(rows: list[JobRow], output: str, now: datetime) -> str:
    if output == "json":
        return status_render.as_json(rows)
    if output == "yaml":
        return status_render.as_yaml(rows)
    return status_render.table(rows, now)


def warn_problems(rows: Sequence[JobRow]) -> None:
    """The table has no room for why a job's policy or record is unreadable: one line each on
    stderr, as kubectl prints its warnings (`-o json|yaml` and the detail carry `problem`)."""
    for row in rows:
        if row.problem:
            print(f"spotguard status: warning: {row.kind} {row.namespace}/{row.name}: {row.problem}", file=sys.stderr)


def _server(kube: Reader) -> str:
    if isinstance(kube, Kube):
        return str(getattr(kube.api_client.configuration, "host", "") or "the API server")
    return str(getattr(kube, "server", "") or "the API server")


def run(args: argparse.Namespace) -> int:
    output = str(args.output).strip().lower()
    if output not in OUTPUTS:
        raise ConfigError("--output", f"expected one of {', '.join(OUTPUTS)}, got {args.output!r}")
    if args.request_timeout <= 0:
        raise ConfigError("--request-timeout", f"expected seconds > 0, got {args.request_timeout!r}")
    kube = reader(args)
    now = now_utc()
    kinds = [BY_KIND[args.kind]] if args.kind else list(ADAPTERS)
    namespace = None if args.all_namespaces else args.namespace
    try:
        rows = list_rows(kube, namespace, kinds)
        if args.job is None:
            sys.stdout.write(render(rows, output, now))
            if output == "table":
                warn_problems(rows)
            return 0
        matches = [r for r in rows if r.name == args.job]
        if len(matches) != 1:
            where = f" in namespace {namespace}" if namespace else ""
            if not matches:
                print(f"spotguard status: no managed job named {args.job!r}{where}", file=sys.stderr)
                return EXIT_NOT_FOUND
            found = ", ".join(f"{r.kind} {r.namespace}/{r.name}" for r in matches)
            raise ConfigError("job", f"{args.job!r} names several managed jobs ({found}): pass -n and/or --kind")
        row = matches[0]
        if output != "table":
            sys.stdout.write(render([row], output, now))
            return 0
        sys.stdout.write(status_render.detail(row, job_events(kube, row), now))
        return 0
    except ApiError as exc:
        reason = "cannot reach it" if exc.status == 0 else f"it answered {exc.status}"
        print(f"spotguard status: Kubernetes API at {_server(kube)}: {reason}: {exc}", file=sys.stderr)
        return EXIT_API
