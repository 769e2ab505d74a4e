"""Crash consistency: SIGKILL the saving process at random points; every resume is complete.

A zygote process imports torch and the store once, then forks one saving child per trial (so
a trial costs milliseconds, not a torch import). Each child opens the store (which finishes or
cleans up what the previous, killed child left), resolves the newest checkpoint that verifies,
checks that every tensor in it carries the step it claims and that `latest` names it, then saves
step after step until it is SIGKILLed. Trials alternate between the snapshot engine (a copy into
buffers allocated once, then the copy persisted as `torch.save` shards written by threads at once
and committed in the background, as the plain adapter saves) and plain multi-file `write_bytes` saves. Two lanes:
- `unique`: every step is a new tag;
- `recommit`: most steps re-commit the one tag `rolling` (every fifth step a new tag, so
  retention runs beside the re-commits).
Kills come from the test after a random delay (`time`), or from the child itself just before
its K-th file-system change under the store root (`op`: K random, any step of cleanup,
recovery, begin, writes, commit or retention; `op-open`: K small, inside the open), or just
before a re-commit renames the pending dir into place, when the old copy is already set
aside (`window`). The child's own kills use a Python audit hook installed in that child only.

SPOTGUARD_CRASH_TRIALS (default 30) sets the number of kills per lane; SPOTGUARD_CRASH_SEED
fixes the random choices. Each lane prints a summary line (run pytest with -s to see it).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

# The zygotes' common end: one forked child per stdin line, running the script's `child(words)`;
# a hung child dumps its stacks after HANG_SECONDS and dies.
FORK_LOOP = r'''
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
        try:
            child(line.split())
            os._exit(0)
        except BaseException as exc:
            say("error", repr(exc).replace("\n", " "))
            os._exit(1)
    say("pid", pid)
    _, status = os.waitpid(pid, 0)
    say("exit", pid, status)
'''

ZYGOTE = r'''
import os, sys, signal, itertools
os.environ["OMP_NUM_THREADS"] = "1"
import torch
from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.hooks.checkpoint.engine import SnapshotEngine
from spotguard.hooks.checkpoint.torchshards import load_torch_shards, save_torch_shards

ROLLING = "rolling"
PHASE = ["start"]
ARMED = [False]  # the commit under way re-commits ROLLING

def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())

def arm(root, kill):
    """Installs an audit hook that SIGKILLs this process before its K-th change under root."""
    target = int(kill[3:]) if kill.startswith("op:") else None
    count = itertools.count(1)
    pending, final = os.path.join(root, ".pending-" + ROLLING), os.path.join(root, ROLLING)
    watched = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree")

    def hook(event, args):
        if event not in watched or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if event == "open":
            mode, flags = args[1], args[2]
            if not ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                    or (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))):
                return
        dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") else None
        if not path.startswith(root + os.sep) and dir_fd in (None, -1):
            return
        if target is not None:
            hit = next(count) == target
        else:
            hit = event == "os.rename" and ARMED[0] and path == pending and os.fsdecode(args[1]) == final
        if hit:
            say("kill", PHASE[0], event, os.path.basename(path))
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)

def make_state(step, arrays):
    for i, t in enumerate(arrays):
        t.fill_(step * 10 + i)
    return {"model": {f"w{i}": t for i, t in enumerate(arrays)}, "step": step}

def check(state, step):
    for i, t in enumerate(state["model"].values()):
        if not bool((t == step * 10 + i).all()):
            return False
    return state["step"] == step

def tag_for(lane, step):
    if lane == "recommit" and step % 5:
        return ROLLING
    return f"step-{step:06d}"

def trial(root, mode, lane, max_steps):
    names = lambda: sorted(n for n in os.listdir(root) if n.startswith((".pending-", ".trash-", ".replaced-")))
    before = names() if os.path.isdir(root) else []
    PHASE[0] = "open"
    store = CheckpointStore(root, keep_last=2)
    PHASE[0] = "resume"
    say("opened", len(before), len(names()))
    info = store.resolve(verify=True)
    step = 0
    if info is not None:
        step = info.step
        if info.metadata["mode"] == "fast":
            state = load_torch_shards(info.dir, "state")
        else:
            state = {"model": {}, "step": info.metadata["step"]}
            for name in sorted(info.files):
                raw = (info.dir / name).read_bytes()
                state["model"][name] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        with open(os.path.join(root, "latest")) as f:
            pointer = "latest-ok" if f.read() == info.tag else "latest-STALE"
        say("resumed", step, "valid" if check(state, step) else "INVALID", pointer)
    else:
        say("resumed", 0, "valid", "latest-ok")
    # ~600 KB of state in tensors of uneven sizes
    arrays = [torch.empty(n, dtype=torch.float32) for n in (90_000, 40_000, 15_000, 5_000, 1_000)]
    engine = SnapshotEngine(check_memory=False) if mode == "fast" else None

    def persist(copy, tag, meta):
        pending = store.begin(tag)
        save_torch_shards(pending, "state", copy, shards=3)  # files written by threads at once
        pending.finish_rank(0)
        return store.commit(tag, world_size=1, metadata=meta)
    PHASE[0] = "save"
    for step in range(step + 1, step + 1 + max_steps):
        state = make_state(step, arrays)
        tag = tag_for(lane, step)
        ARMED[0] = tag == ROLLING and os.path.isdir(os.path.join(root, ROLLING))
        meta = {"step": step, "mode": mode, "reason": "notice" if step % 7 == 0 else "periodic"}
        if engine is not None:
            snap = engine.snapshot(state, step=step)
            engine.persist(snap, lambda copy, tag=tag, meta=meta: persist(copy, tag, meta)).result()
        else:
            pending = store.begin(tag)
            for i, t in enumerate(arrays):
                pending.write_bytes(f"w{i}", t.numpy().tobytes())
            pending.finish_rank(0)
            store.commit(tag, world_size=1, metadata=meta)
        say("committed", step)
    say("done")

def child(words):
    root, mode, lane, kill, max_steps = words
    if kill != "none":
        arm(root, kill)
    trial(root, mode, lane, int(max_steps))

HANG_SECONDS = 20
''' + FORK_LOOP

STYLES = {"unique": ("time", "op"), "recommit": ("window", "op", "time", "op-open")}
OPS_PER_TRIAL = 60  # an open and two to three saves make about this many changes under the root


class Zygote:
    """The forking parent; lines from it and its children arrive on one queue."""

    def __init__(self, script: str = ZYGOTE):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def send(self, *words) -> None:
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()

    def next_line(self, timeout: float) -> list[str] | None:
        try:
            return self.lines.get(timeout=max(timeout, 0.0)) or None
        except queue.Empty:
            return None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def kill_spec(style: str, rng: random.Random) -> str:
    if style == "window":
        return "window"
    if style == "op":
        return f"op:{rng.randint(1, OPS_PER_TRIAL)}"
    if style == "op-open":
        return f"op:{rng.randint(1, 6)}"
    return "none"


@dataclasses.dataclass(frozen=True)
class LaneRules:
    """How one crash lane's trials are judged: `seconds` without a line before a trial is stuck;
    a `time`-style kill comes up to `kill_within` seconds after the resume; `strict_latest`: a
    `latest` that does not name the newest checkpoint is a problem (else a statistic: on an object
    store it is a hint, repaired by the next commit or cleanup); `checks_open`: the child reports
    the leftovers its open found and the temporaries it left."""

    name: str
    seconds: float
    kill_within: float
    strict_latest: bool
    checks_open: bool


DISK_RULES = LaneRules("disk", seconds=30, kill_within=0.12, strict_latest=True, checks_open=True)
S3_RULES = LaneRules("s3", seconds=90, kill_within=1.5, strict_latest=False, checks_open=False)


def run_trial(zygote: Zygote, root, mode: str, lane: str, style: str, final: bool, last_committed: int,
              rng: random.Random, stats: collections.Counter, problems: list[str], trial: int) -> int:
    """One child of the disk lanes: start, check its open and resume, let it (or the test) kill it;
    returns the last commit."""
    zygote.send(root, mode, lane, "none" if final else kill_spec(style, rng), 1 if final else 100000)
    return watch_trial(zygote, DISK_RULES, f"{lane} trial {trial}", style, final, last_committed, rng, stats,
                       problems)


def watch_trial(zygote: Zygote, rules: LaneRules, name: str, style: str, final: bool, last_committed: int,
                rng: random.Random, stats: collections.Counter, problems: list[str]) -> int:
    """Follows the child the zygote was just told to start until it exits (killed, or finished when
    `final`), recording what it reports into `stats` and `problems`; returns the last commit."""
    child, kill_at, committed = None, None, last_committed
    deadline = time.monotonic() + rules.seconds
    try:
        while True:
            if kill_at is not None and time.monotonic() >= kill_at and child is not None:
                os.kill(child, signal.SIGKILL)
                kill_at = None
            wait = (kill_at if kill_at is not None else deadline) - time.monotonic()
            parts = zygote.next_line(min(wait, 0.5))
            if parts is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name}: no progress in {rules.seconds:.0f} s")
                continue
            word = parts[0]
            if word == "pid":
                child = int(parts[1])
            elif word == "opened":
                if rules.checks_open:
                    stats["leftovers found at open"] += int(parts[1]) > 0
                    if int(parts[2]):
                        problems.append(f"{name}: {parts[2]} temporaries left after open")
            elif word == "resumed":
                step = int(parts[1])
                stats["resumes"] += 1
                if parts[2] != "valid":
                    problems.append(f"{name}: resumed step {step} with wrong content")
                if parts[3] != "latest-ok":
                    if rules.strict_latest:
                        problems.append(f"{name}: `latest` does not name the newest checkpoint")
                    else:
                        stats["latest stale at resume"] += 1
                # the newest complete one: the last commit seen, or the one in flight if it was decided
                if not last_committed <= step <= last_committed + 1:
                    stats["lost"] += step < last_committed
                    problems.append(f"{name}: resumed step {step}, last commit was {last_committed}")
                committed = step
                if style == "time" and not final:
                    kill_at = time.monotonic() + rng.uniform(0.0, rules.kill_within)
            elif word == "committed":
                committed = int(parts[1])
            elif word == "kill":
                stats[f"kills in {parts[1]}"] += 1
                stats["window kills"] += style == "window"
            elif word == "done":
                stats["clean finishes"] += 1
            elif word == "exit":
                if not final:
                    stats["kills"] += int(parts[2]) == signal.SIGKILL
                    assert int(parts[2]) == signal.SIGKILL, f"{name}: child exited with {parts[2]}"
                child = None
                return committed
            else:
                raise AssertionError(f"{name}: worker failed: {' '.join(parts)}")
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


class SharedZygote:
    """The disk lanes' zygote, started once (one torch import for both): it only forks, so a lane
    leaves nothing in it, and each lane's children open their own store root. A lane that fails
    mid-trial discards it (lines of a child cut short would reach the next lane): the next starts one."""

    def __init__(self):
        self.zygote: Zygote | None = None

    def get(self) -> Zygote:
        if self.zygote is None:
            self.zygote = Zygote()
        return self.zygote

    def discard(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


@pytest.fixture(scope="module")
def disk_zygote():
    shared = SharedZygote()
    try:
        yield shared
    finally:
        shared.discard()


@pytest.mark.parametrize("lane", sorted(STYLES))
def test_sigkill_during_saves_never_loses_the_newest_checkpoint(tmp_path, lane, disk_zygote):
    trials = int(os.environ.get("SPOTGUARD_CRASH_TRIALS", "30"))
    seed = int(os.environ.get("SPOTGUARD_CRASH_SEED", str(time.time_ns())))
    rng = random.Random(seed)
    root = tmp_path / "store"
    zygote = disk_zygote.get()
    stats: collections.Counter = collections.Counter()
    problems: list[str] = []
    try:
        last_committed = 0
        for trial in range(trials + 1):
            mode = "fast" if trial % 2 == 0 else "plain"
            styles = STYLES[lane]
            style = styles[(trial // 2) % len(styles)]
            last_committed = run_trial(zygote, root, mode, lane, style, trial == trials, last_committed, rng,
                                       stats, problems, trial)
    except BaseException:
        disk_zygote.discard()
        raise
    print(f"\ncrash lane {lane} (seed {seed}): " + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())))
    assert not problems, problems
    assert last_committed >= 1 and stats["clean finishes"] == 1
    # kills landed mid-save: some opens found temporaries to clean (all were cleaned, above)
    assert stats["leftovers found at open"] > 0
    if lane == "recommit" and trials >= len(STYLES[lane]) * 2:
        assert stats["window kills"] > 0, "no kill landed between setting the old copy aside and the rename"


# ---- the S3 lane: the object store (a real SeaweedFS) as the tier that survives the node --------------
# Each child opens an ObjectCheckpointStore on the same s3:// prefix (with a fresh local dir every
# other trial: the node was lost, so only the object store can give the checkpoint back), resumes
# from it, then saves step after step, waiting for each upload, and reports a step as committed only
# once the object store holds it. It is SIGKILLed after a random delay (`time`) or just before its
# K-th HTTP request (`op`: a part of a multipart upload, a part manifest, the manifest, `latest`,
# a retention delete or a cleanup of the previous child's leftovers). 0 lost: every resume finds the
# newest checkpoint the object store acknowledged (or the one in flight), complete and correct.
# SPOTGUARD_S3_CRASH_TRIALS (default 12) sets the number of kills.

S3_ZYGOTE = r'''
import os, sys, signal, itertools
os.environ["OMP_NUM_THREADS"] = "1"
import torch, boto3, botocore
from spotguard.hooks.checkpoint.objectstore.store import ObjectCheckpointStore

PHASE = ["start"]
LEASE = 2.0

def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())

def arm(target):
    count = itertools.count(1)
    def hook(event, args):
        if event == "http.client.send" and next(count) == target:
            say("kill", PHASE[0], event, "-")
            os.kill(os.getpid(), signal.SIGKILL)
    sys.addaudithook(hook)

def trial(url, local, max_steps):
    PHASE[0] = "open"
    store = ObjectCheckpointStore(url, keep_last=2, local_dir=local, lease_seconds=LEASE, multipart_threshold=5 << 20)
    say("opened", 0, 0)
    PHASE[0] = "resume"
    info = store.resolve(verify=True)
    step = 0
    if info is not None:
        step = info.step
        ok = all((info.dir / f"w{i}").read_bytes() == bytes([(step + i) % 256]) * n for i, n in enumerate(SIZES))
        pointer = "latest-ok" if store.remote.latest_hint() == info.tag else "latest-STALE"
        say("resumed", step, "valid" if ok else "INVALID", pointer)
    else:
        say("resumed", 0, "valid", "latest-ok")
    PHASE[0] = "save"
    for step in range(step + 1, step + 1 + max_steps):
        tag = f"step-{step:06d}"
        pending = store.begin(tag)
        for i, n in enumerate(SIZES):
            pending.write_bytes(f"w{i}", bytes([(step + i) % 256]) * n)
        pending.finish_rank(0)
        store.commit(tag, world_size=1, metadata={"step": step, "reason": "notice" if step % 7 == 0 else "periodic"})
        store.wait_uploaded()
        if store.durable_tier(tag) == "object":
            say("committed", step)
    store.close()
    say("done")

SIZES = (11 << 20, 300_000, 20_000)  # one multipart file (3 parts), two plain ones

def child(words):
    url, local, kill, max_steps = words
    if kill.startswith("op:"):
        arm(int(kill[3:]))
    trial(url, local, int(max_steps))

HANG_SECONDS = 60
''' + FORK_LOOP

S3_OPS_PER_TRIAL = 40  # an open and two saves make about this many HTTP requests


@pytest.fixture
def s3_crash_server(tmp_path):
    from tests.s3_server import S3Server

    server = S3Server(tmp_path / "s3").start()
    try:
        yield server
    finally:
        server.stop(kill=True)  # thrown away: no ~2.3 s graceful shutdown


def test_sigkill_during_uploads_never_loses_an_acknowledged_checkpoint(tmp_path, s3_crash_server):
    import uuid

    from spotguard.hooks.checkpoint.objectstore.store import ObjectCheckpointStore
    from tests.s3_server import BUCKET

    trials = int(os.environ.get("SPOTGUARD_S3_CRASH_TRIALS", "12"))
    seed = int(os.environ.get("SPOTGUARD_CRASH_SEED", str(time.time_ns())))
    rng = random.Random(seed)
    url = f"s3://{BUCKET}/crash-{uuid.uuid4().hex[:8]}"
    env_before = dict(os.environ)
    os.environ.update(s3_crash_server.env())
    zygote = Zygote(S3_ZYGOTE)
    stats: collections.Counter = collections.Counter(lost=0)
    problems: list[str] = []
    last_committed = 0
    try:
        for trial in range(trials + 1):
            final = trial == trials
            style = "time" if trial % 2 else "op"
            local = tmp_path / f"node-{trial if trial % 2 == 0 else 'same'}"
            kill = "none" if final or style == "time" else f"op:{rng.randint(1, S3_OPS_PER_TRIAL)}"
            zygote.send(url, local, kill, 1 if final else 100000)
            last_committed = watch_trial(zygote, S3_RULES, f"s3 trial {trial}", style, final, last_committed, rng,
                                         stats, problems)
        # once the killed writers' leases ran out, an open leaves nothing partial behind
        deadline = time.monotonic() + 60
        while True:
            store = ObjectCheckpointStore(url, keep_last=2, local_dir=tmp_path / "check", lease_seconds=2)
            client = s3_crash_server.client()
            prefix = store.url.root_key
            names = [o["Key"][len(prefix):] for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix=prefix) for o in page.get("Contents", [])]
            tags = {n.split("/")[0] for n in names if "/" in n and not n.startswith(".")}
            partial = sorted(t for t in tags if f"{t}/spotguard-manifest.json" not in names)
            uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads") or []
            store.close(10)
            if not partial and not uploads:
                break
            assert time.monotonic() < deadline, f"left behind: {partial}, {len(uploads)} multipart uploads"
            time.sleep(0.5)
    finally:
        zygote.close()
        os.environ.clear()
        os.environ.update(env_before)
    print(f"\ncrash lane s3 (seed {seed}): " + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())))
    assert not problems, problems
    assert last_committed >= 1 and stats["clean finishes"] == 1
    assert stats["lost"] == 0
