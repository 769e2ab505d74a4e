"""The GPU health source end to end: a scriptable fake NVML backend (raising the real pynvml
error classes) -> GpuHealthSource.run() -> gpu-fault notices, withdrawals and warnings (advisory
gpu-fault notices)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import pynvml
import pytest

from spotguard.agent.gpu import backend as gb
from spotguard.emulator.nvml import FakeGpu, FakeGpuBackend
from spotguard.wire.notice import Kind, Notice
from spotguard.wire.withdrawal import Withdrawal
from spotguard.agent.sources.gpu import GpuHealthSource

NODE = "gpu-node-1"


class Running:
    """A source whose run() loop goes on in a task; its updates are collected (`notices`: the
    faults to act on; `warnings`: the advisories, as (gpu, reason, detail))."""

    def __init__(self, source: GpuHealthSource):
        self.source = source
        self.updates: list = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Running:
        async def pump():
            async for update in self.source.run():
                self.updates.append(update)

        self._task = asyncio.create_task(pump())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, 10)

    @property
    def notices(self) -> list[Notice]:
        return [u for u in self.updates if isinstance(u, Notice) and not u.advisory]

    @property
    def advisories(self) -> list[Notice]:
        return [u for u in self.updates if isinstance(u, Notice) and u.advisory]

    @property
    def warnings(self) -> list[tuple[str, str, dict]]:
        return [(a.detail["gpu"], a.detail["signal"], dict(a.detail)) for a in self.advisories]

    def notices_for(self, signal: str) -> list[Notice]:
        return [n for n in self.notices if n.detail.get("signal") == signal]

    async def until(self, predicate, timeout: float = 5.0, what: str = "condition"):
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what} not met in {timeout}s; updates={self.updates!r:.600} "
                                     f"warnings={self.warnings!r:.300}")
            await asyncio.sleep(0.01)

    async def event_handled(self, emit) -> None:
        """Emits an event and waits until the source handled it and yielded what it caused
        (the source is in its next poll: its run() loop went round once)."""
        await self.until(lambda: self.source.mode == "events", what="event mode")
        start = self.source.stats.polls
        emit()
        await self.until(lambda: self.source.stats.polls > start, what="the event handled")

    async def settle(self, reads: int = 3) -> None:
        """Waits until the source has done `reads` more poll rounds (nothing else can happen)."""
        start = self.source.stats.polls
        await self.until(lambda: self.source.stats.polls >= start + reads, what=f"{reads} more polls")


def make_source(fake: FakeGpuBackend, **kwargs) -> GpuHealthSource:
    kwargs.setdefault("interval", 0.05)
    kwargs.setdefault("wait_timeout_ms", 50)
    return GpuHealthSource(NODE, backend=fake, **kwargs)


# ---- the Xid table, end to end ----------------------------------------------------------------
XID_CASES = [
    # (xid, expected: "notice" | "warning" | "nothing", remedy or None)
    (13, "nothing", None), (31, "nothing", None), (43, "nothing", None), (45, "nothing", None),
    (68, "nothing", None), (40, "nothing", None), (130, "nothing", None),
    (109, "warning", None), (63, "warning", None), (92, "warning", None), (94, "warning", None),
    (46, "notice", "reset"), (48, "notice", "reset"), (62, "notice", "reset"), (64, "notice", "reset"),
    (74, "notice", "reset"), (95, "notice", "reset"), (119, "notice", "reset"), (147, "notice", "reset"),
    (79, "notice", "reboot"), (160, "notice", "reboot"), (151, "notice", "restart-vm"),
    (54, "notice", "hardware-ticket"), (999, "warning", None), (4242, "warning", None),
]


async def test_xid_table_end_to_end():
    fake = FakeGpuBackend(2)
    async with Running(make_source(fake, interval=30.0)) as run:
        await run.until(lambda: run.source.mode == "events", what="event mode")
        for xid, expected, remedy in XID_CASES:
            before_notices, before_warnings = len(run.notices), len(run.warnings)
            await run.event_handled(lambda: fake.xid(1, xid))
            assert run.source.seen[f"xid:{xid}"] == 1
            if expected == "notice":
                await run.until(lambda: len(run.notices) == before_notices + 1, what=f"notice for xid {xid}")
                notice = run.notices[-1]
                assert notice.kind is Kind.GPU_FAULT and notice.source == "gpu" and notice.node == NODE
                assert notice.detail["xid"] == xid and notice.detail["value"] == xid
                assert notice.detail["gpu"] == fake.gpus[1].uuid and notice.detail["remedy"] == remedy
                assert notice.deadline == notice.detected_at  # deadline: now
            elif expected == "warning":
                await run.until(lambda: len(run.warnings) == before_warnings + 1, what=f"warning for xid {xid}")
                gpu, reason, detail = run.warnings[-1]
                assert (gpu, reason, detail["xid"]) == (fake.gpus[1].uuid, f"xid_{xid}", xid)
                advisory = run.advisories[-1]
                assert advisory.kind is Kind.GPU_FAULT and advisory.deadline is None
                assert Notice.from_json(advisory.to_json()) == advisory  # advisory on the wire too
            if expected != "notice":
                assert len(run.notices) == before_notices, f"xid {xid} must not become a notice"
            if expected != "warning":
                assert len(run.warnings) == before_warnings, f"xid {xid} must not warn"
        # an Xid repeated is one notice (same id); Xid 63 recommends a cordon
        await run.event_handled(lambda: fake.xid(1, 79))
        assert len(run.notices_for("xid")) == sum(1 for _, e, _ in XID_CASES if e == "notice")
        assert [d.get("cordon") for _, r, d in run.warnings if r == "xid_63"] == [True]
        assert not run.source.stats.errors


async def test_repeated_xid_109_escalates_to_a_notice():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=30.0)) as run:
        await run.until(lambda: run.source.mode == "events")
        for i in range(3):
            fake.xid(0, 109)
            await run.until(lambda: run.source.seen["xid:109"] == i + 1)
        await run.until(lambda: run.notices_for("xid"), what="escalated notice")
        notice = run.notices_for("xid")[0]
        assert notice.detail["xid"] == 109 and notice.detail["remedy"] == "drain" and "escalated" in notice.detail
        assert len([w for w in run.warnings if w[1] == "xid_109"]) == 1  # one advisory, live
        assert run.source.warnings["xid_109"] == 2  # counted per event


async def test_fatal_events_become_notices_and_warning_events_warn():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=30.0)) as run:
        await run.until(lambda: run.source.mode == "events")
        fake.emit(0, gb.EVENT_FATAL_POISON)
        fake.emit(0, gb.EVENT_GPU_UNAVAILABLE)
        fake.emit(0, gb.EVENT_SBE_STORM)
        await run.until(lambda: len(run.notices) == 2 and run.warnings)
        assert {n.detail["signal"] for n in run.notices} == {"fatal_poison", "gpu_unavailable"}
        assert [w[1] for w in run.warnings] == ["sbe_storm"]


# ---- the wait loop -----------------------------------------------------------------------------
async def test_timeouts_from_the_wait_are_normal():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=30.0, wait_timeout_ms=20)) as run:
        await run.until(lambda: fake.calls["wait_event"] >= 6, what="several timed-out waits")
        assert not run.source.stats.errors and not run.updates and run.source.mode == "events"
        fake.xid(0, 48)  # the waiter is still alive after the timeouts
        await run.until(lambda: run.notices_for("xid"))


async def test_gpu_is_lost_from_the_wait_names_the_lost_gpu():
    fake = FakeGpuBackend(2)
    async with Running(make_source(fake, interval=30.0)) as run:
        await run.event_handled(lambda: fake.lose(1))  # GpuIsLost from the wait and from GPU 1's calls
        await run.until(lambda: run.notices_for("gpu_lost"), what="gpu_lost notice")
        notice = run.notices_for("gpu_lost")[0]
        assert notice.detail["gpu"] == fake.gpus[1].uuid and notice.kind is Kind.GPU_FAULT
        await run.event_handled(lambda: fake.xid(0, 13))  # the waiter goes on; still one notice
        assert len(run.notices_for("gpu_lost")) == 1
        assert not [u for u in run.updates if isinstance(u, Withdrawal)]


async def test_gpu_is_lost_from_the_wait_alone_gives_an_unknown_gpu_notice():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=30.0)) as run:
        await run.until(lambda: run.source.mode == "events")
        fake.raise_from_wait(pynvml.NVMLError_GpuIsLost)
        await run.until(lambda: run.notices_for("gpu_lost"))
        assert run.notices_for("gpu_lost")[0].detail["gpu"] == "unknown"
        fake.xid(0, 79)  # the waiter goes on after GpuIsLost
        await run.until(lambda: run.notices_for("xid"), timeout=8)


async def test_gpu_is_lost_from_a_read_is_fatal():
    fake = FakeGpuBackend(2)
    fake.register_error = pynvml.NVMLError_NotSupported()  # polling only: the read finds it
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 1)
        fake.set(0, lost=True)
        await run.until(lambda: run.notices_for("gpu_lost"))
        assert run.notices_for("gpu_lost")[0].detail["gpu"] == fake.gpus[0].uuid
        await run.settle(3)
        assert len(run.notices_for("gpu_lost")) == 1


# ---- degraded modes ----------------------------------------------------------------------------
@pytest.mark.parametrize("error", [pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded])
async def test_no_nvml_means_no_gpus_once_and_no_crash(error, caplog):
    caplog.set_level(logging.INFO, logger="spotguard.agent.sources.gpu")
    fake = FakeGpuBackend(1, init_error=error)
    async with Running(make_source(fake, interval=0.02)) as run:
        await run.until(lambda: run.source.stats.polls >= 4, what="several idle polls")
        assert run.source.available is False and run.source.mode == "none"
        assert not run.updates and not run.source.stats.errors
        assert fake.calls["init"] == 1 and fake.calls["wait_event"] == 0
    assert sum("no GPUs" in r.getMessage() for r in caplog.records) == 1


async def test_other_init_errors_are_retried():
    fake = FakeGpuBackend(1, init_error=pynvml.NVMLError_Unknown)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.errors["nvml_unknown"] >= 1)
        fake.init_error = None
        fake.set(0, ecc_uncorrected=1)
        await run.until(lambda: run.notices_for("double_bit_ecc"), timeout=8)
        assert run.source.available is True


async def test_not_supported_on_register_falls_back_to_polling():
    fake = FakeGpuBackend(1, register_error=pynvml.NVMLError_NotSupported)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 2)
        assert run.source.mode == "polling"
        fake.set(0, ecc_uncorrected=2)
        await run.until(lambda: run.notices_for("double_bit_ecc"))
        assert fake.calls["wait_event"] == 0 and not run.source.stats.errors


async def test_not_supported_from_the_wait_falls_back_to_polling():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.mode == "events")
        fake.raise_from_wait(pynvml.NVMLError_FunctionNotFound)
        await run.until(lambda: run.source.mode == "polling")
        calls = fake.calls["wait_event"]
        fake.set(0, remap_failure=True)
        await run.until(lambda: run.notices_for("remap_failure"))
        assert fake.calls["wait_event"] == calls  # the waiter stopped


async def test_function_not_found_on_a_read_skips_that_signal_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="spotguard.agent.sources.gpu")
    fake = FakeGpuBackend(1)
    fake.fail("field_values", pynvml.NVMLError_FunctionNotFound)
    fake.set(0, recovery_action=2)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 4)
        fake.set(0, ecc_uncorrected=1)  # the other signals still work
        await run.until(lambda: run.notices_for("double_bit_ecc"))
        assert not run.notices_for("recovery_action")
        assert fake.calls["field_values"] == 1 and not run.source.stats.errors
    skipped = [r for r in caplog.records if "recovery_action unavailable" in r.getMessage()]
    assert len(skipped) == 1


async def test_a_transient_read_error_keeps_the_last_reading():
    fake = FakeGpuBackend(1)
    fake.set(0, ecc_uncorrected=1)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.notices_for("double_bit_ecc"))
        fake.fail("total_ecc_errors", pynvml.NVMLError_Unknown)
        await run.until(lambda: run.source.stats.errors["nvml_unknown"] >= 3)
        assert not [u for u in run.updates if isinstance(u, Withdrawal)]
        fake.heal("total_ecc_errors")
        fake.set(0, ecc_uncorrected=0)  # e.g. after a GPU reset: the volatile counter is cleared
        await run.until(lambda: [u for u in run.updates if isinstance(u, Withdrawal)])


# ---- persistent signals ------------------------------------------------------------------------
async def test_gpu_count_drop_is_fatal():
    fake = FakeGpuBackend(4)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 1)
        fake.remove(3)
        await run.until(lambda: run.notices_for("gpu_count_drop"))
        notice = run.notices_for("gpu_count_drop")[0]
        assert notice.detail["count"] == 3 and notice.detail["expected"] == 4 and notice.detail["gpu"] == "node"


async def test_expected_count_catches_a_gpu_missing_at_start():
    fake = FakeGpuBackend(7)
    async with Running(make_source(fake, expected_count=8)) as run:
        await run.until(lambda: run.notices_for("gpu_count_drop"))
        assert run.notices_for("gpu_count_drop")[0].detail["count"] == 7


async def test_recovery_action_read_at_once_after_xid_154():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=60.0)) as run:  # no periodic read in this test
        await run.until(lambda: run.source.mode == "events" and run.source.stats.successes >= 1)
        fake.set(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
        fake.xid(0, 154)
        await run.until(lambda: run.notices_for("recovery_action"))
        notice = run.notices_for("recovery_action")[0]
        assert notice.detail["value"] == "NODE_REBOOT" and notice.detail["code"] == 2


@pytest.mark.parametrize("fields, signal", [
    ({"ecc_uncorrected": 1}, "double_bit_ecc"),
    ({"remap_failure": True}, "remap_failure"),
    ({"remapped_uncorrectable": 512}, "uncorrectable_rows"),
    ({"recovery_action": 1}, "recovery_action"),
    ({"temperature": 90}, "thermal_shutdown"),  # shutdown 92, margin 3
])
async def test_persistent_fatal_signals(fields, signal):
    fake = FakeGpuBackend(2)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 1)
        fake.set(1, **fields)
        await run.until(lambda: run.notices_for(signal), what=signal)
        notice = run.notices_for(signal)[0]
        assert notice.detail["gpu"] == fake.gpus[1].uuid and notice.detail["index"] == 1
        await run.settle(3)
        assert len(run.notices) == 1  # frozen at first sight: no churn between reads


async def test_double_bit_ecc_event_reads_at_once():
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake, interval=60.0)) as run:
        await run.until(lambda: run.source.mode == "events" and run.source.stats.successes >= 1)
        fake.set(0, ecc_uncorrected=1)
        fake.emit(0, gb.EVENT_DOUBLE_BIT_ECC)
        await run.until(lambda: run.notices_for("double_bit_ecc"))


@pytest.mark.parametrize("fields, signal", [
    ({"remap_pending": True}, "remap_pending"),
    ({"temperature": 88}, "thermal_slowdown"),  # slowdown 87
    ({"clock_reasons": gb.CLOCK_HW_THERMAL_SLOWDOWN | 0x1}, "clock_slowdown"),
])
async def test_warning_signals_warn_once_per_appearance(fields, signal):
    fake = FakeGpuBackend(1)
    async with Running(make_source(fake)) as run:
        await run.until(lambda: run.source.stats.successes >= 1)
        fake.set(0, **fields)
        await run.until(lambda: run.warnings)
        await run.settle(4)
        assert [w[1] for w in run.warnings] == [signal] and not run.notices
        assert run.source.warnings[signal] == 1
        advisory = run.advisories[0]
        assert advisory.kind is Kind.GPU_FAULT and advisory.deadline is None and advisory.advisory
        assert advisory.detail["gpu"] == fake.gpus[0].uuid
        assert (advisory.detail.get("cordon") is True) == (signal == "remap_pending")
        fake.set(0, remap_pending=False, temperature=40, clock_reasons=0)
        await run.until(lambda: any(isinstance(u, Withdrawal) and u.notice_id == advisory.id for u in run.updates),
                        what="the advisory withdrawn once the condition cleared")
        fake.set(0, **fields)  # appears again -> warns again
        await run.until(lambda: len(run.warnings) == 2)
        assert run.advisories[1].id == advisory.id  # stable per GPU and signal
    if signal == "clock_slowdown":
        assert run.warnings[0][2]["reasons"] == ["HwThermalSlowdown"]


# ---- restart -----------------------------------------------------------------------------------
async def test_restart_recovers_state_from_persistent_counters():
    fake = FakeGpuBackend([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    async with Running(make_source(fake)) as first:
        await first.until(lambda: first.source.stats.successes >= 1)
        fake.set(1, ecc_uncorrected=3, recovery_action=1)
        fake.xid(0, 79)  # event-borne: gone with the process (the sheet: events are not replayed)
        await first.until(lambda: len(first.notices) == 3)
    assert fake.calls["shutdown"] == 1 and fake.registered == {}
    before = {n.detail["signal"]: n.id for n in first.notices}

    async with Running(make_source(fake)) as second:  # the agent restarted; the GPU is still failed
        await second.until(lambda: len(second.notices) == 2)
        await second.settle(2)
        after = {n.detail["signal"]: n.id for n in second.notices}
    assert after == {"double_bit_ecc": before["double_bit_ecc"], "recovery_action": before["recovery_action"]}


async def test_notice_ids_differ_between_nodes_and_gpus():
    fake = FakeGpuBackend(2)
    fake.set(0, ecc_uncorrected=1)
    fake.set(1, ecc_uncorrected=1)
    a = make_source(fake)
    b = GpuHealthSource("other-node", backend=fake, interval=0.05)
    try:
        ids_a = {n.id for n in await a.poll()}
        ids_b = {n.id for n in await b.poll()}
    finally:
        await a.close()
        await b.close()
    assert len(ids_a) == 2 and len(ids_b) == 2 and not ids_a & ids_b


# ---- the instance in the ids: the machine's boot ------------------------------------------------
BOOT_A = "0d4b8a3e-4c38-4a55-8a3c-63c9a2a1f001"
BOOT_B = "5e1f2c44-9b71-4e0e-b3aa-0b3f2e7d9002"


def boot_file(tmp_path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content + "\n")
    return str(path)


async def fault_ids(fake: FakeGpuBackend, boot_id_path: str) -> tuple[set[str], GpuHealthSource]:
    """The gpu-fault ids a freshly started source (an agent started now) reads from `fake`."""
    source = make_source(fake, boot_id_path=boot_id_path)
    async with Running(source) as run:
        await run.until(lambda: len(run.notices) == 2, what="both faults")
        await run.settle(2)
    return {n.id for n in run.notices}, source


async def test_the_same_fault_on_a_new_boot_is_a_new_notice(tmp_path):
    """A VM re-created under its name may get the very same GPU (same uuid, same failed rows):
    its notices are new ones. The same boot keeps its ids across restarted agents."""
    fake = FakeGpuBackend([FakeGpu(uuid="GPU-same-board")])
    fake.set(0, remap_failure=True, ecc_uncorrected=1)  # persistent faults: read again by every agent
    this_boot = boot_file(tmp_path, "boot-a", BOOT_A)
    first, _ = await fault_ids(fake, this_boot)
    again, _ = await fault_ids(fake, this_boot)
    assert len(first) == 2 and again == first
    recreated, source = await fault_ids(fake, boot_file(tmp_path, "boot-b", BOOT_B))
    assert len(recreated) == 2 and not recreated & first
    assert not source.stats.errors


async def test_the_dry_runs_new_gpu_has_new_ids():
    """Each fake backend is one machine's GPUs: a re-created one (the dry-run's new instance) has
    new uuids, so the same Xid there is a new notice even on one kernel (one boot id)."""
    ids = []
    for _ in range(2):
        fake = FakeGpuBackend(1)
        async with Running(make_source(fake)) as run:
            await run.event_handled(lambda f=fake: f.xid(0, 79))
            await run.until(lambda: len(run.notices) == 1, what="the Xid 79 notice")
        ids.append(run.notices[0].id)
    assert ids[0] != ids[1]


@pytest.mark.parametrize("content", [None, "not-a-boot-id", "\xff"], ids=["missing", "garbage", "binary"])
async def test_an_unreadable_boot_id_never_costs_the_notice(tmp_path, content):
    path = str(tmp_path / "boot_id")
    if content == "\xff":
        (tmp_path / "boot_id").write_bytes(b"\xff\xfe\n")
    elif content is not None:
        boot_file(tmp_path, "boot_id", content)
    fake = FakeGpuBackend([FakeGpu(uuid="GPU-same-board")])
    fake.set(0, remap_failure=True, ecc_uncorrected=1)
    fallback, source = await fault_ids(fake, path)
    assert len(fallback) == 2
    reason = "instance_id:unreadable" if content in (None, "\xff") else "instance_id:malformed"
    assert dict(source.stats.errors) == {reason: 1}
    known, _ = await fault_ids(fake, boot_file(tmp_path, "boot-a", BOOT_A))
    assert not known & fallback  # the fallback ids are not the boot's
    assert (await fault_ids(fake, path))[0] == fallback  # stable while the boot id stays unreadable
