"""The framework integrations in one process: version checks at attach time, bad configuration,
the capture of a framework's saves, the adapter on the one engine (files as copied at the step
boundary, a failure leaves nothing visible), and kill -9 of a real integration's writer mid-persist."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

from spotguard.config import ConfigError
from spotguard.hooks.adapters.base import CheckpointFailed
from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.integrations import capture, versions
from spotguard.integrations.core import FrameworkAdapter, guard_for
from spotguard.integrations.versions import UnsupportedFramework
from tests.workers.launch import ROOT, base_env, kill_all


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


def test_missing_framework_names_the_extra():
    needed = r"lightning>=2.4,<3, which is not installed.*spotguard\[lightning\]"
    with pytest.raises(UnsupportedFramework, match=needed):
        versions.check("lightning", "spotguard.integrations.lightning", None)  # what require() does when not found


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


def test_snapshots_are_opt_in_and_a_bad_interval_is_refused(tmp_path):
    """`snapshot_every` among an integration's guard options: the Guard snapshots every N steps and
    the adapter takes part in the save decision; without it, neither (the calls of today unchanged)."""
    model, optimizer = trained()
    for options, every in (({}, 0), ({"snapshot_every": 3}, 3)):
        adapter = TorchFiles(tmp_path / str(every), model, optimizer)
        guard = guard_for(adapter, install_signals=False, exit_on_drain=False, **options)
        try:
            assert (guard.snapshot_every, adapter.takes_snapshots) == (every, every > 0)
            adapter.prepare()
            for step in range(1, 5):
                guard.step(step)
            assert adapter.snapshot_step == (3 if every else None)
        finally:
            guard.close()
    with pytest.raises(ConfigError, match="snapshot_every"):
        guard_for(TorchFiles(tmp_path / "bad", model, optimizer), snapshot_every=-1)


def test_accelerate_guard_takes_snapshot_every_on_its_one_line(tmp_path):
    """The keyword reaches the Guard through AccelerateGuard's guard options (the Trainer's and
    Lightning's callbacks pass theirs to the same `guard_for` when the fit starts: the multi-rank test)."""
    from spotguard.integrations.accelerate import AccelerateGuard

    accelerator = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=False))
    guard = AccelerateGuard(accelerator, tmp_path, snapshot_every=5, install_signals=False, exit_on_drain=False)
    try:
        assert (guard.guard.snapshot_every, guard.adapter.takes_snapshots) == (5, True)
    finally:
        guard.close()


class TorchFiles(FrameworkAdapter):
    """A framework that saves as the real ones do: `torch.save` and safetensors to paths under the
    directory it is given, a JSON file written directly, a sub-directory it makes itself."""

    def __init__(self, root, model, optimizer, unpicklable=False):
        self.model, self.optimizer, self.unpicklable = model, optimizer, unpicklable
        super().__init__(root)

    def _framework_save(self, root, step):
        import safetensors.torch

        (root / "optim").mkdir()
        torch.save(self.optimizer.state_dict(), root / "optim" / "optimizer.pt")
        safetensors.torch.save_file(self.model.state_dict(), root / "model.safetensors", metadata={"format": "pt"})
        torch.save({"step": step, "hook": (lambda: None) if self.unpicklable else None}, root / "extra.pt")
        (root / "state.json").write_text(json.dumps({"step": step}))

    def _load(self, info):
        import safetensors.torch

        self.model.load_state_dict(safetensors.torch.load_file(info.dir / "model.safetensors"))
        self.optimizer.load_state_dict(torch.load(info.dir / "optim" / "optimizer.pt", weights_only=True))


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_capture_records_the_saves_aimed_at_its_root_and_passes_every_other_through(tmp_path):
    import io

    import safetensors.torch

    real_save, real_save_file = torch.save, safetensors.torch.save_file
    root, elsewhere, stream = tmp_path / "root", tmp_path / "elsewhere.pt", io.BytesIO()
    root.mkdir()
    weights = {"w": torch.ones(3)}
    with capture.captured_saves(root) as captured:
        torch.save(weights, root / "a.pt")
        torch.save(weights, str(elsewhere))
        torch.save(weights, stream)
        safetensors.torch.save_file(weights, str(root / "sub" / "m.safetensors"), metadata={"format": "pt"})
    assert torch.save is real_save and safetensors.torch.save_file is real_save_file
    assert list(root.iterdir()) == [] and elsewhere.is_file() and stream.getvalue()
    assert captured.formats == {"a.pt": ["torch", None], "sub/m.safetensors": ["safetensors", {"format": "pt"}]}
    assert captured.objects["a.pt"] is weights


def test_the_frameworks_own_aliases_of_save_file_are_captured(tmp_path):
    import accelerate.utils.other as accelerate_io
    import safetensors.torch

    with capture.captured_saves(tmp_path) as captured:
        accelerate_io.save({"w": torch.ones(2)}, tmp_path / "model.safetensors", safe_serialization=True)
    assert accelerate_io.safe_save_file is safetensors.torch.save_file
    assert list(captured.formats) == ["model.safetensors"] and not (tmp_path / "model.safetensors").exists()


def test_save_writes_the_frameworks_files_as_copied_at_the_step_boundary(tmp_path):
    import safetensors.torch

    model, optimizer = trained()
    adapter = TorchFiles(tmp_path, model, optimizer)
    adapter.prepare()
    at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
    adapter.save_async(5, reason="notice")
    with torch.no_grad():  # training goes on while the engine persists: the checkpoint keeps the copy
        for p in model.parameters():
            p.add_(1.0)
    adapter.wait()
    assert adapter.async_error is None
    info = adapter.store.resolve(verify=True)
    assert info.step == 5 and sorted(info.files) == ["extra.pt", "model.safetensors", "optim/optimizer.pt",
                                                     "state.json"]
    saved = safetensors.torch.load_file(info.dir / "model.safetensors")
    assert all(torch.equal(saved[k], at_boundary[k]) for k in at_boundary)
    assert torch.load(info.dir / "optim" / "optimizer.pt", weights_only=True)["state"][0]["step"] == 1
    assert json.loads((info.dir / "state.json").read_text()) == {"step": 5}
    assert adapter.snapshot_engine.buffers.allocations == 1  # prepare() allocated; the notice's copy reused them
    parts = adapter.save_parts()
    assert parts.snapshot is not None and parts.persist is not None and adapter.estimate_save_seconds() > 0
    adapter.close()
    assert not adapter.scratch.exists()


def test_a_failed_save_raises_and_leaves_the_previous_checkpoint_the_newest(tmp_path):
    model, optimizer = trained()
    TorchFiles(tmp_path, model, optimizer).save(2)
    adapter = TorchFiles(tmp_path, model, optimizer, unpicklable=True)  # its extra.pt cannot be written
    with pytest.raises(CheckpointFailed, match="a rank failed to write its part"):
        adapter.save(4)
    assert adapter.store.resolve(verify=True).step == 2
    adapter.close()
    reopened = CheckpointStore(tmp_path)  # the next run's open removes the dead writer's pending directory
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".pending-", ".spotguard-"))] == []
    assert [c.step for c in reopened.list()] == [2]


def bytes_going_out(root, pattern: str) -> bool:
    """True once a file in a directory matching `pattern` under `root` holds bytes (files come and go)."""
    for path in root.glob(f"{pattern}/*"):
        try:
            if path.stat().st_size:
                return True
        except FileNotFoundError:
            continue
    return False


def test_kill_9_of_the_writer_mid_persist_leaves_the_previous_checkpoint_complete(tmp_path):
    """A real Accelerate process (the integration's adapter, the one engine) killed with SIGKILL while it
    persists step 2: the newest checkpoint is complete and verifies (step 1, or step 2 if its commit
    finished first), its files load, and the killed writer's pending directory stays invisible."""
    import safetensors.torch

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "tests.workers.framework_kill", str(ckpt), str(out)], cwd=ROOT,
                            env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not bytes_going_out(ckpt, ".pending-step-000000002-*"):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "step 2's persist never began"
            time.sleep(0.002)
        proc.kill()
    finally:
        kill_all([proc])
    store = CheckpointStore(ckpt)
    info = store.resolve(verify=True)
    assert info.step == 2 if (out / "saved-2").exists() else info.step in (1, 2)
    weights = torch.load(out / f"params-{info.step}.pt", weights_only=True)
    loaded = safetensors.torch.load_file(info.dir / "model.safetensors")
    assert sorted(loaded) == sorted(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert torch.load(info.dir / "optimizer.bin", weights_only=True)["state"]
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".pending-")] == []


def test_drain_saves_fresh_without_the_vote_for_an_adapter_that_takes_no_snapshots(tmp_path):
    """The save decision's vote is a collective on the path from the agreement to the save; an
    integration's adapter without `snapshot_every` never holds a snapshot, so the drain skips it and
    saves fresh."""
    from datetime import timedelta

    from spotguard.hooks.adapters.base import done_future
    from spotguard.hooks.agreement.collectives import Collectives
    from spotguard.wire.notice import Kind, Notice, now_utc
    from tests.helpers import drain_once

    class CountingCollectives(Collectives):
        def __init__(self):
            self.maxes = 0

        def max(self, values):
            self.maxes += 1
            return list(values)

    now = now_utc()
    urgent = Notice(id="n", kind=Kind.RECLAIM, source="aws.spot", node="n1", detected_at=now,
                    deadline=now + timedelta(milliseconds=10))  # too short for any save: a vote would weigh it
    model, optimizer = trained()
    for adapter, votes in ((TorchFiles(tmp_path / "framework", model, optimizer), 0), (SimpleNamespace(
            snapshot_step=None, estimate_save_seconds=lambda: 5.0,
            save_behind=lambda step, **kw: done_future(lambda: None)), 1)):
        collectives = CountingCollectives()
        record = drain_once(adapter, urgent, 7, collectives=collectives)
        assert record.ok and not record.used_snapshot and record.saved_step == 7
        assert collectives.maxes == votes


def test_drain_too_close_to_the_deadline_persists_the_held_framework_snapshot(tmp_path):
    """With `snapshot_every` the integration's adapter votes at the agreed step; a deadline too close
    for a fresh save persists the held snapshot: the framework's own files as they were at its step,
    committed as that step, though training changed the state since."""
    from datetime import timedelta

    import safetensors.torch

    from spotguard.wire.notice import Kind, Notice, now_utc
    from tests.helpers import drain_once

    model, optimizer = trained()
    adapter = TorchFiles(tmp_path, model, optimizer)
    adapter.takes_snapshots = True  # what guard_for(adapter, snapshot_every=N) sets
    adapter.save(2)  # a measured fresh save: the estimate the vote weighs
    adapter.snapshot(4)
    at_snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    now = now_utc()
    urgent = Notice(id="n", kind=Kind.RECLAIM, source="aws.spot", node="n1", detected_at=now,
                    deadline=now + timedelta(milliseconds=10))
    record = drain_once(adapter, urgent, 7)
    assert record.ok and record.used_snapshot and record.saved_step == 4
    info = adapter.store.resolve(verify=True)
    assert (info.step, info.metadata["snapshot"]) == (4, True)
    saved = safetensors.torch.load_file(info.dir / "model.safetensors")
    assert all(torch.equal(saved[k], at_snapshot[k]) for k in at_snapshot)
    assert json.loads((info.dir / "state.json").read_text()) == {"step": 4}
    adapter.close()


def test_lightning_last_ckpt_becomes_each_notice_checkpoint_and_the_file_it_replaced_is_freed_behind(tmp_path):
    """`<dirpath>/last.ckpt` is the committed file (one inode, two names) after each notice save; the
    file it replaced (Lightning's own last.ckpt first) is set aside under a second name and removed
    behind the commit; a second name a crash left there is removed by the next open."""
    import os

    import lightning.pytorch as pl

    from spotguard.integrations.lightning import LightningSave

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=4))
    (tmp_path / "last.ckpt").write_bytes(b"Lightning's own last.ckpt")
    adapter = LightningSave(trainer, tmp_path)
    adapter.prepare()
    for step in (1, 2):
        info = adapter.save(step, reason="notice")
        adapter.wait()
        assert os.path.samefile(tmp_path / "last.ckpt", info.dir / "last.ckpt")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trash-")] == []
    assert os.stat(tmp_path / "last.ckpt").st_nlink == 2  # step 2's file; step 1's keeps its own name
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 1
    adapter.close()
    (tmp_path / ".trash-last.ckpt-0badc0de").write_bytes(b"set aside by a writer killed before it removed it")
    CheckpointStore(tmp_path)
    assert not (tmp_path / ".trash-last.ckpt-0badc0de").exists()
