"""Signal readers of the GPU source: the persistent NVML signals of every GPU, as findings.

Contract: `SignalReaders(backend, policy, errors, log_once, lost).read_all(gpus, expected_count)`
(blocking: run it in a thread) reads, for every GPU not known lost: remapped rows (failure,
uncorrectable count vs the policy threshold, pending), volatile double-bit ECC, the recovery-action
field, clock-event reasons (masked by the policy), temperature vs the driver's SLOWDOWN/SHUTDOWN
thresholds (read once per GPU); and the GPU count vs `expected_count`. It returns the findings and
the GPUs lost. GpuIsLost from a read adds the GPU to `lost` (a set shared with the source);
NotSupported/FunctionNotFound skips that signal on that GPU for good (logged once); another NVML
error counts in `errors` and repeats that signal's last findings. Which finding is fatal or a
warning is the policy's business, not the readers'.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from spotguard.agent.gpu import backend as gb
from spotguard.agent.gpu.policy import GpuPolicy

log = logging.getLogger("spotguard.agent.sources.gpu")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Finding:
    """One signal seen on one GPU (gpu None: the node as a whole)."""

    gpu: Gpu | None
    signal: str
    value: Any = None
    detail: dict = field(default_factory=dict)


@dataclass
class ReadResult:
    findings: list[Finding]
    lost: list[Gpu]


def error_name(exc: BaseException) -> str:
    """A metrics label for an NVML (or other) error: "gpuislost", "timeout", ..."""
    name = type(exc).__name__
    return name.removeprefix("NVMLError_").lower() if name.startswith("NVMLError") else name.lower()


class SignalReaders:
    """See the module docstring."""

    def __init__(self, backend: gb.GpuBackend, policy: GpuPolicy, errors: Any,
                 log_once: Callable[..., None], lost: set[int]):
        self.backend = backend
        self.policy = policy
        self.errors = errors
        self.lost = lost
        self._log_once = log_once
        self._cache: dict[tuple[int, str], list[Finding]] = {}
        self._disabled: set[tuple[int, str]] = set()
        self._thresholds: dict[int, tuple[int, int]] = {}

    def read_all(self, gpus: list[Gpu], expected_count: int | None) -> ReadResult:
        """Blocking (run it in a thread): every persistent signal of every GPU."""
        import pynvml as nvml

        findings: list[Finding] = []
        lost: list[Gpu] = []
        try:
            count = self.backend.device_count()
        except nvml.NVMLError as exc:
            self.errors[f"nvml_{error_name(exc)}"] += 1
            count = None
        if count is not None and expected_count is not None and count < expected_count:
            findings.append(Finding(None, "gpu_count_drop", expected_count,
                                    {"count": count, "expected": expected_count}))
        for gpu in gpus:
            if gpu.index in self.lost:
                lost.append(gpu)
                continue
            for reader_name, reader in self._readers():
                key = (gpu.index, reader_name)
                if key in self._disabled:
                    continue
                try:
                    found = reader(gpu)
                except nvml.NVMLError_GpuIsLost:
                    self.lost.add(gpu.index)
                    lost.append(gpu)
                    break
                except (nvml.NVMLError_FunctionNotFound, nvml.NVMLError_NotSupported) as exc:
                    self._disabled.add(key)
                    self._log_once(f"skip:{key}", logging.WARNING, "gpu %s: %s unavailable (%s): signal skipped",
                                   gpu.uuid, reader_name, exc)
                    found = []
                except nvml.NVMLError as exc:
                    self.errors[f"nvml_{error_name(exc)}"] += 1
                    log.warning("gpu %s: reading %s failed: %s", gpu.uuid, reader_name, exc)
                    found = self._cache.get(key, [])
                except Exception:
                    log.exception("gpu %s: reading %s failed", gpu.uuid, reader_name)
                    self.errors["internal"] += 1
                    found = self._cache.get(key, [])
                self._cache[key] = found
                findings.extend(found)
        return ReadResult(findings, lost)

    def _readers(self):
        return (("remapped_rows", self._read_remap), ("ecc", self._read_ecc), ("recovery_action", self._read_recovery),
                ("clock_reasons", self._read_clocks), ("temperature", self._read_thermal))

    def _read_remap(self, gpu: Gpu) -> list[Finding]:
        rows = self.backend.remapped_rows(gpu.index)
        out = []
        counts = {"correctable": rows.correctable, "uncorrectable": rows.uncorrectable}
        if rows.failure:
            out.append(Finding(gpu, "remap_failure", None, counts))
        if rows.uncorrectable >= self.policy.thresholds["uncorrectable_rows"]:
            out.append(Finding(gpu, "uncorrectable_rows", None, counts))
        if rows.pending:
            out.append(Finding(gpu, "remap_pending", None, counts))
        return out

    def _read_ecc(self, gpu: Gpu) -> list[Finding]:
        count = self.backend.total_ecc_errors(gpu.index)
        return [Finding(gpu, "double_bit_ecc", None, {"volatile_uncorrected": count})] if count > 0 else []

    def _read_recovery(self, gpu: Gpu) -> list[Finding]:
        value = self.backend.field_values(gpu.index, [gb.FI_GPU_RECOVERY_ACTION]).get(gb.FI_GPU_RECOVERY_ACTION)
        if isinstance(value, BaseException):
            raise value
        if value is None or int(value) == 0:
            return []
        name = gb.RECOVERY_ACTIONS.get(int(value), f"UNKNOWN_{int(value)}")
        return [Finding(gpu, "recovery_action", name, {"recovery_action": name, "code": int(value)})]

    def _read_clocks(self, gpu: Gpu) -> list[Finding]:
        bits = self.backend.clock_reasons(gpu.index) & self.policy.thresholds["clock_reasons_mask"]
        if not bits:
            return []
        names = [name for bit, name in gb.CLOCK_REASON_NAMES.items() if bits & bit] or [hex(bits)]
        return [Finding(gpu, "clock_slowdown", None, {"reasons": names})]

    def _read_thermal(self, gpu: Gpu) -> list[Finding]:
        if gpu.index not in self._thresholds:
            self._thresholds[gpu.index] = (self.backend.temperature_threshold(gpu.index, gb.THRESHOLD_SLOWDOWN),
                                           self.backend.temperature_threshold(gpu.index, gb.THRESHOLD_SHUTDOWN))
        slowdown, shutdown = self._thresholds[gpu.index]
        temp = self.backend.temperature(gpu.index)
        detail = {"temperature_c": temp, "slowdown_c": slowdown, "shutdown_c": shutdown}
        if shutdown > 0 and temp >= shutdown - self.policy.thresholds["shutdown_margin_c"]:
            return [Finding(gpu, "thermal_shutdown", None, detail)]
        if slowdown > 0 and temp >= slowdown:
            return [Finding(gpu, "thermal_slowdown", None, detail)]
        return []
