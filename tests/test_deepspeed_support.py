"""Which DeepSpeed jobs change membership in place (`deepspeed_support.refusal`, pure), the same
check on real engines (one rank, its own process: ZeRO-3, ZeRO-0, SGD and round-robin gradients are
refused and logged once each, at start; ZeRO-1/2 with Adam or AdamW are resizable), and a joiner's
warm-up: its first engine, built inside the new group while the survivors wait, imports little;
an engine made again in one process releases the one before."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from spotguard.hooks.adapters.deepspeed_support import EngineFacts, refusal
from spotguard.hooks.adapters.deepspeed_zero import carried_micro_steps
from tests.s3_server import free_ports

WORKER = Path(__file__).parent / "workers" / "deepspeed_support.py"
SUPPORTED = EngineFacts(zero_stage=2, pipeline=False, optimizer="AdamW", offload_optimizer="none",
                        offload_param="none", round_robin_gradients=False, model_parallel_size=1,
                        sequence_parallel_size=1, expert_parallel=False)


@pytest.mark.parametrize("change, reason", [
    ({"zero_stage": 3}, "ZeRO stage 3 is not supported"),
    ({"zero_stage": 0}, "ZeRO stage 0 is not supported"),
    ({"pipeline": True}, "pipeline parallelism"),
    ({"optimizer": "Lamb"}, "optimizer 'Lamb' is not supported"),
    ({"optimizer": "SGD"}, "optimizer 'SGD' is not supported"),
    ({"offload_optimizer": "nvme"}, "offload_optimizer to 'nvme'"),
    ({"offload_param": "nvme"}, "offload_param to 'nvme'"),
    ({"round_robin_gradients": True}, "round_robin_gradients"),
    ({"model_parallel_size": 2}, "tensor parallelism"),
    ({"sequence_parallel_size": 2}, "sequence parallelism"),
    ({"expert_parallel": True}, "expert parallelism"),
])
def test_what_the_in_place_path_does_not_support_is_named(change, reason):
    assert reason in (refusal(replace(SUPPORTED, **change)) or "")


@pytest.mark.parametrize("change", [{}, {"zero_stage": 1}, {"optimizer": "Adam"}, {"optimizer": "DeepSpeedCPUAdam"},
                                    {"offload_optimizer": "cpu"}, {"optimizer": "FusedAdam"}])
def test_zero_1_and_2_with_adam_on_the_accelerator_or_the_cpu_are_supported(change):
    assert refusal(replace(SUPPORTED, **change)) is None


def test_the_micro_step_count_follows_the_new_groups_accumulation(caplog):
    """10 optimizer steps of 2 micro-batches at 4 ranks = 20 micro steps; at 2 ranks a step takes
    4: 40, so DeepSpeed's next boundary comes after 4 micro-batches, not 2."""
    assert carried_micro_steps(20, 2, 4) == 40 and carried_micro_steps(40, 4, 2) == 20
    assert carried_micro_steps(7, 1, 3) == 21 and not caplog.records
    assert carried_micro_steps(21, 2, 2) == 20 and "not carried" in caplog.text  # mid-step: the partial one drops


def run_worker(tmp_path, *flags: str) -> dict:
    env = {**os.environ, "CKPT": str(tmp_path / "ckpt")}
    result = subprocess.run([sys.executable, str(WORKER), str(free_ports(1)[0]), *flags], capture_output=True,
                            text=True, timeout=300, env=env, cwd=WORKER.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_real_engines_are_checked_at_start_and_a_refusal_is_logged_once(tmp_path):
    out = run_worker(tmp_path)
    engines = out["engines"]
    assert {name for name, e in engines.items() if e["resizable"]} == {"zero2-client-adamw", "zero1-client-adam"}
    assert "ZeRO stage 3" in engines["zero3"]["refusal"] and "ZeRO stage 0" in engines["zero0"]["refusal"]
    assert "'SGD'" in engines["zero2-client-sgd"]["refusal"]
    assert "round_robin_gradients" in engines["zero2-round-robin"]["refusal"]
    assert out["warnings"] == 4  # one line per refused engine, at its adapter's start
    # A joiner builds its first engine inside the new group while the survivors wait. Without the
    # warm-up, DeepSpeed's first initialize imports about 1500 modules (torch.compile's inductor, by
    # its Muon optimizer): about 1.5 s of CPU in the survivors' pause.
    assert out["first_engine_modules"] < 500, out
    # An engine made again in the same process (3 times) releases the one before (DeepSpeed #7204:
    # the module's forward hooks kept every old engine, and its buffers, alive) and keeps the state.
    assert out["engines_alive"] == 1 and out["rebuilt_equal"], out
    # The loss scaler's fields (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis), set to
    # values of their own before each rebuild, are the new engine's: fp32 here (no fp16 on a CPU),
    # through the manifest fp16's dynamic scaler would go through.
    assert out["scaler_carried"], out
    # DeepSpeed's CPU Adam asks py-cpuinfo at every engine, which starts a process each time (~1 s in
    # a change's pause); once the first answer is kept, three more questions start none.
    assert out["cpu_info_processes"] == 0, out


@pytest.mark.slow
def test_without_the_warm_up_the_first_engine_imports_far_more(tmp_path):
    """The control of the test above: the count is one the warm-up changes."""
    assert run_worker(tmp_path, "--no-warm-up")["first_engine_modules"] > 1000
