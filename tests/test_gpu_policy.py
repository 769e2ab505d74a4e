"""The GPU policy as data: defaults from the fact sheet, overrides from dicts and files, bad
entries named, the fake backend's scenario files and the `--gpu` flag."""
from __future__ import annotations

import asyncio
import json

import pynvml
import pytest

from spotguard.emulator.nvml import FakeGpuBackend
from spotguard.agent.gpu.policy import GpuPolicy, parse_xid_list
from spotguard.agent.gpu.select import make_backend
from spotguard.agent.sources.gpu import GpuHealthSource
from spotguard.config import ConfigError


def test_defaults_follow_the_fact_sheet():
    p = GpuPolicy()
    for xid in (13, 31, 43, 45, 68, 8, 39, 40, 41, 69, 72, 96, 105, 126, 135, 139):
        assert p.xid_rule(xid).action == "ignore", xid
    for xid in (109, 92, 94):
        assert p.xid_rule(xid).action == "warn", xid
    assert p.xid_rule(63).action == "cordon"
    assert p.xid_rule(154).action == "recovery"
    for xid in (46, 48, 62, 64, 74, 95, 110, 119, 120, 136, 140, 143, 144, 150, 155, 156, 158, 79, 160, 151, 54):
        assert p.xid_rule(xid).action == "fatal", xid
    assert (p.xid_rule(79).remedy, p.xid_rule(48).remedy, p.xid_rule(151).remedy) == ("reboot", "reset", "restart-vm")
    assert p.xid_rule(999).action == "warn" and p.xid_rule(12345).action == "warn"
    assert p.escalate[109].count == 3
    assert p.signal_action("double_bit_ecc") == "fatal" and p.signal_action("remap_pending") == "cordon"
    assert p.thresholds == {"uncorrectable_rows": 512, "shutdown_margin_c": 3, "clock_reasons_mask": 0xC8}


def test_overrides_merge_over_the_defaults():
    p = GpuPolicy.from_data({
        "xid": {"13": "warn", 79: "ignore", "144-146": "warn", "200,201": "fatal"},
        "xid_default": "fatal",
        "escalate": {"109": None, "92": {"count": 2, "window_seconds": 60}},
        "signals": {"remap_pending": "fatal", "thermal_slowdown": "ignore"},
        "thresholds": {"uncorrectable_rows": 100, "clock_reasons_mask": "0x40"},
    })
    assert p.xid_rule(13).action == "warn" and p.xid_rule(79).action == "ignore"
    assert [p.xid_rule(x).action for x in (144, 145, 146, 147)] == ["warn", "warn", "warn", "fatal"]
    assert p.xid_rule(200).action == "fatal" and p.xid_rule(4242).action == "fatal"
    assert p.xid_rule(48).action == "fatal" and p.xid_rule(79).remedy == "reboot"  # untouched / kept
    assert 109 not in p.escalate and p.escalate[92].count == 2
    assert p.signal_action("remap_pending") == "fatal" and p.signal_action("thermal_slowdown") == "ignore"
    assert p.thresholds["uncorrectable_rows"] == 100 and p.thresholds["clock_reasons_mask"] == 0x40
    assert p.thresholds["shutdown_margin_c"] == 3


def test_policy_round_trips_through_data_and_files(tmp_path):
    p = GpuPolicy.from_data({"xid": {"13": "fatal"}, "signals": {"sbe_storm": "ignore"}})
    again = GpuPolicy.from_data(p.to_data())
    assert again.to_data() == p.to_data()
    (tmp_path / "p.json").write_text(json.dumps({"xid": {"31": "fatal"}}))
    (tmp_path / "p.yaml").write_text("xid:\n  '31': fatal\nthresholds:\n  shutdown_margin_c: 5\n")
    assert GpuPolicy.load(tmp_path / "p.json").xid_rule(31).action == "fatal"
    loaded = GpuPolicy.load(tmp_path / "p.yaml")
    assert loaded.xid_rule(31).action == "fatal" and loaded.thresholds["shutdown_margin_c"] == 5


@pytest.mark.parametrize("data, field", [
    ({"xid": {"79": "boom"}}, "xid.79"),
    ({"xid": {"seven": "warn"}}, "xid.seven"),
    ({"xid": ["79"]}, "xid"),
    ({"xid_default": "recovery"}, "xid_default"),
    ({"signals": {"nope": "warn"}}, "signals.nope"),
    ({"signals": {"gpu_lost": "recovery"}}, "signals.gpu_lost"),
    ({"thresholds": {"uncorrectable_rows": -1}}, "thresholds.uncorrectable_rows"),
    ({"thresholds": {"warp_speed": 1}}, "thresholds.warp_speed"),
    ({"escalate": {"109": {"count": 0, "window_seconds": 5}}}, "escalate.109.count"),
    ({"escalate": {"109": {"count": 2, "window_seconds": "x"}}}, "escalate.109.window_seconds"),
    ({"rules": {}}, "rules"),
])
def test_bad_policy_entries_are_named(data, field):
    with pytest.raises(ConfigError) as info:
        GpuPolicy.from_data(data)
    assert info.value.field == "--gpu-policy" and info.value.message.startswith(field)


def test_unreadable_policy_file(tmp_path):
    with pytest.raises(ConfigError, match="--gpu-policy"):
        GpuPolicy.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("xid: [unclosed\n")
    with pytest.raises(ConfigError, match="neither JSON nor YAML"):
        GpuPolicy.load(tmp_path / "bad.yaml")


def test_parse_xid_list():
    assert parse_xid_list("8, 11,39-41") == [8, 11, 39, 40, 41]
    for bad in ("5-3", "x", "1-2-3", "-4"):
        with pytest.raises(ValueError):
            parse_xid_list(bad)


async def test_overridden_policy_drives_the_source():
    """Data in, behaviour out: Xid 13 made fatal, Xid 79 ignored, remap_pending made fatal."""
    policy = GpuPolicy.from_data({"xid": {"13": "fatal", "79": "ignore"}, "signals": {"remap_pending": "fatal"}})
    fake = FakeGpuBackend(1)
    source = GpuHealthSource("n1", backend=fake, policy=policy, interval=0.05, wait_timeout_ms=50)
    try:
        assert await source.poll() == []
        fake.xid(0, 79)
        fake.xid(0, 13)
        fake.set(0, remap_pending=True)
        signals: set = set()
        for _ in range(100):
            signals |= {(n.detail["signal"], n.detail.get("value")) for n in await asyncio.wait_for(source.poll(), 5)}
            if len(signals) >= 2:
                break
        assert signals == {("xid", 13), ("remap_pending", None)}
        assert source.seen["xid:79"] == 1 and not source.warnings
    finally:
        await source.close()


# ---- scenario files and the --gpu flag ---------------------------------------------------------
async def test_scenario_file_scripts_the_fake(tmp_path):
    scenario = tmp_path / "gpu.yaml"
    scenario.write_text(
        "gpus: [{uuid: GPU-x}, {uuid: GPU-y, temperature: 50}]\n"
        "fail: {clock_reasons: FunctionNotFound}\n"
        "steps:\n"
        "  - {at: 0.05, xid: {gpu: 1, xid: 79}}\n"
        "  - {at: 0.1, set: {gpu: 0, ecc_uncorrected: 1}}\n")
    fake = make_backend(f"fake:{scenario}")
    assert isinstance(fake, FakeGpuBackend) and [g.uuid for g in fake.gpus] == ["GPU-x", "GPU-y"]
    source = GpuHealthSource("n1", backend=fake, interval=0.05, wait_timeout_ms=50)
    try:
        seen: set = set()
        for _ in range(200):
            seen |= {(n.detail["gpu"], n.detail["signal"]) for n in await asyncio.wait_for(source.poll(), 5)}
            if len(seen) == 2:
                break
        assert seen == {("GPU-y", "xid"), ("GPU-x", "double_bit_ecc")}
        assert fake.calls["clock_reasons"] == 2  # once per GPU, then skipped
    finally:
        await source.close()


def test_scenario_no_gpu_machine(tmp_path):
    (tmp_path / "none.json").write_text(json.dumps({"gpus": 0, "init_error": "LibraryNotFound"}))
    fake = FakeGpuBackend.from_scenario(tmp_path / "none.json")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        fake.init()


@pytest.mark.parametrize("scenario, message", [
    ({"gpus": "two"}, "gpus"),
    ({"steps": [{"at": -1}]}, "at"),
    ({"steps": [{"at": 1, "explode": 1}]}, "unknown keys"),
    ({"steps": [{"set": {"gpu": 0, "warp": 1}}]}, "set needs"),
    ({"steps": [{"wait_error": "NoSuchError"}]}, "NoSuchError"),
    ({"fail": {"not_a_method": "Unknown"}}, "not_a_method"),
    ({"init_error": "Bogus"}, "Bogus"),
])
def test_bad_scenarios_are_config_errors(tmp_path, scenario, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    with pytest.raises(ConfigError) as info:
        make_backend(f"fake:{path}")
    assert info.value.field == "--gpu" and message in info.value.message


def test_gpu_flag_values(tmp_path):
    assert make_backend("off") is None
    assert make_backend("auto") is not None  # nvidia-ml-py is installed: the NVML backend
    for bad in ("fake:", "cuda", "fake"):
        with pytest.raises(ConfigError, match="--gpu"):
            make_backend(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        make_backend(f"fake:{tmp_path / 'absent.yaml'}")


async def test_real_nvml_backend_on_this_machine_means_no_gpus():
    """On a machine without a GPU driver, the real backend's init raises LibraryNotFound (or
    DriverNotLoaded) and the source idles; on a GPU machine it simply starts."""
    source = GpuHealthSource("n1", backend=make_backend("nvml"), interval=0.05)
    try:
        assert await asyncio.wait_for(source.poll(), 10) == [] or source.available
        assert source.available in (True, False) and not source.stats.errors
    finally:
        await source.close()
