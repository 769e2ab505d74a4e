"""`spotguard injector`: serve the sidecar-injection webhook, or create its TLS at install time."""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
from typing import TypedDict

from spotguard.config import ConfigError, Layers, positive_int
from spotguard.daemon import run_daemon

log = logging.getLogger(__name__)


# The sidecar's resources (requests AND limits: a quota on limits.* refuses a container without).
SIDECAR_RESOURCES = {"sidecar-cpu-request": "10m", "sidecar-cpu-limit": "200m",
                     "sidecar-memory-request": "32Mi", "sidecar-memory-limit": "96Mi"}
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|Ki|Mi|Gi|Ti|e\d+)?")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("injector", help="mutating admission webhook that injects the sidecar")
    sub = p.add_subparsers(dest="injector_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve POST /mutate over HTTPS")
    serve.add_argument("--listen", default="0.0.0.0:9443", help="ADDR:PORT (default 0.0.0.0:9443)")
    serve.add_argument("--tls-cert", required=True, help="PEM certificate (the Secret's tls.crt)")
    serve.add_argument("--tls-key", required=True, help="PEM private key (the Secret's tls.key)")
    serve.add_argument("--image", default=None, help="sidecar image (env SPOTGUARD_SIDECAR_IMAGE)")
    serve.add_argument(
        "--grace-seconds", default="120", help="default terminationGracePeriodSeconds floor (default 120)"
    )
    for flag, default in SIDECAR_RESOURCES.items():
        serve.add_argument(
            f"--{flag}", default=default, help=f"the sidecar's {flag[8:].replace('-', ' ')} (default {default})"
        )
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=run_serve)
    certgen = sub.add_parser(
        "certgen", help="fill the webhook's pre-created TLS Secret, set its caBundle (install Job)"
    )
    certgen.add_argument("--namespace", default="spotguard")
    certgen.add_argument("--secret", default="spotguard-injector-tls")
    certgen.add_argument("--service", default="spotguard-injector")
    certgen.add_argument("--webhook", default="spotguard-injector")
    certgen.add_argument("--kubeconfig", default=None)
    certgen.set_defaults(func=run_certgen)


def parse_listen(value: str, field: str = "--listen") -> tuple[str, int]:
    """Splits ADDR:PORT (IPv6 as [::]:PORT); ConfigError names `field`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(field, f"expected ADDR:PORT, got {value!r}")
    number = positive_int(field, port, allow_zero=True)
    if number > 65535:
        raise ConfigError(field, f"port must be <= 65535, got {number}")
    return host.strip("[]"), number


def run_serve(args: argparse.Namespace) -> int:
    from spotguard.injector.patch import MAX_GRACE, InjectorConfig
    from spotguard.logs import setup_logging

    host, port = parse_listen(args.listen)
    image = Layers(args).value("image", env="SPOTGUARD_SIDECAR_IMAGE")
    if not image:
        raise ConfigError("--image", "the sidecar image is required (or set SPOTGUARD_SIDECAR_IMAGE)")
    grace = positive_int("--grace-seconds", args.grace_seconds)
    if grace > MAX_GRACE:
        raise ConfigError("--grace-seconds", f"must be <= {MAX_GRACE}")
    setup_logging(args.log_level)
    try:
        from spotguard.injector.server import tls_context
        ctx = tls_context(args.tls_cert, args.tls_key)
    except (OSError, ValueError) as exc:
        raise ConfigError("--tls-cert", f"cannot load the certificate/key ({exc})") from None
    cfg = InjectorConfig(image=image, grace_seconds=grace, **sidecar_resources(args))
    return run_daemon(lambda stop: _serve(host, port, ctx, cfg, stop))


class SidecarResources(TypedDict):
    """InjectorConfig's resource fields (one per SIDECAR_RESOURCES flag, without `sidecar-`)."""

    cpu_request: str
    cpu_limit: str
    memory_request: str
    memory_limit: str


def sidecar_resources(args: argparse.Namespace) -> SidecarResources:
    """InjectorConfig's resource fields from the --sidecar-* flags; ConfigError names a bad one."""

    def quantity(flag: str) -> str:
        value = str(getattr(args, flag.replace("-", "_"))).strip()
        if not QUANTITY.fullmatch(value):
            raise ConfigError(f"--{flag}", f"expected a Kubernetes quantity like 100m or 64Mi, got {value!r}")
        return value

    return SidecarResources(cpu_request=quantity("sidecar-cpu-request"), cpu_limit=quantity("sidecar-cpu-limit"),
                            memory_request=quantity("sidecar-memory-request"),
                            memory_limit=quantity("sidecar-memory-limit"))


async def _serve(host: str, port: int, ctx, cfg, stop: asyncio.Event) -> int:
    from aiohttp import web

    from spotguard.injector.server import make_app

    runner = web.AppRunner(make_app(cfg), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ctx).start()
    log.info("injector serving", extra={"listen": f"{host}:{port}"})
    await stop.wait()
    await runner.cleanup()
    return 0


def run_certgen(args: argparse.Namespace) -> int:
    import sys

    from spotguard.injector.certs import MissingSecret, ensure_secret_and_ca_bundle
    from spotguard.kube import load_api_client

    api = load_api_client(args.kubeconfig)
    try:
        created = ensure_secret_and_ca_bundle(api, args.namespace, args.secret, args.service, args.webhook)
    except MissingSecret as exc:
        print(f"spotguard injector certgen: {exc}", file=sys.stderr)
        return 1
    print("created a new certificate" if created else "kept the existing certificate", "and set the caBundle")
    return 0
