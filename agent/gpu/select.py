"""Turns the agent's `--gpu` flag into a GPU backend (or none).

Values:
- `auto` (default): NVML through nvidia-ml-py; a machine without GPUs runs in "no GPUs" mode;
- `nvml`: the same (named explicitly);
- `off`: no GPU source at all;
- `fake:<scenario file>`: the scriptable fake (dry-run, demos, tests): the test double
  `spotguard.emulator.nvml`, loaded by name when asked for. A product-only install has no
  emulator: the value is then a ConfigError, never an ImportError.
"""
from __future__ import annotations

import importlib

from spotguard.agent.gpu.backend import GpuBackend
from spotguard.config import ConfigError

GPU_CHOICES = ("auto", "nvml", "off", "fake:<scenario file>")
FAKE_BACKEND_MODULE = "spotguard.emulator.nvml"  # a test double; never imported by the product


def make_backend(spec: str | None, field_name: str = "--gpu") -> GpuBackend | None:
    """The backend for `spec`, or None for `off`. ConfigError(field_name) on a bad value."""
    spec = (spec or "auto").strip()
    if spec == "off":
        return None
    if spec in ("auto", "nvml"):
        try:
            from spotguard.agent.gpu.nvml_backend import NvmlBackend

            return NvmlBackend()
        except ImportError:
            if spec == "nvml":
                raise ConfigError(field_name, "nvidia-ml-py is not installed (pip install 'spotguard[gpu]')") from None
            return None
    if spec.startswith("fake:") and len(spec) > 5:
        try:
            fake = importlib.import_module(FAKE_BACKEND_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name not in ("spotguard.emulator", FAKE_BACKEND_MODULE):
                raise
            raise ConfigError(field_name, "the fake NVML backend is a test double, not installed here (a "
                                          "product-only install); use auto, nvml or off") from None
        return fake.FakeGpuBackend.from_scenario(spec[5:], field_name)
    raise ConfigError(field_name, f"expected one of {', '.join(GPU_CHOICES)}, got {spec!r}")
