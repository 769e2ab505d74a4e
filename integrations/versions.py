"""The framework versions each integration supports, checked when it is attached."""
from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version

# distribution -> (lowest supported, first unsupported); the extras pin the versions CI runs.
SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.0", "6"),
    "accelerate": ("1.0", "2"),
    "lightning": ("2.4", "3"),
}


class UnsupportedFramework(RuntimeError):
    """The installed framework is missing or of a version the integration was not built for."""


def require(distribution: str, integration: str, installed: str | None = None) -> str:
    """The installed version of `distribution`; raises UnsupportedFramework naming the versions
    `integration` needs when it is missing or outside the supported range. `installed` overrides
    the lookup (tests)."""
    if installed is None:
        try:
            installed = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            installed = None
    return check(distribution, integration, installed)


def check(distribution: str, integration: str, installed: str | None) -> str:
    """Pure: `installed` (None: not installed) against the supported range; see `require`."""
    low, high = SUPPORTED[distribution]
    needed = f"{distribution}>={low},<{high}"
    if installed is None:
        raise UnsupportedFramework(f"{integration} needs {needed}, which is not installed "
                                   f"(pip install 'spotguard[{_extra(distribution)}]')")
    try:
        version = Version(installed)
    except InvalidVersion:
        raise UnsupportedFramework(f"{integration} needs {needed}; found unparsable version {installed!r}") from None
    if not Version(low) <= Version(version.base_version) < Version(high):
        raise UnsupportedFramework(f"{integration} needs {needed}; found {distribution} {installed}")
    return installed


def _extra(distribution: str) -> str:
    return "lightning" if distribution == "lightning" else "hf"
