"""A scriptable fake GPU backend (a test double, beside the cloud metadata emulator): GPUs whose
readings, events and failures a test or a scenario file sets, behind the backend interface
`spotguard.agent.gpu.backend.GpuBackend`, raising the real `pynvml` error classes. Used by tests,
by the dry-run (GPU fault injection) and by `spotguard agent --gpu fake:<scenario>` (which loads
it by name: the product image does not ship it).

Scripting, from code (thread-safe, any thread):
- `set(i, **fields)`: change readings of GPU i (fields of `FakeGpu`);
- `fail(method, error, index=None)` / `heal(method, index=None)`: make a backend method raise
  `error` (a pynvml error, its class name without `NVMLError_`, or its code) until healed;
- `emit(i, event_type, data)`, `xid(i, n)`: deliver an event to the waiter (only if GPU i
  registered for that type, as NVML does);
- `raise_from_wait(error)`: the next `wait_event` raises `error`;
- `lose(i)`: GPU i is lost: all its calls raise GpuIsLost, and so does the next wait;
- `remove(i)`: GPU i fell off the bus: `device_count()` drops, its calls raise GpuIsLost.

Every fake GPU not given a `uuid` gets a new random one (`GPU-<uuid4>`, as NVML names them):
a fake backend is one machine's GPUs, and a machine re-created (the dry-run's new instance)
has new GPUs.

Scenario file (YAML or JSON), loaded with `FakeGpuBackend.from_scenario(path)`:
```yaml
gpus: 2                      # a count, or a list of FakeGpu fields: [{uuid: GPU-a, temperature: 50}]
init_error: null             # e.g. LibraryNotFound: a machine without GPUs
register_error: null         # e.g. NotSupported: no events, the source polls
fail: {field_values: FunctionNotFound}
steps:                       # applied `at` seconds after init()
  - {at: 5, xid: {gpu: 0, xid: 79}}
  - {at: 6, set: {gpu: 1, ecc_uncorrected: 1}}
  - {at: 7, event: {gpu: 0, type: 0x2000}}
  - {at: 8, lose: 1}
  - {at: 9, remove: 1}
  - {at: 10, wait_error: GpuIsLost}
```
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import pynvml

from spotguard.agent.gpu.backend import (EVENT_XID, FI_GPU_RECOVERY_ACTION, THRESHOLD_SHUTDOWN,
                                         THRESHOLD_SLOWDOWN, WANTED_EVENTS, GpuBackend, GpuEvent, RemappedRows)
from spotguard.agent.gpu.datafile import load_data
from spotguard.config import ConfigError

ALL_EVENTS = WANTED_EVENTS | 0x1 | 0x4 | 0x10


@dataclass
class FakeGpu:
    """The state of one fake GPU. Every field can be changed with `FakeGpuBackend.set`."""

    uuid: str
    pci_bus_id: str = "00000000:00:00.0"
    supported_events: int = ALL_EVENTS
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    ecc_uncorrected: int = 0
    recovery_action: int = 0
    clock_reasons: int = 0
    temperature: int = 40
    slowdown_threshold: int = 87
    shutdown_threshold: int = 92
    lost: bool = False
    present: bool = True


def new_gpu_uuid() -> str:
    """A new random GPU UUID in NVML's form."""
    return f"GPU-{uuid.uuid4()}"


def nvml_error(spec: Any) -> pynvml.NVMLError:
    """A real pynvml error from an instance, a class, a name ('GpuIsLost') or a code (15)."""
    if isinstance(spec, pynvml.NVMLError):
        return spec
    if isinstance(spec, type) and issubclass(spec, pynvml.NVMLError):
        return spec()
    if isinstance(spec, int) and not isinstance(spec, bool):
        return pynvml.NVMLError(spec)
    if isinstance(spec, str):
        name = spec if spec.startswith("NVMLError_") else f"NVMLError_{spec}"
        cls = getattr(pynvml, name, None)
        if isinstance(cls, type) and issubclass(cls, pynvml.NVMLError):
            return cls()
    raise ValueError(f"not an NVML error: {spec!r:.60}")


class FakeGpuBackend(GpuBackend):
    """See the module docstring. `gpus`: a count or a list of FakeGpu."""

    def __init__(self, gpus: int | Sequence[FakeGpu] = 1, init_error: Any = None, register_error: Any = None,
                 steps: Sequence[Mapping[str, Any]] = (), clock=time.monotonic):
        if isinstance(gpus, int):
            gpus = [FakeGpu(uuid=new_gpu_uuid(), pci_bus_id=f"00000000:{0x10 + i:02X}:00.0") for i in range(gpus)]
        self.gpus: list[FakeGpu] = list(gpus)
        self.init_error = None if init_error is None else nvml_error(init_error)
        self.register_error = None if register_error is None else nvml_error(register_error)
        self.calls: collections.Counter = collections.Counter()
        self.initialised = False
        self.registered: dict[int, int] = {}
        self._failures: dict[tuple[str, int | None], pynvml.NVMLError] = {}
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._steps = sorted((_step_time(s), i, dict(s)) for i, s in enumerate(steps))
        self._clock = clock
        self._started: float | None = None

    # ---- scripting -------------------------------------------------------------------------
    def set(self, index: int, **fields: Any) -> None:
        with self._cond:
            gpu = self.gpus[index]
            for name, value in fields.items():
                if not hasattr(gpu, name):
                    raise AttributeError(f"FakeGpu has no field {name!r}")
                setattr(gpu, name, value)

    def fail(self, method: str, error: Any, index: int | None = None) -> None:
        with self._cond:
            self._failures[(method, index)] = nvml_error(error)

    def heal(self, method: str, index: int | None = None) -> None:
        with self._cond:
            self._failures.pop((method, index), None)

    def emit(self, index: int | None, event_type: int, data: int = 0) -> None:
        with self._cond:
            self._queue.append(GpuEvent(index, event_type, data))
            self._cond.notify_all()

    def xid(self, index: int, xid: int) -> None:
        self.emit(index, EVENT_XID, xid)

    def raise_from_wait(self, error: Any) -> None:
        with self._cond:
            self._queue.append(nvml_error(error))
            self._cond.notify_all()

    def lose(self, index: int) -> None:
        with self._cond:
            self.gpus[index].lost = True
            if self.registered:
                self._queue.append(pynvml.NVMLError_GpuIsLost())
            self._cond.notify_all()

    def remove(self, index: int) -> None:
        with self._cond:
            self.gpus[index].present = False
            self.gpus[index].lost = True

    # ---- scenario files --------------------------------------------------------------------
    @classmethod
    def from_scenario(cls, source: str | Path | Mapping[str, Any], field_name: str = "--gpu") -> FakeGpuBackend:
        """Builds a fake from a scenario (a YAML/JSON file path or a dict); ConfigError(field_name)
        names what is wrong."""
        if isinstance(source, Mapping):
            data = source
        else:
            data = load_data(source, field_name)
        if not isinstance(data, Mapping):
            raise ConfigError(field_name, "GPU scenario: expected a mapping at the top")
        try:
            gpus_spec = data.get("gpus", 1)
            if isinstance(gpus_spec, int) and not isinstance(gpus_spec, bool) and gpus_spec >= 0:
                gpus: int | list[FakeGpu] = gpus_spec
            elif isinstance(gpus_spec, list):
                gpus = [FakeGpu(**({"uuid": new_gpu_uuid()} | dict(g))) for g in gpus_spec]
            else:
                raise ValueError(f"gpus: expected a count or a list, got {gpus_spec!r:.40}")
            steps = data.get("steps") or []
            if not isinstance(steps, list) or not all(isinstance(s, Mapping) for s in steps):
                raise ValueError("steps: expected a list of mappings")
            for step in steps:
                _step_time(step)
                _check_step(step)
            fake = cls(gpus, init_error=data.get("init_error"), register_error=data.get("register_error"), steps=steps)
            for method, error in (data.get("fail") or {}).items():
                if not hasattr(GpuBackend, method):
                    raise ValueError(f"fail: {method!r} is not a backend method")
                fake.fail(method, error)
        except (TypeError, ValueError) as exc:
            raise ConfigError(field_name, f"GPU scenario: {exc}") from None
        return fake

    # ---- GpuBackend ------------------------------------------------------------------------
    def init(self) -> None:
        self._enter("init")
        if self.init_error is not None:
            raise self.init_error
        with self._cond:
            self.initialised = True
            self._started = self._clock()

    def shutdown(self) -> None:
        with self._cond:
            self.calls["shutdown"] += 1
            self.initialised = False
            self.registered.clear()
            self._cond.notify_all()

    def device_count(self) -> int:
        self._enter("device_count")
        return sum(1 for g in self.gpus if g.present)

    def uuid(self, index: int) -> str:
        return self._gpu("uuid", index).uuid

    def pci_bus_id(self, index: int) -> str:
        return self._gpu("pci_bus_id", index).pci_bus_id

    def register_events(self, index: int, mask: int) -> int:
        gpu = self._gpu("register_events", index)
        if self.register_error is not None:
            raise self.register_error
        wanted = mask & gpu.supported_events
        if not gpu.supported_events:
            raise pynvml.NVMLError_NotSupported()
        with self._cond:
            self.registered[index] = self.registered.get(index, 0) | wanted
        return wanted

    def wait_event(self, timeout_ms: int) -> GpuEvent:
        self._enter("wait_event")
        deadline = self._clock() + timeout_ms / 1000.0
        with self._cond:
            while True:
                self._apply_due_steps()
                while self._queue:
                    item = self._queue.popleft()
                    if isinstance(item, pynvml.NVMLError):
                        raise item
                    if item.index is None or self.registered.get(item.index, 0) & item.event_type:
                        return item
                if not self.initialised:
                    raise pynvml.NVMLError_Uninitialized()
                now = self._clock()
                if now >= deadline:
                    raise pynvml.NVMLError_Timeout()
                wake = deadline
                if self._steps and self._started is not None:
                    wake = min(wake, self._started + self._steps[0][0])
                self._cond.wait(max(0.0, wake - now))

    def remapped_rows(self, index: int) -> RemappedRows:
        g = self._gpu("remapped_rows", index)
        return RemappedRows(g.remapped_correctable, g.remapped_uncorrectable, g.remap_pending, g.remap_failure)

    def total_ecc_errors(self, index: int) -> int:
        return self._gpu("total_ecc_errors", index).ecc_uncorrected

    def field_values(self, index: int, field_ids: Sequence[int]) -> dict[int, float | BaseException]:
        g = self._gpu("field_values", index)
        known = {FI_GPU_RECOVERY_ACTION: g.recovery_action}
        return {fid: known.get(fid, pynvml.NVMLError_NotSupported()) for fid in field_ids}

    def clock_reasons(self, index: int) -> int:
        return self._gpu("clock_reasons", index).clock_reasons

    def temperature(self, index: int) -> int:
        return self._gpu("temperature", index).temperature

    def temperature_threshold(self, index: int, kind: int) -> int:
        g = self._gpu("temperature_threshold", index)
        if kind == THRESHOLD_SHUTDOWN:
            return g.shutdown_threshold
        if kind == THRESHOLD_SLOWDOWN:
            return g.slowdown_threshold
        raise pynvml.NVMLError_InvalidArgument()

    # ---- internals -------------------------------------------------------------------------
    def _enter(self, method: str, index: int | None = None) -> None:
        with self._cond:
            self.calls[method] += 1
            self._apply_due_steps()
            error = self._failures.get((method, index)) or self._failures.get((method, None))
            if error is None and method != "init" and not self.initialised:
                error = pynvml.NVMLError_Uninitialized()
        if error is not None:
            raise error

    def _gpu(self, method: str, index: int) -> FakeGpu:
        self._enter(method, index)
        with self._cond:
            if not 0 <= index < len(self.gpus):
                raise pynvml.NVMLError_InvalidArgument()
            gpu = self.gpus[index]
            if gpu.lost:
                raise pynvml.NVMLError_GpuIsLost()
            return gpu

    def _apply_due_steps(self) -> None:
        """Runs the scenario steps whose time has come (caller holds the lock)."""
        if self._started is None:
            return
        elapsed = self._clock() - self._started
        while self._steps and self._steps[0][0] <= elapsed:
            _, _, step = self._steps.pop(0)
            self._run_step(step)

    def _run_step(self, step: dict[str, Any]) -> None:
        if "xid" in step:
            self._queue.append(GpuEvent(int(step["xid"]["gpu"]), EVENT_XID, int(step["xid"]["xid"])))
        if "event" in step:
            ev = step["event"]
            self._queue.append(GpuEvent(ev.get("gpu"), _int(ev["type"]), _int(ev.get("data", 0))))
        if "set" in step:
            fields = dict(step["set"])
            gpu = self.gpus[int(fields.pop("gpu"))]
            for name, value in fields.items():
                setattr(gpu, name, value)
        if "lose" in step:
            self.gpus[int(step["lose"])].lost = True
            if self.registered:
                self._queue.append(pynvml.NVMLError_GpuIsLost())
        if "remove" in step:
            gpu = self.gpus[int(step["remove"])]
            gpu.present, gpu.lost = False, True
        if "wait_error" in step:
            self._queue.append(nvml_error(step["wait_error"]))
        self._cond.notify_all()


_STEP_KEYS = {"at", "xid", "event", "set", "lose", "remove", "wait_error"}
_GPU_FIELDS = {f.name for f in dataclasses.fields(FakeGpu)}


def _step_time(step: Mapping[str, Any]) -> float:
    at = step.get("at", 0)
    if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0:
        raise ValueError(f"steps: 'at' must be seconds >= 0, got {at!r:.30}")
    return float(at)


def _check_step(step: Mapping[str, Any]) -> None:
    unknown = set(step) - _STEP_KEYS
    if unknown:
        raise ValueError(f"steps: unknown keys {sorted(unknown)}")
    if "set" in step and (not isinstance(step["set"], Mapping) or "gpu" not in step["set"]
                          or set(step["set"]) - _GPU_FIELDS - {"gpu"}):
        raise ValueError(f"steps: set needs 'gpu' and FakeGpu fields, got {step['set']!r:.80}")
    if "wait_error" in step:
        nvml_error(step["wait_error"])
    if "xid" in step and (not isinstance(step["xid"], Mapping) or {"gpu", "xid"} - set(step["xid"])):
        raise ValueError("steps: xid needs {gpu, xid}")
    if "event" in step and (not isinstance(step["event"], Mapping) or "type" not in step["event"]):
        raise ValueError("steps: event needs a type")


def _int(value: Any) -> int:
    return int(value, 0) if isinstance(value, str) else int(value)
