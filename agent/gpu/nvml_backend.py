"""The real GPU backend over `pynvml` (module of nvidia-ml-py), imported on first use.

Handles are looked up once at `init()` and kept by index, so an index keeps naming the same
GPU even if `nvmlDeviceGetCount` drops later. Errors are pynvml's own `NVMLError_*` classes;
an absent nvidia-ml-py package is reported as `NVMLError_LibraryNotFound` only if pynvml itself
imports, otherwise as ImportError (a packaging bug, not a machine without GPUs).
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from spotguard.agent.gpu.backend import (FI_GPU_RECOVERY_ACTION, GpuBackend, GpuEvent, RemappedRows)

# nvmlValueType_t -> the union member that holds the value.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NvmlBackend(GpuBackend):
    """GPU reads through NVML. Thread-safe: NVML calls are; the event set is created once."""

    def __init__(self) -> None:
        import pynvml  # lazily: importing needs no driver, but keep the agent light without GPUs

        self.nvml = pynvml
        self._handles: list = []
        self._by_address: dict[int, int] = {}
        self._event_set = None
        self._lock = threading.Lock()
        self._initialised = False

    def init(self) -> None:
        self.nvml.nvmlInit()
        self._initialised = True
        count = self.nvml.nvmlDeviceGetCount()
        self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._by_address = {_address(h): i for i, h in enumerate(self._handles)}

    def shutdown(self) -> None:
        with self._lock:
            if self._event_set is not None:
                try:
                    self.nvml.nvmlEventSetFree(self._event_set)
                except self.nvml.NVMLError:
                    pass
                self._event_set = None
            if self._initialised:
                self._initialised = False
                try:
                    self.nvml.nvmlShutdown()
                except self.nvml.NVMLError:
                    pass

    def device_count(self) -> int:
        return self.nvml.nvmlDeviceGetCount()

    def _handle(self, index: int):
        return self._handles[index]

    def uuid(self, index: int) -> str:
        return _text(self.nvml.nvmlDeviceGetUUID(self._handle(index)))

    def pci_bus_id(self, index: int) -> str:
        return _text(self.nvml.nvmlDeviceGetPciInfo(self._handle(index)).busId)

    def register_events(self, index: int, mask: int) -> int:
        handle = self._handle(index)
        wanted = mask & self.nvml.nvmlDeviceGetSupportedEventTypes(handle)
        if not wanted:
            return 0
        with self._lock:
            if self._event_set is None:
                self._event_set = self.nvml.nvmlEventSetCreate()
            event_set = self._event_set
        self.nvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
        return wanted

    def wait_event(self, timeout_ms: int) -> GpuEvent:
        if self._event_set is None:
            raise self.nvml.NVMLError(self.nvml.NVML_ERROR_UNINITIALIZED)
        data = self.nvml.nvmlEventSetWait(self._event_set, int(timeout_ms))
        return GpuEvent(index=self._by_address.get(_address(data.device)),
                        event_type=int(data.eventType), data=int(data.eventData))

    def remapped_rows(self, index: int) -> RemappedRows:
        corr, unc, pending, failure = self.nvml.nvmlDeviceGetRemappedRows(self._handle(index))
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    def total_ecc_errors(self, index: int) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEccErrors(
            self._handle(index), self.nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.nvml.NVML_VOLATILE_ECC))

    def field_values(self, index: int, field_ids: Sequence[int]) -> dict[int, float | BaseException]:
        values = self.nvml.nvmlDeviceGetFieldValues(self._handle(index), list(field_ids))
        out: dict[int, float | BaseException] = {}
        for value in values:
            if value.nvmlReturn != self.nvml.NVML_SUCCESS:
                out[int(value.fieldId)] = self.nvml.NVMLError(value.nvmlReturn)
            else:
                member = _VALUE_MEMBERS.get(int(value.valueType), "ullVal")
                out[int(value.fieldId)] = getattr(value.value, member)
        return out

    def clock_reasons(self, index: int) -> int:
        return int(self.nvml.nvmlDeviceGetCurrentClocksEventReasons(self._handle(index)))

    def temperature(self, index: int) -> int:
        return int(self.nvml.nvmlDeviceGetTemperature(self._handle(index), self.nvml.NVML_TEMPERATURE_GPU))

    def temperature_threshold(self, index: int, kind: int) -> int:
        return int(self.nvml.nvmlDeviceGetTemperatureThreshold(self._handle(index), kind))


def _address(handle) -> int:
    """The pointer value of a device handle, to map an event's device back to its index."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["FI_GPU_RECOVERY_ACTION", "NvmlBackend"]
