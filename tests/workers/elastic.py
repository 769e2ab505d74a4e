"""A tiny job for the in-place membership tests: one host (one rank) per process, DDP or FSDP2.

    python elastic.py --mode ddp|fsdp2|deepspeed|deepspeed-offload --ckpt DIR --out DIR --steps N [--join]

deepspeed: ZeRO-2 with a client AdamW; deepspeed-offload: ZeRO-1 with DeepSpeed's AdamW on the CPU;
deepspeed-bf16: ZeRO-2, bf16 parameters over the fp32 master (`trainer/elastic_job.build_deepspeed`),
each `DeepSpeedAdapter(in_place=True)`.

The environment names the host (SPOTGUARD_NODE) and the rendezvous (SPOTGUARD_RDZV_*); the
test harness pushes memberships by writing `<out>/membership.json` (what a sidecar would relay).
Files written into --out (the tests read them):
- progress-<node>: the last finished step;
- pid-<node>: this process's id;
- state-<tag>.pt (by rank 0; `joined` by the joiner): the full training state as full tensors at
  `resize-<n>` (right after the n-th in-place change), `joined` (a joiner, right after receiving
  the state), `handover` (the state the old group holds as a change begins), `resume` (right
  after loading a checkpoint), `save` (the agreed step) and `final`;
- resize-<node>.jsonl: one line per change (outcome, ranks, pause, phases);
- buffers-<node>.jsonl: the adapter's snapshot buffers (allocations so far, bytes) at the step
  boundary where they were (re-)allocated (`at`: "boundary"), and at the agreed step's
  @on_reclaim hook (`at`: "reclaim": what the notice's checkpoint used);
- exit-<node>: the exit status.
A reclaim notice of this host: once `<out>/notice-<node>` exists (its text: seconds to the
deadline), the rank's Guard is offered one, and the time it was offered is written to
`noticed-<node>`.
Fault injection (tests only): FAIL_AT=<phase>, FAIL_NODE=<node>, FAIL_HOW=raise|exit|hang|stop (hang:
until its parent, the launcher, is gone, or 600 s; stop: the process stops itself with SIGSTOP
after writing `stopped-<node>`, until the test sends SIGCONT).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
from spotguard.hooks.elastic import elastic_process, init_process_group
from spotguard.hooks.group_session import Timeouts
from spotguard.hooks.guard import Guard
from spotguard.processes import flush_and_exit
from spotguard.wire.notice import Kind, Notice, now_utc
from spotguard.trainer.elastic_job import (batch, build_deepspeed, build_for, deepspeed_config, membership_reader,
                                           watch_memberships)
from state_dump import flatten  # a sibling: the workers run as scripts

NODE = os.environ.get("SPOTGUARD_NODE", "?")
# mode -> (ZeRO stage, offload, bf16)
DEEPSPEED_MODES = {"deepspeed": (2, False, False), "deepspeed-offload": (1, True, False),
                   "deepspeed-bf16": (2, False, True)}


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "fsdp2", *DEEPSPEED_MODES], required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--signal-at", type=int, default=-1, help="the node --signal-node sends itself SIGTERM at this step")
    p.add_argument("--signal-node", default="")
    p.add_argument("--stop-after", type=int, default=0,
                   help="finish once this many changes happened (a joiner: once it joined), after --tail steps")
    p.add_argument("--tail", type=int, default=0, help="steps trained in the group --stop-after ends in")
    p.add_argument("--save-at", type=int, default=-1, help="every rank saves a checkpoint after this step")
    p.add_argument("--offer", action="append", default=[], metavar="STEP:JSON",
                   help="every rank's Guard is offered this membership right before STEP's agreement (repeatable)")
    return p.parse_args(argv)


def deepspeed_full_state(engine) -> dict[str, torch.Tensor]:
    """A DeepSpeed engine's state as flat full tensors through DeepSpeed's own accessors
    (collective): the model's parameters, the fp32 master, the Adam moments and step, the lr."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    zero = engine.optimizer
    stepped = any(zero.optimizer.state.get(p) for p in zero.single_partition_of_fp32_groups)
    if stepped:  # Adam's state exists from the first step on (DeepSpeed links it to the parameters lazily)
        zero._lazy_init_hp_params_optimizer_state()
    for name, param in engine.module.named_parameters():
        out[f"param/{name}"] = param.detach().clone()
        out[f"fp32/{name}"] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq") if stepped else ():
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).clone()
    for i, partition in enumerate(zero.single_partition_of_fp32_groups):
        state = zero.optimizer.state.get(partition) or {}
        step = state.get("step", zero.optimizer.param_groups[i].get("step", 0))
        out[f"step/{i}"] = torch.as_tensor(step, dtype=torch.float64).clone()
        out[f"lr/{i}"] = torch.tensor(zero.optimizer.param_groups[i]["lr"], dtype=torch.float64)
    out["global_steps"] = torch.tensor(engine.global_steps)
    return out


def full_state(adapter) -> dict[str, torch.Tensor]:
    """The full state as flat full tensors, on every rank (collective under FSDP2 and DeepSpeed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if hasattr(adapter, "engine"):
        return deepspeed_full_state(adapter.engine)
    model_state, optim_state = get_state_dict(adapter.model, adapter.optimizer,
                                              options=StateDictOptions(full_state_dict=True))
    return flatten(model_state, optim_state)


def offer_reclaim(guard, out: Path) -> bool:
    """Offers the Guard a reclaim notice of this host, due in the seconds `notice-<node>` says."""
    text = (out / f"notice-{NODE}").read_text().strip()
    if not text:
        return False  # being written
    now = now_utc()
    guard.offer(Notice(f"test-reclaim-{NODE}", Kind.RECLAIM, "test", NODE, now, now + timedelta(seconds=float(text))))
    (out / f"noticed-{NODE}").write_text(str(now.timestamp()))
    return True


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-{NODE}").write_text(str(os.getpid()))
    read_membership = membership_reader(Path(os.environ.get("TEST_MEMBERSHIP_FILE") or out / "membership.json"))
    fail_at, fail_node, fail_how = os.environ.get("FAIL_AT"), os.environ.get("FAIL_NODE"), os.environ.get("FAIL_HOW")

    def maybe_fail(phase: str) -> None:
        if phase == fail_at and NODE == fail_node:
            if fail_how == "exit":
                os._exit(1)
            if fail_how == "stop":  # frozen, threads and all, as a stopped VM or a SIGSTOP would leave it
                (out / f"stopped-{NODE}").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            if fail_how == "hang":  # alive, its connections open, doing nothing: its peers wait on it
                (out / f"hung-{NODE}").write_text(str(os.getpid()))
                parent, deadline = os.getppid(), time.monotonic() + 600
                while os.getppid() == parent and time.monotonic() < deadline:
                    time.sleep(0.2)
                os._exit(1)
            raise RuntimeError(f"injected failure at {phase}")

    # The start is not a change: processes of a loaded machine start seconds apart, so the first
    # group gets a long bound; the changes get the test's SPOTGUARD_REFORM_TIMEOUT.
    change_timeout = os.environ.get("SPOTGUARD_REFORM_TIMEOUT")
    if change_timeout and os.environ.get("SPOTGUARD_JOIN") != "1":
        os.environ["SPOTGUARD_REFORM_TIMEOUT"] = "240"
    if args.mode in DEEPSPEED_MODES:  # as a user's script does, before it joins: a joiner's warm-up reads it
        import deepspeed  # noqa: F401
    init_process_group(memberships=read_membership, join_timeout=240)
    if change_timeout:
        elastic_process().timeouts = Timeouts.of(float(change_timeout))
    maybe_fail("formed-joiner")
    if args.mode in DEEPSPEED_MODES:
        from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter

        stage, offload, bf16 = DEEPSPEED_MODES[args.mode]
        adapter = DeepSpeedAdapter(build_deepspeed(stage, offload, bf16), checkpoint_dir=args.ckpt, in_place=True,
                                   config_for=lambda world: deepspeed_config(world, stage, offload, bf16))
    else:
        build = build_for(args.mode)
        model, optimizer = build()
        adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=args.ckpt, build=build)
    guard = Guard.from_env(adapter=adapter, in_place=True)

    def dump(tag: str) -> None:
        state = full_state(adapter)
        if dist.get_rank() == 0 or tag == "joined":
            torch.save(state, out / f"state-{tag}.pt")

    @guard.on_resize_phase
    def phase(name, record):
        if name == "handover":  # still the old group: every rank of it is here
            dump("handover")
        maybe_fail(name)

    allocated = [0]

    def note_buffers(at: str, step: int) -> None:
        buffers = adapter.snapshot_engine.buffers
        if at == "reclaim" or buffers.allocations != allocated[0]:
            allocated[0] = buffers.allocations
            with open(out / f"buffers-{NODE}.jsonl", "a") as f:
                f.write(json.dumps({"at": at, "step": step, "allocations": buffers.allocations,
                                    "nbytes": buffers.nbytes}) + "\n")

    @guard.on_reclaim
    def saved(step, notice):
        note_buffers("reclaim", step)
        dump("save")

    watch_memberships(read_membership, guard.view)
    process = elastic_process()
    joining = os.environ.get("SPOTGUARD_JOIN") == "1" or (process is not None and process.joined is not None)
    start = guard.resume()
    dump("joined" if joining else ("resume" if start else "start"))
    changes = 0
    code = 0
    noted = None

    def note_change() -> bool:
        """Appends the Guard's newest change to resize-<node>.jsonl; whether there was a new one."""
        nonlocal noted
        record = guard.resizes[-1] if guard.resizes else None  # a leave or fallback exits: no step result
        if record is None or record is noted:
            return False
        noted = record
        with open(out / f"resize-{NODE}.jsonl", "a") as f:
            f.write(json.dumps({"step": record.step, "outcome": record.outcome.value, "old_rank": record.old_rank,
                                "new_rank": record.new_rank, "world": record.new_world_size,
                                "pause": record.pause_seconds, "phases": record.phases, "error": record.error,
                                "durable": record.durable, "pid": os.getpid()}) + "\n")
        return True

    offers: dict[int, list[dict]] = {}
    for item in args.offer:
        at, _, data = item.partition(":")
        offers.setdefault(int(at), []).append(json.loads(data))
    noticed = False
    step, end = start, (start + args.tail if joining and args.stop_after else args.steps)
    try:
        while step < end:
            x, y = batch(step, guard.rank, guard.world_size)
            if args.mode in DEEPSPEED_MODES:  # the engine is made again by a change: read it every step
                engine = adapter.engine
                dtype = next(engine.module.parameters()).dtype
                prediction = engine(x.to(dtype)).float()
                engine.backward(torch.nn.functional.mse_loss(prediction, y))
                engine.step()
            else:
                adapter.optimizer.zero_grad()
                torch.nn.functional.mse_loss(adapter.model(x), y).backward()
                adapter.optimizer.step()
            (out / f"progress-{NODE}").write_text(str(step))
            if step == args.signal_at and NODE == args.signal_node:
                os.kill(os.getpid(), signal.SIGTERM)
            if step == args.save_at:
                adapter.save(step, reason="test")
            for data in offers.get(step, ()):
                guard.view.offer(data)
            if not noticed and (out / f"notice-{NODE}").exists():
                noticed = offer_reclaim(guard, out)
            time.sleep(args.step_sleep)
            guard.step(step)
            note_buffers("boundary", step)
            if note_change():
                changes += 1
                dump(f"resize-{changes}")
                if args.stop_after and changes == args.stop_after:
                    end = min(end, step + 1 + args.tail)
            step += 1
        dump("final")
    except SystemExit as exc:
        note_change()
        code = exc.code if isinstance(exc.code, int) else 1
    (out / f"exit-{NODE}").write_text(str(code))
    guard.close()
    return code


if __name__ == "__main__":
    # past torch's and DeepSpeed's C++ teardown at interpreter exit, which aborted a DeepSpeed
    # offload rank after its work was done ("terminate called without an active exception", -6)
    flush_and_exit(main())
