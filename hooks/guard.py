"""The Guard: one per training rank; turns a notice into the same checkpoint step on every rank.

Usage (every rank, after `init_process_group`, in the same order on every rank):

    guard = Guard.from_env(checkpoint_dir="/ckpt")
    adapter = TorchDCPAdapter(guard, model, optimizer)     # or DeepSpeedAdapter / PlainTorchAdapter
    start = guard.resume()
    for step in range(start, total):
        train_one_step()
        guard.step(step)                                   # after step `step` is complete

Contract:
- Notices arrive on a background thread (the sidecar's stream, `SPOTGUARD_SIDECAR_URL`) and from
  SIGTERM / extra signals (a `drain` notice, deadline = received + grace). Until one arrives the
  loop pays one `all_reduce(MAX)` of a preallocated 3-element CPU tensor every `agree_every`
  steps, on the Guard's own gloo group (nothing at all in a single-process job). With
  `pipeline=True` that all_reduce runs in the background during the next step and is read at
  the next agreement (cost ~0; a notice is then acted on one agreement later).
- `piggyback_on(ddp_model)` (TorchDCPAdapter does it for DDP models) carries the "notice pending
  here" flag as one extra element of the model's own last gradient bucket (a DDP communication
  hook): every rank reads the same count, and only when it is non-zero does the blocking
  agreement run. A step without a notice then costs no collective of the Guard's own, and a
  notice is still acted on at the boundary of the step it arrived in (or the next, if it came
  after that step's last bucket was sent).
- Kinds in `act_on` (default: everything but `rebalance`) are acted on; a notice whose id the
  resumed checkpoint already answered is ignored; a withdrawal clears a notice not yet agreed.
- A notice whose deadline is more than `horizon_seconds` away (default 120: AWS's lead time, so
  reclaims are acted on at once) is held and acted on only once its deadline comes that close:
  a maintenance announced an hour ahead does not stop training now, and one the cloud cancels
  meanwhile never does.
- The agreement carries [any notice, earliest deadline, lowest rank holding one]; that rank
  broadcasts its notice, so at the agreed step every rank acts on the same notice and deadline.
- At that step every rank: decides fresh save vs. persisting the last in-memory snapshot (a
  collective vote: the snapshot is used when any rank's estimate of a fresh save, from measured
  save times plus `save_margin_seconds`, does not fit before the deadline and every rank holds a
  snapshot of the same step); runs the adapter's save, then the `@on_reclaim` hooks
  (`hook(step, notice)`); agrees that every rank succeeded; reports `checkpoint-durable` (or
  `failed`) with the seconds taken to the sidecar; runs `@on_drain` hooks and reports `drained`;
  then exits with `EXIT_PREEMPTED` (83), or `EXIT_CHECKPOINT_FAILED` (84) when any rank failed.
  With `exit_on_drain=False`, `step()` returns True instead of exiting (`last_drain` tells what happened).
  After a drain the process ends with that code even if torch's C++ teardown would abort:
  an atexit hook flushes logging/stdio and calls `os._exit(code)` (`hard_exit=False` disables it).
- `resume()` loads through the attached adapter and the `@on_resume` hooks and returns the step
  to start from (0 without a checkpoint).
- Bad configuration raises `spotguard.config.ConfigError` naming the field.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import signal as signal_module
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Protocol

from spotguard.wire.notice import Kind, Notice
from spotguard.config import ConfigError, http_url, positive_float, positive_int
from spotguard.wire import names
from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.notice_listener import NoticeListener
from spotguard.hooks.signals import SignalTrap

log = logging.getLogger("spotguard.hooks.guard")

ACT_ON = frozenset({Kind.RECLAIM, Kind.DRAIN, Kind.MAINTENANCE, Kind.GPU_FAULT})


class CheckpointAdapter(Protocol):
    """What the Guard needs from a framework adapter (see spotguard.hooks.adapters)."""

    snapshot_step: int | None

    def save(self, step: int, *, reason: str, notice: Notice | None = None) -> None:
        """Collective: a fresh checkpoint of `step`, durable (committed) when it returns on every rank."""

    def snapshot(self, step: int) -> None:
        """Local: keep an in-memory copy of the state after `step` (same steps on every rank)."""

    def persist_snapshot(self, *, reason: str, notice: Notice | None = None) -> int:
        """Collective: make the last snapshot a durable checkpoint; returns its step."""

    def estimate_save_seconds(self) -> float | None:
        """Expected seconds for a fresh save, from measured saves (None: no measurement yet)."""

    def resume(self) -> int | None:
        """Loads the newest complete checkpoint; the step to start from, or None without one."""


@dataclass
class DrainRecord:
    """What happened at the agreed step."""

    step: int  # the step at which every rank agreed
    saved_step: int  # the step the durable checkpoint holds (older when a snapshot was persisted)
    notice: Notice
    used_snapshot: bool
    ok: bool
    exit_code: int
    checkpoint_seconds: float
    drain_seconds: float
    hooks_started_at: float  # time.time() when this rank started the reclaim hooks

    @property
    def steps_lost(self) -> int:
        return self.step - self.saved_step


def _deadline_ts(notice: Notice) -> float:
    return notice.deadline.timestamp() if notice.deadline is not None else math.inf


class Guard:
    """One per rank. See the module docstring for the contract."""

    def __init__(self, *, checkpoint_dir: str | os.PathLike | None = None, sidecar_url: str | None = None,
                 token_file: str | None = None, grace_seconds: float = 30.0, agree_every: int = 1,
                 extra_signals: Iterable[int] = (), snapshot_every: int = 0, save_margin_seconds: float = 1.0,
                 act_on: Iterable[Kind | str] = ACT_ON, exit_on_drain: bool = True, process_group: Any = None,
                 install_signals: bool = True, hard_exit: bool = True, pipeline: bool = False,
                 horizon_seconds: float = 120.0):
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.grace_seconds = positive_float("grace_seconds", grace_seconds)
        self.agree_every = positive_int("agree_every", agree_every)
        self.snapshot_every = positive_int("snapshot_every", snapshot_every, allow_zero=True)
        self.save_margin_seconds = positive_float("save_margin_seconds", save_margin_seconds, allow_zero=True)
        try:
            self.act_on = frozenset(Kind(k) for k in act_on)
        except ValueError as exc:
            raise ConfigError("act_on", str(exc)) from None
        self.exit_on_drain = exit_on_drain
        self.horizon_seconds = positive_float("horizon_seconds", horizon_seconds)
        self._held: dict[str, Notice] = {}  # actionable notices whose deadline is beyond the horizon
        self.hard_exit = hard_exit
        self.pipeline = pipeline
        self._work = None
        self._contributed: Notice | None = None
        self.sidecar_url = None if sidecar_url is None else http_url(names.ENV_SIDECAR_URL, sidecar_url)

        self._reclaim_hooks: list[Callable] = []
        self._drain_hooks: list[Callable] = []
        self._resume_hooks: list[Callable] = []
        self.adapter: CheckpointAdapter | None = None
        self.last_drain: DrainRecord | None = None
        self._ignored_ids: set[str] = set()
        self._lock = threading.Lock()
        self._pending: Notice | None = None

        self._exit_code: int | None = None
        self._setup_distributed(process_group)
        atexit.register(self._exit_after_drain)
        self.reporter = (HookReporter(self.sidecar_url, token_file, self.rank, self.world_size)
                         if self.sidecar_url else None)

        self._trap: SignalTrap | None = None
        if install_signals:
            self._trap = SignalTrap(self.grace_seconds, (signal_module.SIGTERM, *extra_signals))
            self._trap.install()
        self.listener: NoticeListener | None = None
        if self.sidecar_url:
            self.listener = NoticeListener(self.sidecar_url, self._offer, self._withdraw)
            self.listener.start()

    @classmethod
    def from_env(cls, checkpoint_dir: str | os.PathLike | None = None, grace_seconds: float | None = None,
                 agree_every: int | None = None, **kwargs) -> "Guard":
        """A Guard configured from SPOTGUARD_* variables (docs/protocols.md); arguments win over them."""
        env = os.environ
        url = env.get(names.ENV_SIDECAR_URL) or None
        if grace_seconds is None:
            grace_seconds = positive_float(names.ENV_GRACE_SECONDS, env.get(names.ENV_GRACE_SECONDS) or 30)
        if agree_every is None:
            agree_every = positive_int(names.ENV_AGREE_EVERY, env.get(names.ENV_AGREE_EVERY) or 1)
        if "horizon_seconds" not in kwargs and env.get(names.ENV_HORIZON_SECONDS):
            kwargs["horizon_seconds"] = positive_float(names.ENV_HORIZON_SECONDS, env[names.ENV_HORIZON_SECONDS])
        kwargs.setdefault("sidecar_url", url)
        kwargs.setdefault("token_file", env.get(names.ENV_TOKEN_FILE) or None)
        return cls(checkpoint_dir=checkpoint_dir, grace_seconds=grace_seconds, agree_every=agree_every, **kwargs)

    def _setup_distributed(self, process_group: Any) -> None:
        self._distributed = False
        self.rank, self.world_size = 0, 1
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        elif int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise RuntimeError("create the Guard after torch.distributed.init_process_group (WORLD_SIZE > 1)")
        if self.world_size > 1:
            self._distributed = True
            self._dist = dist
            self._group = process_group if process_group is not None else dist.new_group(backend="gloo")
            self._flag = torch.zeros(3, dtype=torch.float64)
            self._piggyback = False
            self._piggy_count = 0.0
            self._carrier = None  # last gradient bucket + the flag, reused every step
            self._idle = torch.tensor([0.0, -math.inf, -float(self.world_size)], dtype=torch.float64)
            self._torch = torch

    def piggyback_on(self, ddp_model: Any) -> bool:
        """Carries the agreement flag inside `ddp_model`'s gradient all_reduce (see the module
        docstring). Every rank calls it once, before the first backward. Returns False (and the
        Guard keeps its own agreement) when not distributed or the model already has a hook."""
        if not self._distributed or self.pipeline:
            return False
        try:
            ddp_model.register_comm_hook(ddp_model.process_group, self._gradient_hook)
        except (RuntimeError, AttributeError) as exc:
            log.info("not piggybacking on the model's all_reduce (%s): using the Guard's own agreement", exc)
            return False
        self._piggyback = True
        return True

    def _gradient_hook(self, group, bucket):  # no annotations: DDP checks them against its own types
        """DDP communication hook: the default mean all_reduce, plus the flag on the last bucket."""
        dist = self._dist
        # As DDP's built-in reduction: scale by 1/world before summing (bit-identical gradients)
        tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
        last = bucket.is_last()
        if last:
            # a caught signal counts already: step() turns it into the notice before agreeing
            trapped = self._trap is not None and self._trap.received is not None
            n = tensor.numel()
            carrier = self._carrier
            if carrier is None or carrier.numel() != n + 1 or carrier.dtype != tensor.dtype \
                    or carrier.device != tensor.device:
                # once (again only if DDP rebuilds its buckets): no allocation in later steps
                carrier = self._carrier = self._torch.empty(n + 1, dtype=tensor.dtype, device=tensor.device)
            carrier[:n].copy_(tensor)
            carrier[n] = 1.0 if self._pending is not None or trapped else 0.0
            tensor = carrier
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finish(done):
            out = done.value()[0]
            if last:
                self._piggy_count = float(out[-1].item())
                out = out[:-1]
            return out

        return future.then(finish)

    # ---- registration ---------------------------------------------------------------------
    def on_reclaim(self, fn: Callable) -> Callable:
        """Decorator: `fn(step, notice)` runs on every rank at the agreed step (the checkpoint)."""
        self._reclaim_hooks.append(fn)
        return fn

    def on_drain(self, fn: Callable) -> Callable:
        """Decorator: `fn(step, notice)` runs on every rank after the checkpoint is durable."""
        self._drain_hooks.append(fn)
        return fn

    def on_resume(self, fn: Callable) -> Callable:
        """Decorator: `fn()` runs in `resume()`; a non-None return is the step to start from."""
        self._resume_hooks.append(fn)
        return fn

    def attach(self, adapter: CheckpointAdapter) -> None:
        """Makes `adapter` the checkpoint of this job (adapters call this themselves)."""
        if self.adapter is not None and self.adapter is not adapter:
            raise ValueError("the Guard already has an adapter")
        self.adapter = adapter

    def resume(self) -> int:
        """Loads the newest checkpoint (adapter, then @on_resume hooks); the step to start from."""
        start = 0
        if self.adapter is not None:
            loaded = self.adapter.resume()
            if loaded is not None:
                start = loaded
            answered = (getattr(self.adapter, "resumed_metadata", None) or {}).get("notice_id")
            if answered:
                self._ignored_ids.add(answered)
                with self._lock:
                    if self._pending is not None and self._pending.id == answered:
                        self._pending = None
        for hook in self._resume_hooks:
            value = hook()
            if value is not None:
                start = int(value)
        return start

    # ---- notices in -----------------------------------------------------------------------
    def _offer(self, notice: Notice) -> None:
        """Keeps the most urgent actionable notice (called from the listener thread)."""
        if notice.kind not in self.act_on:
            log.info("notice %s (%s) noted, not acted on (act_on: %s)", notice.id, notice.kind,
                     ", ".join(sorted(k.value for k in self.act_on)))
            return
        if notice.id in self._ignored_ids:
            log.info("notice %s was already answered by the checkpoint this job resumed from", notice.id)
            return
        left = notice.seconds_left()
        with self._lock:
            if left is not None and left > self.horizon_seconds:
                if notice.id not in self._held:
                    log.warning("notice %s (%s) is due in %.0fs: held until %.0fs before its deadline",
                                notice.id, notice.kind, left, self.horizon_seconds)
                self._held[notice.id] = notice
                return
            self._held.pop(notice.id, None)
            current = self._pending
            if current is None or current.id == notice.id or _deadline_ts(notice) < _deadline_ts(current):
                self._pending = notice
        log.warning("notice %s (%s, deadline %s): checkpoint at the next agreed step", notice.id, notice.kind,
                    notice.deadline.isoformat() if notice.deadline else "none")

    def _withdraw(self, notice_id: str) -> None:
        with self._lock:
            if self._held.pop(notice_id, None) is not None:
                log.warning("notice %s withdrawn while held: training continues", notice_id)
            if self._pending is not None and self._pending.id == notice_id:
                self._pending = None
                log.warning("notice %s withdrawn before the ranks agreed on it: training continues", notice_id)

    # ---- the step boundary ----------------------------------------------------------------
    def step(self, step: int) -> bool:
        """Call after step `step` on every rank; drains here when the ranks agree on a notice."""
        if self._trap is not None and self._trap.received is not None:
            notice = self._trap.take()
            if notice is not None:
                self._offer(notice)
        if self._held:
            self._release_held()
        if self._distributed and self._piggyback:
            count, self._piggy_count = self._piggy_count, 0.0
            if count > 0:  # the same reduced count on every rank: all take this path together
                agreed = self._agree_now()
                if agreed is not None:
                    return self._drain(step, *agreed)
        elif self._distributed:
            if step % self.agree_every == 0:
                agreed = self._agree_pipelined() if self.pipeline else self._agree_now()
                if agreed is not None:
                    return self._drain(step, *agreed)
        else:
            pending = self._pending
            if pending is not None:
                return self._drain(step, pending, _deadline_ts(pending), 0)
        if self.snapshot_every and self.adapter is not None and step % self.snapshot_every == 0:
            self.adapter.snapshot(step)
        return False

    def _release_held(self) -> None:
        """Offers the held notices whose deadline has come within the horizon."""
        with self._lock:
            due = [n for n in self._held.values() if (n.seconds_left() or 0.0) <= self.horizon_seconds]
        for notice in due:
            self._offer(notice)

    def _contribute(self, flag) -> Notice | None:
        pending = self._pending
        if pending is None:
            flag.copy_(self._idle)
        else:
            flag.copy_(self._torch.tensor([1.0, -_deadline_ts(pending), -float(self.rank)], dtype=self._torch.float64))
        return pending

    @staticmethod
    def _verdict(flag, pending: Notice | None) -> tuple[Notice | None, float, int] | None:
        if flag[0].item() > 0:
            return pending, -flag[1].item(), int(-flag[2].item())
        return None

    def _agree_now(self):
        """Blocking agreement: this boundary's flags, one all_reduce(MAX)."""
        pending = self._contribute(self._flag)
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self._group)
        return self._verdict(self._flag, pending)

    def _agree_pipelined(self):
        """Overlapped agreement: waits for the all_reduce started at the previous agreement (done
        by now: a step ran meanwhile), acts on it, else starts this boundary's one in the background."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            verdict = self._verdict(self._flag, self._contributed)
            if verdict is not None:
                return verdict
        self._contributed = self._contribute(self._flag)
        self._work = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
        return None

    def _all(self, ok: bool) -> bool:
        if not self._distributed:
            return ok
        t = self._torch.tensor([1 if ok else 0], dtype=self._torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        return bool(t.item())

    def _agreed_notice(self, pending: Notice | None, source_rank: int, deadline_ts: float) -> Notice:
        """The notice every rank acts on: the one `source_rank` contributed to the agreement."""
        if self._distributed:
            torch = self._torch
            payload = b""
            if self.rank == source_rank and pending is not None:
                payload = pending.to_json().encode()
            size = torch.tensor([len(payload)], dtype=torch.int64)
            self._dist.broadcast(size, src=source_rank, group=self._group)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(size.item()), dtype=torch.uint8)
            self._dist.broadcast(data, src=source_rank, group=self._group)
            notice = Notice.from_json(data.numpy().tobytes())
        else:
            notice = pending
        if math.isfinite(deadline_ts):
            notice = notice.with_deadline(datetime.fromtimestamp(deadline_ts, timezone.utc))
        return notice

    def _use_snapshot(self, notice: Notice) -> bool:
        """Collective vote: persist the last snapshot instead of a fresh save?"""
        adapter = self.adapter
        if adapter is None:
            return False
        left = notice.seconds_left()
        estimate = adapter.estimate_save_seconds() or 0.0
        too_short = left is not None and left < estimate + self.save_margin_seconds
        snap = adapter.snapshot_step if adapter.snapshot_step is not None else -1
        if self._distributed:
            t = self._torch.tensor([1.0 if too_short else 0.0, snap, -snap], dtype=self._torch.float64)
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._group)
            too_short, high, low = t[0].item() > 0, t[1].item(), -t[2].item()
        else:
            high = low = snap
        if not too_short:
            return False
        if low == high and low >= 0:
            return True
        log.warning("deadline too close for a fresh save (%.2fs left, estimate %.2fs) but no common snapshot: saving fresh",
                    left if left is not None else float("nan"), estimate)
        return False

    def _drain(self, step: int, pending: Notice | None, deadline_ts: float, source_rank: int) -> bool:
        notice = self._agreed_notice(pending, source_rank, deadline_ts)
        started = time.time()
        t0 = time.monotonic()
        saved_step, used_snapshot, ok = step, False, True
        try:
            used_snapshot = self._use_snapshot(notice)
            if self.adapter is not None:
                if used_snapshot:
                    saved_step = self.adapter.persist_snapshot(reason="notice", notice=notice)
                    log.warning("deadline too close for a fresh save: persisted the in-memory snapshot of step %d "
                                "(agreed at step %d, %d steps lost)", saved_step, step, step - saved_step)
                else:
                    self.adapter.save(step, reason="notice", notice=notice)
            elif not self._reclaim_hooks:
                log.warning("notice %s: no adapter and no @on_reclaim hook, nothing was saved", notice.id)
            for hook in self._reclaim_hooks:
                hook(step, notice)
        except BaseException as exc:  # noqa: BLE001 - a failed save must still drain with its own exit code
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                raise
            log.exception("checkpoint for notice %s at step %d failed on rank %d", notice.id, step, self.rank)
            ok = False
        ok = self._all(ok)
        checkpoint_seconds = time.monotonic() - t0
        extra = {"steps_lost": step - saved_step, "saved_step": saved_step}
        if self.reporter is not None:
            self.reporter.report(notice.id, saved_step, "checkpoint-durable" if ok else "failed", checkpoint_seconds, **extra)
        drain_seconds = 0.0
        if ok:
            t1 = time.monotonic()
            for hook in self._drain_hooks:
                try:
                    hook(step, notice)
                except Exception:  # noqa: BLE001 - the checkpoint is durable; leave anyway
                    log.exception("@on_drain hook %s failed", getattr(hook, "__name__", hook))
            drain_seconds = time.monotonic() - t1
            if self.reporter is not None:
                self.reporter.report(notice.id, saved_step, "drained", drain_seconds, **extra)
        code = EXIT_PREEMPTED if ok else EXIT_CHECKPOINT_FAILED
        self.last_drain = DrainRecord(step, saved_step, notice, used_snapshot, ok, code, checkpoint_seconds,
                                      drain_seconds, started)
        log.warning("rank %d drained for notice %s at step %d (checkpoint of step %d %s in %.3fs): exit %d",
                    self.rank, notice.id, step, saved_step, "durable" if ok else "FAILED", checkpoint_seconds, code)
        self._ignored_ids.add(notice.id)  # answered: a re-sent or updated copy does not drain again
        with self._lock:
            if self._pending is not None and self._pending.id == notice.id:
                self._pending = None
        if self.exit_on_drain:
            if self.hard_exit:
                self._exit_code = code
            self.close()
            self._leave_process_groups()
            raise SystemExit(code)
        return True

    def _exit_after_drain(self) -> None:
        """atexit: after a drain, end the process with the drain's code once Python's exit handlers
        registered after the Guard ran. Skips C++ static destructors, which intermittently abort
        (SIGABRT) in torch's gloo/store teardown and would turn an 83 into a crash."""
        if self._exit_code is None:
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(self._exit_code)

    def _leave_process_groups(self) -> None:
        """Every rank leaves together: a last agreement, then the process groups are destroyed, so
        no rank tears a connection down while a peer's gloo thread still uses it."""
        if not self._distributed:
            return
        try:
            self._all(True)
            self._dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            log.warning("process groups not destroyed cleanly: %s", exc)

    def close(self) -> None:
        """Stops the listener, restores signal handlers, closes the adapter."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        if self.listener is not None:
            self.listener.stop()
        if self._trap is not None:
            self._trap.uninstall()
        close = getattr(self.adapter, "close", None)
        if close is not None:
            close()
        if self._exit_code is None:
            atexit.unregister(self._exit_after_drain)
