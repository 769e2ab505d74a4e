"""The interface of an emulated cloud: its routes, and how a scheduled notice looks there."""
from __future__ import annotations

import abc
from typing import Any, ClassVar

from aiohttp import web

from spotguard.emulator.state import EmulatorState


class ScheduleError(ValueError):
    """A schedule request is invalid for this cloud; the message names the field."""


class CloudHandler(abc.ABC):
    """Serves one cloud's metadata paths from an `EmulatorState`.

    `kinds` lists the notice kinds this cloud can show; `schedule_params` validates the
    cloud-specific fields of a schedule request and returns them with defaults filled in.
    """

    name: str = "cloud"
    kinds: tuple[str, ...] = ()
    default_lead: ClassVar[dict[str, float]] = {}
    vm_name: str = "vm-0"

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.state: EmulatorState | None = None

    def bind(self, state: EmulatorState) -> None:
        self.state = state

    @abc.abstractmethod
    def routes(self) -> list[web.RouteDef]:
        """The cloud-facing routes."""

    def schedule_params(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Validates the cloud-specific fields of a schedule request (default: none)."""
        return {}

    def expire_tokens(self) -> None:
        """Invalidates issued session tokens (clouds without tokens: nothing to do)."""

    def malformed_body(self, path: str) -> bytes:
        """A corrupt body shaped like what `path` usually answers (truncated JSON by default)."""
        return b'{"action": "termin'
