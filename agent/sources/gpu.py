"""The GPU health source ("gpu"): NVML events and persistent readings -> gpu-fault notices.

How it watches (all NVML calls run in threads, never on the event loop); the parts are
`agent/gpu/event_waiter.py` (the waiter thread), `agent/gpu/readers.py` (the persistent
signals) and `agent/gpu/policy.py` (what each signal means):
- a waiter thread blocks in `wait_event` (timeout `wait_timeout_ms`; a Timeout is normal) on
  the Xid, ECC, retirement, poison, unavailable and recovery-action events of every GPU, and
  hands each event to the loop through an asyncio queue;
- every `interval` seconds (and at once after an event that calls for it) a read of the
  persistent signals: GPU count vs expected, volatile double-bit ECC, remapped rows (failure,
  uncorrectable count, pending), the recovery-action field, clock-event reasons, temperature vs
  the driver's SLOWDOWN/SHUTDOWN thresholds;
- `GpuPolicy` (data) says what each Xid / signal means: ignore, warn, cordon, fatal, recovery.

What it reports:
- fatal -> a `Notice` of kind gpu-fault, deadline = when first seen, id = notice_id("gpu", node,
  boot id, gpu uuid, signal, value) where value is the Xid (signal "xid"), the recovery action
  name, the expected GPU count, or empty. Event-borne faults (an Xid, GpuIsLost, poison) stay
  live for the life of the process (the GPU needs a reset or a reboot, which restarts the agent);
  faults read from persistent counters stay live while the counter shows them. Because those
  counters survive an agent restart, a still-failed GPU yields the same notice id again after a
  restart.
- warn/cordon -> an ADVISORY notice (`Severity.ADVISORY`: information, never a reason to act)
  of kind gpu-fault, deadline None, id = notice_id("gpu", node, boot id, gpu uuid, signal,
  "advisory"),
  detail = `warning_detail()` (with `"cordon": true` for a cordon), frozen at first sight; and
  `warnings[reason] += 1` (the agent's metrics). An advisory read from a persistent signal is
  live while the reading shows the condition and withdrawn when it clears; an event-borne one
  (an Xid) is live until `advisory_hold` seconds after its latest event. Event warnings count
  per event; persistent ones when the condition appears (again only after it cleared).

The instance part of the ids is the machine's boot id (`/proc/sys/kernel/random/boot_id`, the
host kernel's even in a container; read once at start), not the cloud's instance id: the GPU
uuid already names the device, but a VM re-created under the same name may get the same
physical GPU, and node-wide findings (a GPU count drop, a lost GPU no call names) have no uuid.
A re-created VM is a new boot, and an agent restarted on the same boot keeps its ids. A reboot
of the same VM gives new ids too, on purpose: a fault still read after a reboot threatens a job
that resumed after it, whatever checkpoint answered it before. An unreadable boot id: the
fallback instance part (`instance.py`), counted as `instance_id:<reason>`.

Degraded modes: without NVML (LibraryNotFound / DriverNotLoaded at init, or no GPU) it logs
"no GPUs" once and yields nothing; NotSupported/FunctionNotFound on event registration or from
the wait -> polling only; FunctionNotFound/NotSupported on a read -> that signal is skipped
for that GPU, logged once; GpuIsLost from any call or from the wait -> a fatal notice (from the
wait, the GPUs are probed to name the lost one; "unknown" if none answers so).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.agent.gpu import backend as gb
from spotguard.agent.gpu.event_waiter import EventWaiter
from spotguard.agent.gpu.readers import Finding, Gpu, SignalReaders, error_name
from spotguard.agent.gpu.policy import GpuPolicy
from spotguard.wire.notice import Kind, Notice, Severity, notice_id, now_utc
from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.instance import BOOT_ID_PATH, FALLBACK, read_boot_id
from spotguard.backoff import Backoff

log = logging.getLogger(__name__)

# Event bit -> the signal it carries (Xid and the "read now" events are handled apart).
_EVENT_SIGNALS = {
    gb.EVENT_FATAL_POISON: "fatal_poison",
    gb.EVENT_GPU_UNAVAILABLE: "gpu_unavailable",
    gb.EVENT_DRAM_RETIREMENT_FAILURE: "dram_retirement_failure",
    gb.EVENT_DRAM_RETIREMENT: "dram_retirement",
    gb.EVENT_SBE_STORM: "sbe_storm",
    gb.EVENT_NONFATAL_POISON: "nonfatal_poison",
}
# Events after which the persistent signals are read at once.
_READ_NOW_EVENTS = gb.EVENT_DOUBLE_BIT_ECC | gb.EVENT_RECOVERY_ACTION | gb.EVENT_DRAM_RETIREMENT


class GpuHealthSource(Source):
    """See the module docstring. `backend` None means NVML (`NvmlBackend`, lazily)."""

    name = "gpu"

    def __init__(self, node: str, backend: gb.GpuBackend | None = None, policy: GpuPolicy | None = None,
                 interval: float = 5.0, *, expected_count: int | None = None,
                 wait_timeout_ms: int = 500, advisory_hold: float = 600.0, boot_id_path: str = BOOT_ID_PATH):
        if not interval > 0 or wait_timeout_ms <= 0 or not advisory_hold > 0:
            raise ValueError("GpuHealthSource needs interval > 0, wait_timeout_ms > 0 and advisory_hold > 0")
        super().__init__(node, interval=0.0, backoff=Backoff(base=1.0, cap=60.0))
        self.read_interval = interval
        self.backend = backend
        self.policy = policy or GpuPolicy()
        self.expected_count = expected_count
        self.advisory_hold = advisory_hold
        self.wait_timeout_ms = wait_timeout_ms
        self.boot_id_path = boot_id_path
        self.origin = Origin(self.name, node, FALLBACK)  # the instance part is read at start
        self.warnings: collections.Counter = collections.Counter()
        self.seen: collections.Counter = collections.Counter()  # events and xids, e.g. "xid:13"
        self.available: bool | None = None  # None: not started yet; False: no GPUs
        self.mode = "starting"  # events | polling | none
        self.gpus: list[Gpu] = []
        self._sticky: dict[str, Notice] = {}
        self._level: dict[str, Notice] = {}
        self._level_advisories: dict[str, Notice] = {}  # from persistent signals, by id
        self._event_advisories: dict[str, tuple[Notice, float]] = {}  # id -> (notice, monotonic expiry)
        self._xid_times: dict[tuple[str, int], collections.deque] = {}
        self._readers: SignalReaders | None = None
        self._log_once = LogOnce(log)
        self._lost: set[int] = set()
        self._lost_reported: set[int] = set()
        self._registered: dict[int, int] = {}
        self._events: asyncio.Queue | None = None
        self._waiter: EventWaiter | None = None
        self._next_read = 0.0
        self._wait_lost = False

    # ---- Source ------------------------------------------------------------------------------
    async def poll(self) -> list[Notice]:
        loop = asyncio.get_running_loop()
        if self.available is None:
            await self._start()
            if self.available:
                await self._read()
            return self._current()
        if not self.available:
            await asyncio.sleep(self.read_interval)
            return []
        _backend, events, _readers = self._ready()
        timeout = self._next_read - loop.time()
        if timeout > 0:
            try:
                first = await asyncio.wait_for(events.get(), timeout)
            except TimeoutError:
                first = None
            if first is not None:
                batch = [first]
                while not events.empty():
                    batch.append(events.get_nowait())
                if self._handle_events(batch):
                    await self._read()
                return self._current()
        await self._read()
        return self._current()

    async def close(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            await asyncio.to_thread(waiter.stop, self.wait_timeout_ms / 1000.0 + 5.0)
        if self.backend is not None and self.available:
            await asyncio.to_thread(self.backend.shutdown)

    # ---- start -------------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            _pynvml()  # the error classes, even for a fake backend
        except ImportError:
            self._no_gpus("nvidia-ml-py is not installed")
            return
        if self.backend is None:
            from spotguard.agent.gpu.nvml_backend import NvmlBackend

            self.backend = NvmlBackend()
        self._events = asyncio.Queue()
        self._readers = SignalReaders(self.backend, self.policy, self.stats.errors, self._log_once, self._lost)
        outcome = await asyncio.to_thread(self._setup)
        if outcome is not None:
            self._no_gpus(outcome)
            return
        self.available = True
        self._next_read = asyncio.get_running_loop().time()
        if any(self._registered.values()):
            self.mode = "events"
            loop = asyncio.get_running_loop()
            self._waiter = EventWaiter(self.backend, self.wait_timeout_ms, functools.partial(self._post, loop))
            self._waiter.start()
        else:
            self.mode = "polling"
            self._log_once("polling", logging.WARNING, "gpu: no NVML events available; polling every %.1fs",
                           self.read_interval)

    def _setup(self) -> str | None:
        """Runs in a thread: init, enumerate, register events. Returns a reason for "no GPUs",
        None when ready; raises SourceError when init failed in a way worth retrying."""
        nvml = _pynvml()
        backend, _events, _readers = self._ready()
        try:
            backend.init()
        except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as exc:
            return f"NVML unavailable ({exc})"
        except nvml.NVMLError as exc:
            raise SourceError(f"nvml_{error_name(exc)}", f"nvmlInit failed: {exc}") from None
        gpus = enumerate_gpus(backend, self._lost)
        if not gpus:
            backend.shutdown()
            return "NVML sees no GPU"
        self.gpus = gpus
        if self.expected_count is None:
            self.expected_count = len(gpus)
        self.origin = Origin(self.name, self.node, read_boot_id(self.boot_id_path, self.stats.errors))
        self._registered = {}
        for gpu in gpus:
            if gpu.index in self._lost:
                continue
            try:
                self._registered[gpu.index] = backend.register_events(gpu.index, gb.WANTED_EVENTS)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as exc:
                self._log_once(f"register:{gpu.index}", logging.WARNING,
                               "gpu %s: event registration unavailable (%s): polling it", gpu.uuid, exc)
                self._registered[gpu.index] = 0
            except nvml.NVMLError_GpuIsLost:
                self._lost.add(gpu.index)
            except nvml.NVMLError as exc:
                self.stats.errors[f"nvml_{error_name(exc)}"] += 1
                log.warning("gpu %s: event registration failed (%s): polling it", gpu.uuid, exc)
                self._registered[gpu.index] = 0
        log.info("gpu: %d GPU(s), events on %d", len(gpus), sum(1 for m in self._registered.values() if m))
        return None

    def _ready(self) -> tuple[gb.GpuBackend, asyncio.Queue, SignalReaders]:
        """The backend, event queue and readers `_start` sets up (before `_setup` runs); a clear
        error for a method called before it."""
        if self.backend is None or self._events is None or self._readers is None:
            raise RuntimeError("GpuHealthSource: used before _start() set up its backend, queue and readers")
        return self.backend, self._events, self._readers

    def _no_gpus(self, why: str) -> None:
        self.available = False
        self.mode = "none"
        self._log_once("no-gpus", logging.INFO, "gpu: no GPUs (%s); the GPU source stays idle", why)

    def _post(self, loop: asyncio.AbstractEventLoop, item: Any) -> bool:
        """From the waiter thread: hands `item` to the loop; False once the loop is closed."""
        _backend, events, _readers = self._ready()
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed: the agent is gone
            return False

    # ---- events ------------------------------------------------------------------------------
    def _handle_events(self, batch: list) -> bool:
        """Applies a batch of waiter items; True when the persistent signals should be read now."""
        read_now = False
        for item in batch:
            if isinstance(item, gb.GpuEvent):
                read_now |= self._handle_event(item)
            elif item[0] == "lost":
                self._wait_lost = True
                read_now = True
            elif item[0] == "polling":
                self.mode = "polling"
                self._log_once("polling", logging.WARNING, "gpu: event wait unavailable (%s): polling", item[1])
            else:
                self.stats.errors[f"nvml_wait_{error_name(item[1])}"] += 1
                log.warning("gpu: event wait failed: %s", item[1])
        return read_now

    def _handle_event(self, event: gb.GpuEvent) -> bool:
        gpu = self._gpu(event.index)
        read_now = bool(event.event_type & _READ_NOW_EVENTS)
        if event.event_type & gb.EVENT_XID:
            read_now |= self._handle_xid(gpu, event.data)
        for bit, signal in _EVENT_SIGNALS.items():
            if event.event_type & bit:
                self.seen[f"event:{signal}"] += 1
                self._apply(Finding(gpu, signal), self.policy.signal_action(signal))
        return read_now

    def _handle_xid(self, gpu: Gpu | None, xid: int) -> bool:
        self.seen[f"xid:{xid}"] += 1
        rule = self.policy.xid_rule(xid)
        action, remedy = rule.action, rule.remedy
        detail = {"xid": xid, "meaning": rule.meaning, "remedy": remedy}
        escalation = self.policy.escalate.get(xid)
        if escalation is not None and action in ("warn", "cordon"):
            times = self._xid_times.setdefault((gpu.uuid if gpu else "unknown", xid), collections.deque())
            now = time.monotonic()
            times.append(now)
            while times and now - times[0] > escalation.window_seconds:
                times.popleft()
            if len(times) >= escalation.count:
                action = "fatal"
                detail.update(remedy="drain", escalated=f"{len(times)} times within {escalation.window_seconds:g}s")
        if action == "recovery":
            return True
        if action == "fatal":
            self._apply(Finding(gpu, "xid", xid, detail), "fatal")
        elif action in ("warn", "cordon"):
            self._apply(Finding(gpu, f"xid_{xid}", None, detail), action)
        return False

    # ---- periodic reads ----------------------------------------------------------------------
    async def _read(self) -> None:
        self._next_read = asyncio.get_running_loop().time() + self.read_interval
        _backend, _events, readers = self._ready()
        result = await asyncio.to_thread(readers.read_all, self.gpus, self.expected_count)
        for gpu in result.lost:
            if gpu.index not in self._lost_reported:
                self._lost_reported.add(gpu.index)
                self._apply(Finding(gpu, "gpu_lost"), self.policy.signal_action("gpu_lost"))
        if self._wait_lost:
            self._wait_lost = False
            if not result.lost and not self._lost_notice_live():
                self._apply(Finding(None, "gpu_lost", None, {"from": "nvmlEventSetWait"}),
                            self.policy.signal_action("gpu_lost"))
        level: dict[str, Notice] = {}
        advisories: dict[str, Notice] = {}
        for finding in result.findings:
            action = self.policy.signal_action(finding.signal)
            if action == "fatal":
                notice = self._notice(finding, previous=self._level)
                level[notice.id] = notice
            elif action in ("warn", "cordon"):
                advisory = self._level_advisories.get(advisory_notice_id(self.origin, finding))
                if advisory is None:
                    advisory = self._warn(finding, action)
                advisories[advisory.id] = advisory
        for notice in level.values():
            if notice.id not in self._level and notice.id not in self._sticky:
                log.warning("gpu: fault %s (%s)", notice.detail.get("signal"), notice.detail.get("gpu"),
                            extra={"notice_id": notice.id})
        self._level = level
        self._level_advisories = advisories

    # ---- results -----------------------------------------------------------------------------
    def _apply(self, finding: Finding, action: str) -> None:
        """An event-borne finding: a sticky notice (fatal) or a warning (warn/cordon)."""
        if action == "fatal":
            notice = self._notice(finding, previous=self._sticky)
            if notice.id not in self._sticky:
                log.warning("gpu: fatal %s (%s)", finding.signal, notice.detail.get("gpu"),
                            extra={"notice_id": notice.id})
                self._sticky[notice.id] = notice
        elif action in ("warn", "cordon"):
            live = self._event_advisories.get(advisory_notice_id(self.origin, finding))
            fresh = self._warn(finding, action)
            self._event_advisories[fresh.id] = (live[0] if live else fresh, time.monotonic() + self.advisory_hold)

    def _notice(self, finding: Finding, previous: dict[str, Notice]) -> Notice:
        """The notice for a fatal finding, frozen at first sight: no churn from changing readings."""
        nid = fault_notice_id(self.origin, finding)
        existing = previous.get(nid) or self._sticky.get(nid) or self._level.get(nid)
        return existing if existing is not None else fault_notice(self.origin, finding, self.policy)

    def _warn(self, finding: Finding, action: str) -> Notice:
        """Counts and logs a warning; returns its advisory notice as it would be new."""
        advisory = advisory_notice(self.origin, finding, action, self.policy)
        self.warnings[finding.signal] += 1
        log.warning("gpu %s: warning %s", advisory.detail["gpu"], finding.signal,
                    extra={"gpu": advisory.detail["gpu"], "detail": advisory.detail, "notice_id": advisory.id})
        return advisory

    def _current(self) -> list[Notice]:
        now = time.monotonic()
        self._event_advisories = {i: (n, until) for i, (n, until) in self._event_advisories.items() if until > now}
        faults = list(self._sticky.values()) + [n for i, n in self._level.items() if i not in self._sticky]
        advisories = {**self._level_advisories, **{i: n for i, (n, _) in self._event_advisories.items()}}
        return faults + list(advisories.values())

    def _lost_notice_live(self) -> bool:
        return any(n.detail.get("signal") == "gpu_lost" for n in self._sticky.values())

    def _gpu(self, index: int | None) -> Gpu | None:
        if index is not None and 0 <= index < len(self.gpus):
            return self.gpus[index]
        return None



class LogOnce:
    """`log_once(key, level, message, *args)`: logs the first time a key is seen, then stays quiet."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.seen: set[str] = set()

    def __call__(self, key: str, level: int, message: str, *args: Any) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.logger.log(level, message, *args)


def warning_detail(finding: Finding, action: str, policy: GpuPolicy) -> dict[str, Any]:
    """What a GPU warning reports: the signal, its meaning, the finding's detail and value, and
    `cordon` when the policy asks for one."""
    detail: dict[str, Any] = {"signal": finding.signal, "meaning": policy.signal_meaning(finding.signal)}
    detail.update(finding.detail)
    if finding.value is not None:
        detail["value"] = finding.value
    if action == "cordon":
        detail["cordon"] = True
    return detail


@dataclass(frozen=True)
class Origin:
    """Where the GPU source's notices come from: its name, the node, and the instance part of
    their ids (the boot id, or FALLBACK)."""

    source: str
    node: str
    instance: str

    def notice_id(self, *fields: Any) -> str:
        return notice_id(self.source, self.node, self.instance, *fields)


def enumerate_gpus(backend: gb.GpuBackend, lost: set[int]) -> list[Gpu]:
    """The GPUs NVML sees, by index (a lost one named `index-<i>` and added to `lost`); raises
    SourceError (after shutting the backend down) when the enumeration fails."""
    nvml = _pynvml()
    gpus = []
    try:
        for i in range(backend.device_count()):
            try:
                uuid = backend.uuid(i)
            except nvml.NVMLError_GpuIsLost:
                uuid = f"index-{i}"
                lost.add(i)
            try:
                pci = backend.pci_bus_id(i)
            except nvml.NVMLError:
                pci = ""
            gpus.append(Gpu(i, uuid, pci))
    except nvml.NVMLError as exc:
        backend.shutdown()
        raise SourceError(f"nvml_{error_name(exc)}", f"enumerating GPUs failed: {exc}") from None
    return gpus


def advisory_notice_id(origin: Origin, finding: Finding) -> str:
    """The stable id of a warning's advisory: one per instance, GPU and signal."""
    return origin.notice_id(_gpu_name(finding), finding.signal, "advisory")


def advisory_notice(origin: Origin, finding: Finding, action: str, policy: GpuPolicy) -> Notice:
    """The advisory gpu-fault notice for a warn/cordon finding (no deadline: nothing to act on)."""
    detail = {"gpu": _gpu_name(finding), **warning_detail(finding, action, policy)}
    return Notice(id=advisory_notice_id(origin, finding), kind=Kind.GPU_FAULT, source=origin.source,
                  node=origin.node, detected_at=now_utc(), deadline=None, detail=detail, severity=Severity.ADVISORY)


def fault_notice_id(origin: Origin, finding: Finding) -> str:
    """The stable id of a fatal finding: one per instance, GPU, signal and value."""
    return origin.notice_id(_gpu_name(finding), finding.signal, "" if finding.value is None else finding.value)


def fault_notice(origin: Origin, finding: Finding, policy: GpuPolicy) -> Notice:
    """A new gpu-fault notice for a fatal finding (deadline: now)."""
    uuid = _gpu_name(finding)
    now: datetime = now_utc()
    detail: dict[str, Any] = {"gpu": uuid, "signal": finding.signal, "meaning": policy.signal_meaning(finding.signal)}
    if finding.gpu is not None:
        detail.update(index=finding.gpu.index, pci_bus_id=finding.gpu.pci_bus_id)
    if finding.value is not None:
        detail["value"] = finding.value
    detail.update(finding.detail)
    return Notice(id=fault_notice_id(origin, finding), kind=Kind.GPU_FAULT, source=origin.source, node=origin.node,
                  detected_at=now, deadline=now, detail=detail)


def _gpu_name(finding: Finding) -> str:
    """The GPU a finding names: its UUID, "node" for node-wide signals, "unknown" otherwise."""
    if finding.gpu is not None:
        return finding.gpu.uuid
    return "node" if finding.signal == "gpu_count_drop" else "unknown"


def _pynvml():
    import pynvml

    return pynvml
