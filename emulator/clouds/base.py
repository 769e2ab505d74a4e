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
    `instance_id` is the emulated VM's id, as the cloud serves it: option `instance_id`, else a
    new random one (`new_instance_id`) for every handler, so every emulated VM is a new instance;
    `replace_instance` re-creates the VM under the same name.
    """

    name: str = "cloud"
    kinds: tuple[str, ...] = ()
    default_lead: ClassVar[dict[str, float]] = {}
    vm_name: str = "vm-0"

    def __init__(self, instance_id: str | None = None, **options: Any) -> None:
        self.options = options
        self.state: EmulatorState | None = None
        self.instance_id = self._checked_instance_id(instance_id) if instance_id is not None else self.new_instance_id()

    @staticmethod
    @abc.abstractmethod
    def new_instance_id() -> str:
        """A new random instance id, in the form this cloud gives them."""

    def replace_instance(self, instance_id: str | None = None) -> str:
        """The VM is re-created under the same name: a new instance id (`instance_id`, else a
        random one). ScheduleError for an id this cloud could not give."""
        self.instance_id = self._checked_instance_id(instance_id) if instance_id is not None else self.new_instance_id()
        return self.instance_id

    @staticmethod
    def _checked_instance_id(value: Any) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= 128 or not value.isprintable() or " " in value:
            raise ScheduleError(f"instance_id: expected a non-empty printable string without spaces, got {value!r:.60}")
        return value

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
