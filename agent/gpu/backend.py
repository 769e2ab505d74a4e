"""The GPU backend interface: the handful of NVML reads the GPU health source needs.

Contract for every implementation:
- devices are addressed by their index at `init()` time (0..device_count()-1 then); an index
  keeps naming the same GPU for the life of the backend, even if the device count drops later;
- every failure raises a real `pynvml.NVMLError` subclass (`NVMLError_LibraryNotFound`,
  `NVMLError_NotSupported`, `NVMLError_FunctionNotFound`, `NVMLError_GpuIsLost`,
  `NVMLError_Timeout`...), exactly as NVML would;
- `wait_event` blocks for up to `timeout_ms` and raises `NVMLError_Timeout` when nothing came;
  it is only ever called from one thread (the source's waiter), while the read calls may run
  concurrently on another thread: implementations must be thread-safe.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from collections.abc import Sequence

# Event type bits (nvmlEventType*), copied so that importing this module needs no pynvml.
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID = 0x8
EVENT_CLOCK = 0x10
EVENT_SBE_STORM = 0x200
EVENT_DRAM_RETIREMENT = 0x400
EVENT_DRAM_RETIREMENT_FAILURE = 0x800
EVENT_NONFATAL_POISON = 0x1000
EVENT_FATAL_POISON = 0x2000
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_RECOVERY_ACTION = 0x8000

# The events the health source registers for (the fatal ones, Xid, ECC, retirement, recovery).
WANTED_EVENTS = (EVENT_DOUBLE_BIT_ECC | EVENT_XID | EVENT_SBE_STORM | EVENT_DRAM_RETIREMENT
                 | EVENT_DRAM_RETIREMENT_FAILURE | EVENT_NONFATAL_POISON | EVENT_FATAL_POISON
                 | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION)

# Field ids and values (NVML_FI_*, NVML_GPU_RECOVERY_ACTION_*).
FI_GPU_RECOVERY_ACTION = 230
RECOVERY_ACTIONS = {0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P", 4: "DRAIN_AND_RESET",
                    5: "RECOVER_IMEX_DOMAIN", 6: "BUS_RESET", 7: "SYSTEM_REBOOT"}

# nvmlDeviceGetTemperatureThreshold kinds.
THRESHOLD_SHUTDOWN = 0
THRESHOLD_SLOWDOWN = 1

# Clock-event (throttle) reason bits worth a warning.
CLOCK_HW_SLOWDOWN = 0x8
CLOCK_HW_THERMAL_SLOWDOWN = 0x40
CLOCK_HW_POWER_BRAKE_SLOWDOWN = 0x80
CLOCK_REASON_NAMES = {CLOCK_HW_SLOWDOWN: "HwSlowdown", CLOCK_HW_THERMAL_SLOWDOWN: "HwThermalSlowdown",
                      CLOCK_HW_POWER_BRAKE_SLOWDOWN: "HwPowerBrakeSlowdown"}


@dataclass(frozen=True)
class GpuEvent:
    """One NVML event: the device index it concerns (None if unknown), its type bit and data
    (the Xid number for EVENT_XID)."""

    index: int | None
    event_type: int
    data: int = 0


@dataclass(frozen=True)
class RemappedRows:
    """nvmlDeviceGetRemappedRows: correctable / uncorrectable remapped rows, pending, failure."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class GpuBackend(abc.ABC):
    """The NVML operations the GPU health source uses. See the module docstring."""

    @abc.abstractmethod
    def init(self) -> None:
        """Initialises the library (nvmlInit). NVMLError_LibraryNotFound / DriverNotLoaded
        mean this machine has no usable GPU."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases the event set and the library. Safe to call twice."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """The number of GPUs NVML sees now."""

    @abc.abstractmethod
    def uuid(self, index: int) -> str:
        """The GPU's UUID (e.g. 'GPU-8a5b...')."""

    @abc.abstractmethod
    def pci_bus_id(self, index: int) -> str:
        """The GPU's PCI bus id (e.g. '00000000:10:1C.0'), which kernel-log Xid lines name."""

    @abc.abstractmethod
    def register_events(self, index: int, mask: int) -> int:
        """Registers the device for `mask & supported` events in the backend's one event set;
        returns the mask actually registered (0: nothing). NVMLError_NotSupported when the
        device supports no events at all."""

    @abc.abstractmethod
    def wait_event(self, timeout_ms: int) -> GpuEvent:
        """Waits for the next event of any registered device; NVMLError_Timeout if none came."""

    @abc.abstractmethod
    def remapped_rows(self, index: int) -> RemappedRows:
        """Row-remapping state (Ampere and later)."""

    @abc.abstractmethod
    def total_ecc_errors(self, index: int) -> int:
        """Volatile uncorrected (double-bit) ECC error count since the last driver load/reset."""

    @abc.abstractmethod
    def field_values(self, index: int, field_ids: Sequence[int]) -> dict[int, float | BaseException]:
        """nvmlDeviceGetFieldValues: field id -> value, or the NVMLError of that one field."""

    @abc.abstractmethod
    def clock_reasons(self, index: int) -> int:
        """Current clock-event (throttle) reason bits."""

    @abc.abstractmethod
    def temperature(self, index: int) -> int:
        """GPU core temperature, degrees C."""

    @abc.abstractmethod
    def temperature_threshold(self, index: int, kind: int) -> int:
        """The driver's per-SKU threshold (THRESHOLD_SLOWDOWN / THRESHOLD_SHUTDOWN), degrees C."""
