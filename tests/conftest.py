"""Shared fixtures: real emulator servers on 127.0.0.1 ephemeral ports, and their control API."""
from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from spotguard.emulator.control import EmulatorControl
from spotguard.emulator.server import Emulator

# DeepSpeed JIT-builds its CPU shared-memory op on a first use, under a lock file in the torch
# extensions folder (`~/.cache/torch_extensions` by default). Shared by every clone and virtual
# environment there, that folder is rebuilt whenever another venv used it last, and a process
# killed while it held the lock leaves every later DeepSpeed start waiting forever. The tests
# (and the ranks they start, which inherit the environment) keep their own folder per checkout.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))


@pytest.fixture
async def make_emulator() -> AsyncIterator[Callable]:
    """`emu, control = await make_emulator("aws", **options)`: started, stopped after the test."""
    stack = contextlib.AsyncExitStack()

    async def make(cloud: str, **options):
        emu = await stack.enter_async_context(Emulator(cloud, **options))
        control = await stack.enter_async_context(EmulatorControl(emu.url, emu.control_token))
        return emu, control

    async with stack:
        yield make


# A real control plane (tests/control_plane.py), for tests marked `k8s` ---------------------------

_k8s_skipped: list[str] = []


# Modules not marked `slow` or `k8s` whose tests still take tens of seconds
# (the dry-run's, real S3 servers with real ranks).
LONG_UNMARKED = ("test_goodput.py", "test_local_", "test_supervisor_backfill.py", "test_backfill_",
                 "test_checkpoint_s3_", "test_integrations_s3.py", "test_checkpoint_crash.py")


def _runs_long(module: str, marked: bool) -> bool:
    return marked or module.startswith(LONG_UNMARKED)


def slow_modules_first(items: list) -> None:
    """Reorders `items` in place: whole modules, each in its own order, those with a test marked
    `slow` or `k8s` (or named in LONG_UNMARKED) first. Under xdist's worksteal the last tests of a
    queue run last and the first worker done idles while the other finishes its current test: with
    the 30-80 s tests started early, what is left at the end is seconds long. The same order on
    every worker (it depends on the collection only), as xdist requires."""
    long_modules = {item.path.name for item in items if "slow" in item.keywords or "k8s" in item.keywords}
    rank = {}
    for item in items:
        rank.setdefault(item.path, 0 if _runs_long(item.path.name, item.path.name in long_modules) else 1)
    items.sort(key=lambda item: rank[item.path])  # stable: each module's tests keep their order


def pytest_collection_modifyitems(config, items):
    """Slow modules first (`slow_modules_first`). Without KUBEBUILDER_ASSETS, tests marked `k8s`
    are skipped (one summary line says why)."""
    from tests.control_plane import assets_dir

    slow_modules_first(items)
    if assets_dir() is not None:
        return
    skip = pytest.mark.skip(reason="no real control plane (KUBEBUILDER_ASSETS)")
    for item in items:
        if "k8s" in item.keywords:
            item.add_marker(skip)
            _k8s_skipped.append(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _k8s_skipped:
        from tests.control_plane import ENABLE_HINT

        terminalreporter.write_line(f"k8s: {len(_k8s_skipped)} tests against a real API server skipped: {ENABLE_HINT}")


@pytest.fixture(scope="session")
def control_plane():
    """A real etcd + kube-apiserver + controller-manager + scheduler for the whole session, with
    the spotguard namespace, ServiceAccounts, RBAC and admission policies of `daemonset/base`
    applied (every test's supervisor writes pass through the policies). Tests share it:
    each creates its objects in its own namespace (`k8s_namespace`) or with unique names."""
    from tests.control_plane import start_control_plane

    plane = start_control_plane()
    try:
        plane.apply_base_access()
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def k8s_namespace(control_plane, request):
    """A fresh namespace for one test, deleted after it."""
    import re
    import uuid

    import kubernetes

    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        core.delete_namespace(name, grace_period_seconds=0)


# A real S3-compatible server (SeaweedFS, tests/s3_server.py) for the object-store tests -----------
from tests.s3_server import s3_env, s3_server  # noqa: E402, F401  (fixtures)
