"""The framework integrations in one process: version checks at attach time, bad configuration,
and the core's save -> publish sequence (a failure leaves nothing visible)."""
from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.adapters.base import CheckpointFailed
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkSave, guard_for, publish_dir, read_marker
from spotguard.integrations.versions import UnsupportedFramework


def test_supported_version_passes_and_returns_it():
    assert versions.require("transformers", "x", installed="5.23.0") == "5.23.0"
    assert versions.require("lightning", "x", installed="2.6.6") == "2.6.6"
    assert versions.require("accelerate", "x", installed="1.16.0.dev0") == "1.16.0.dev0"


@pytest.mark.parametrize("distribution, installed, needed", [
    ("transformers", "4.46.3", "transformers>=5.0,<6"),
    ("transformers", "6.0.0", "transformers>=5.0,<6"),
    ("accelerate", "0.34.2", "accelerate>=1.0,<2"),
    ("lightning", "2.3.3", "lightning>=2.4,<3"),
])
def test_unsupported_version_names_the_versions_needed(distribution, installed, needed):
    with pytest.raises(UnsupportedFramework) as err:
        versions.require(distribution, "spotguard.integrations.x", installed=installed)
    assert needed in str(err.value) and installed in str(err.value) and "spotguard.integrations.x" in str(err.value)


def test_missing_framework_names_the_extra(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(versions.metadata, "version", missing)
    needed = r"lightning>=2.4,<3, which is not installed.*spotguard\[lightning\]"
    with pytest.raises(UnsupportedFramework, match=needed):
        versions.require("lightning", "spotguard.integrations.lightning")


OLD = {"transformers": "4.40.0", "accelerate": "0.30.0", "lightning": "2.2.0"}


def installed_as(root, versions_by_name: dict[str, str]) -> None:
    """A distribution metadata directory per name under `root` (what pip leaves in site-packages)."""
    for name, version in versions_by_name.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_each_integration_refuses_an_unsupported_version_at_attach(monkeypatch, tmp_path):
    """The real lookup (importlib.metadata over sys.path) finds older installs first on the path."""
    from spotguard.integrations.accelerate import AccelerateGuard
    from spotguard.integrations.hf import SpotguardCallback as HFCallback
    from spotguard.integrations.lightning import SpotguardCallback as LightningCallback

    installed_as(tmp_path / "site", OLD)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert {name: metadata.version(name) for name in OLD} == OLD

    trainer = SimpleNamespace(add_callback=lambda cb: pytest.fail("added despite the version"))
    with pytest.raises(UnsupportedFramework, match=r"transformers>=5.0,<6; found transformers 4.40.0"):
        HFCallback.attach(trainer)
    with pytest.raises(UnsupportedFramework, match=r"accelerate>=1.0,<2; found accelerate 0.30.0"):
        AccelerateGuard(None, tmp_path)
    with pytest.raises(UnsupportedFramework, match=r"lightning>=2.4,<3; found lightning 2.2.0"):
        LightningCallback()


def test_the_installed_frameworks_pass_the_real_check():
    for name in OLD:
        assert versions.require(name, "x") == metadata.version(name)


def test_accelerate_refuses_automatic_checkpoint_naming(tmp_path):
    from spotguard.integrations.accelerate import AcceleratorSave

    accelerator = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=True))
    with pytest.raises(ConfigError, match="automatic_checkpoint_naming"):
        AcceleratorSave(accelerator, tmp_path)


def test_lightning_needs_a_checkpoint_directory():
    from spotguard.integrations.lightning import SpotguardCallback

    with pytest.raises(ConfigError, match=r"dirpath: needs a ModelCheckpoint"):
        SpotguardCallback()._checkpoint_dir(SimpleNamespace(checkpoint_callback=None))
    assert SpotguardCallback(dirpath="/ck")._checkpoint_dir(SimpleNamespace(checkpoint_callback=None)) == "/ck"


def test_guard_options_the_integration_sets_are_refused():
    with pytest.raises(TypeError, match="in_place is set by the integration"):
        guard_for(None, in_place=True)  # type: ignore[arg-type]


class StagedDir(FrameworkSave):
    """A framework that writes one directory (as the Trainer does), with failures on demand."""

    def __init__(self, root, fail_write=False, fail_publish=False):
        super().__init__()
        self.root, self.fail_write, self.fail_publish = root, fail_write, fail_publish

    def _write(self, step, notice):
        staged = self.root / ".staging" / f"checkpoint-{step}"
        staged.mkdir(parents=True)
        (staged / "model.bin").write_bytes(b"weights")
        if self.fail_write:
            raise OSError(28, "No space left on device")

    def _publish(self, step, notice):
        if self.fail_publish:
            raise OSError(5, "I/O error")
        publish_dir(self.root / ".staging" / f"checkpoint-{step}", self.root / f"checkpoint-{step}", step, notice)

    def _discard(self, step):
        import shutil

        shutil.rmtree(self.root / ".staging", ignore_errors=True)


def test_save_publishes_with_a_marker_and_replaces_a_copy_of_the_same_step(tmp_path):
    StagedDir(tmp_path).save(3)
    (tmp_path / ".staging").rmdir()
    adapter = StagedDir(tmp_path)
    adapter.save(3)
    assert read_marker(tmp_path / "checkpoint-3")["step"] == 3 and adapter.last_saved_step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging", "checkpoint-3"]
    assert adapter.estimate_save_seconds() is not None


@pytest.mark.parametrize("failure", ["fail_write", "fail_publish"])
def test_a_failed_save_raises_and_leaves_nothing_visible(tmp_path, failure):
    StagedDir(tmp_path).save(2)
    adapter = StagedDir(tmp_path, **{failure: True})
    with pytest.raises(CheckpointFailed, match="the previous checkpoint stays the newest"):
        adapter.save(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"] and adapter.last_saved_step is None


def test_drain_saves_fresh_without_the_vote_for_an_adapter_that_takes_no_snapshots(tmp_path):
    """The save decision's vote is a collective on the path from the agreement to the save; the
    integrations' adapters never hold a snapshot, so the drain skips it and saves fresh."""
    from datetime import timedelta

    from spotguard.hooks.agreement.base import Verdict
    from spotguard.hooks.agreement.collectives import Collectives
    from spotguard.hooks.drain import DrainSequence
    from spotguard.wire.notice import Kind, Notice, now_utc

    class CountingCollectives(Collectives):
        def __init__(self):
            self.maxes = 0

        def max(self, values):
            self.maxes += 1
            return list(values)

    now = now_utc()
    urgent = Notice(id="n", kind=Kind.RECLAIM, source="aws.spot", node="n1", detected_at=now,
                    deadline=now + timedelta(milliseconds=10))  # too short for any save: a vote would weigh it
    for adapter, votes in ((StagedDir(tmp_path / "framework"), 0), (SimpleNamespace(
            snapshot_step=None, estimate_save_seconds=lambda: 5.0, save=lambda step, **kw: None), 1)):
        collectives = CountingCollectives()
        record = DrainSequence(collectives, adapter).run(7, Verdict(urgent, urgent.deadline.timestamp(), 0),
                                                         notice=urgent)
        assert record.ok and not record.used_snapshot and record.saved_step == 7
        assert collectives.maxes == votes
