"""DeepSpeed hostfiles: parse, choose the surviving hosts, rewrite atomically.

Format (DeepSpeed's launcher): one `hostname slots=N` per line; `#` starts a comment; blank
lines are ignored. `parse_hostfile` is strict: a malformed line, a duplicate host, `slots=0` or
a file without hosts raises `HostfileError` naming the line. `write_hostfile` replaces the file
so that a reader sees either the old or the new content, never a mix: temp file in the same
directory, fsync, rename over the old name, fsync the directory.

Elasticity: DeepSpeed 0.19 removed its `elasticity` module (the config block now raises), so
`ElasticRule` implements the documented v0.1 rule itself; see its docstring. `select_hosts`
keeps every kept host's `slots=` unchanged and trims whole hosts to the largest allowed world
size. `group_after` is the one rule for which hosts form the group after a change: the sidecar's
hostfile (`hooks/sidecar/topology.py`) and the in-place Guard's re-formation
(`hooks/elastic/membership_view.py`) both call it, so the file a relaunch reads names the hosts
the group in place formed with.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from functools import reduce
from typing import Any
from collections.abc import Collection, Iterable, Mapping, Sequence

_LINE = re.compile(r"^(?P<host>[^\s#=]+)\s+slots\s*=\s*(?P<slots>\d+)\s*(?:#.*)?$")

# Highly composite numbers (OEIS A002182) up to 720720: the multipliers the elasticity rule
# scales a base batch size by, as DeepSpeed's v0.1 rule does.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720,
)


class HostfileError(ValueError):
    """A hostfile is malformed. `line` is the 1-based line number (None: the whole file)."""

    def __init__(self, path: str, line: int | None, message: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.message = path, line, message


class ElasticityError(ValueError):
    """The DeepSpeed config's `elasticity` block is invalid; the message names the key."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(text: str, path: str = "<hostfile>") -> list[Host]:
    """The hosts of a hostfile in file order; HostfileError names the first bad line."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(path, number, f"expected 'hostname slots=N', got {raw.strip()!r:.120}")
        name, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise HostfileError(path, number, f"slots must be >= 1 for host {name!r}")
        if name in seen:
            raise HostfileError(path, number, f"host {name!r} already listed on line {seen[name]}")
        seen[name] = number
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostfileError(path, None, "no hosts listed")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Reads and parses `path` (blocking: call through a thread from async code)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise HostfileError(path, None, "not UTF-8 text") from None
    return parse_hostfile(text, path)


def format_hostfile(hosts: Sequence[Host], header: str | None = None) -> str:
    lines = [f"# {header}"] if header else []
    lines.extend(f"{h.name} slots={h.slots}" for h in hosts)
    return "\n".join(lines) + "\n"


def write_hostfile(path: str, hosts: Sequence[Host], header: str | None = None) -> None:
    """Atomically replaces `path` with `hosts` (blocking). Keeps the old file's permissions."""
    if not hosts:
        raise ValueError("refusing to write a hostfile without hosts")
    write_atomic(path, format_hostfile(hosts, header).encode())


def write_atomic(path: str, data: bytes, mode: int | None = None) -> None:
    """Replaces `path` with `data`: temp file in the same directory, fsync, rename, fsync dir.

    `mode` sets the new file's permissions; by default the old file's are kept (0644 if new).
    """
    directory = os.path.dirname(os.path.abspath(path))
    if mode is None:
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _int_field(block: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    """`block[key]` (or `default` when absent) checked to be a whole number >= minimum; an explicit
    null is refused like any other non-number."""
    value = block.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ElasticityError(f"elasticity.{key}: expected a whole number >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ElasticRule:
    """DeepSpeed's elasticity v0.1 rule: which world sizes a config allows.

    Given `micro_batch_sizes`, `max_train_batch_size`, `min_gpus`, `max_gpus` and
    `prefer_larger_batch`, the rule fixes one global batch size and the world sizes that can
    train with it unchanged (batch = micro * grad_accum * world):
    1. candidate batch sizes: for each base in micro_batch_sizes + [lcm(micro_batch_sizes)],
       the largest base * h (h a highly composite number) that is <= max_train_batch_size;
    2. the world sizes valid for a batch B: every divisor d of B // m, for each micro size m
       that divides B, with min_gpus <= d <= max_gpus;
    3. the batch size with the most valid world sizes wins; ties go to the larger batch when
       prefer_larger_batch (default true), else to the smaller.
    One deliberate difference from DeepSpeed's old code: a base larger than the maximum (an
    lcm above max_train_batch_size) yields no candidate instead of exceeding the maximum.
    """

    batch_size: int
    world_sizes: tuple[int, ...]

    @classmethod
    def from_block(cls, block: Any) -> ElasticRule | None:
        """The rule of an `elasticity` block; None when it is absent or disabled."""
        if block is None:
            return None
        if not isinstance(block, Mapping):
            raise ElasticityError("elasticity: expected a JSON object")
        enabled = block.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ElasticityError(f"elasticity.enabled: expected true or false, got {enabled!r}")
        if not enabled:
            return None
        version = block.get("version", 0.1)
        if isinstance(version, bool) or not isinstance(version, (int, float)) or float(version) > 0.1:
            raise ElasticityError(f"elasticity.version: only version 0.1 is supported, got {version!r}")
        max_batch = _int_field(block, "max_train_batch_size", 2000, 1)
        micro = block.get("micro_batch_sizes", [2, 4, 6])
        if (not isinstance(micro, list) or not micro
                or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro)):
            raise ElasticityError(
                f"elasticity.micro_batch_sizes: expected a non-empty list of whole numbers >= 1, got {micro!r:.80}")
        if any(m > max_batch for m in micro):
            raise ElasticityError(
                f"elasticity.micro_batch_sizes: every size must be <= max_train_batch_size ({max_batch})")
        min_gpus = _int_field(block, "min_gpus", 1, 1)
        max_gpus = _int_field(block, "max_gpus", max_batch // min(micro), 1)
        if max_gpus < min_gpus:
            raise ElasticityError(f"elasticity.max_gpus: {max_gpus} is below min_gpus ({min_gpus})")
        prefer_larger = block.get("prefer_larger_batch", True)
        if not isinstance(prefer_larger, bool):
            raise ElasticityError(f"elasticity.prefer_larger_batch: expected true or false, got {prefer_larger!r}")
        return cls.compute(sorted(set(micro)), max_batch, min_gpus, max_gpus, prefer_larger)

    @classmethod
    def compute(cls, micro: Sequence[int], max_batch: int, min_gpus: int, max_gpus: int,
                prefer_larger: bool = True) -> ElasticRule:
        bases = set(micro) | {reduce(math.lcm, micro)}
        candidates = set()
        for base in bases:
            fitting = [base * h for h in HIGHLY_COMPOSITE if base * h <= max_batch]
            if fitting:
                candidates.add(max(fitting))
        best: tuple[int, tuple[int, ...]] | None = None
        for batch in sorted(candidates, reverse=prefer_larger):
            sizes = _valid_world_sizes(batch, micro, min_gpus, max_gpus)
            if best is None or len(sizes) > len(best[1]):
                best = (batch, sizes)
        if best is None or not best[1]:
            raise ElasticityError("elasticity: no world size between min_gpus and max_gpus fits any batch size")
        return cls(*best)

    def largest_allowed(self, at_most: int) -> int | None:
        fitting = [w for w in self.world_sizes if w <= at_most]
        return max(fitting) if fitting else None


def _valid_world_sizes(batch: int, micro: Iterable[int], min_gpus: int, max_gpus: int) -> tuple[int, ...]:
    sizes: set[int] = set()
    for m in micro:
        if batch % m:
            continue
        ranks = batch // m
        for d in range(1, math.isqrt(ranks) + 1):
            if ranks % d == 0:
                sizes.update(x for x in (d, ranks // d) if min_gpus <= x <= max_gpus)
    return tuple(sorted(sizes))


def elastic_rule_from_config(path: str) -> ElasticRule | None:
    """The elasticity rule of a DeepSpeed JSON config file (blocking); None without the block.

    Raises ElasticityError for an unreadable file or a bad block.
    """
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ElasticityError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ElasticityError(f"{path} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ElasticityError(f"{path}: expected a JSON object")
    return ElasticRule.from_block(config.get("elasticity"))


def select_hosts(hosts: Sequence[Host], *, cap: int | None = None,
                 rule: ElasticRule | None = None) -> list[Host]:
    """The hosts to keep, in their given order, each with its own slots.

    Keeps whole hosts whose slots sum to the largest total that is <= `cap` (None: no cap) and,
    with a `rule`, is a world size the rule allows. Among subsets with that total, earlier hosts
    are preferred. Returns [] when no subset fits (e.g. fewer slots left than min_gpus).
    """
    limit = sum(h.slots for h in hosts) if cap is None else min(cap, sum(h.slots for h in hosts))
    # reachable[i]: slot totals that hosts[i:] can form (bounded by limit).
    reachable: list[set[int]] = [set() for _ in range(len(hosts) + 1)]
    reachable[len(hosts)] = {0}
    for i in range(len(hosts) - 1, -1, -1):
        after = reachable[i + 1]
        reachable[i] = after | {s + hosts[i].slots for s in after if s + hosts[i].slots <= limit}
    totals = sorted((t for t in reachable[0] if t > 0), reverse=True)
    allowed = set(rule.world_sizes) if rule is not None else None
    target = next((t for t in totals if allowed is None or t in allowed), None)
    if target is None:
        return []
    kept: list[Host] = []
    for i, host in enumerate(hosts):
        if target >= host.slots and (target - host.slots) in reachable[i + 1]:
            kept.append(host)
            target -= host.slots
        if target == 0:
            break
    return kept


def group_after(hosts: Sequence[Host], departing: Collection[str] = (), *, cap: int | None = None,
                rule: ElasticRule | None = None) -> list[Host]:
    """The hosts that form the group: `hosts` in their order without the `departing` ones, trimmed
    by `select_hosts` to the largest slot total <= `cap` that `rule` allows. [] when nothing fits
    (every rank leaves). Trimming may leave out hosts that were not departing: they leave too.
    A trim keeps the hosts listed first (`select_hosts`' preference), so the order is part of the
    input: the supervisor's membership lists the store's host first and the job's members before
    its joiners (`supervisor/in_place.py`), the sidecar passes the membership's order and the
    Guard its ranks', which is the order of the membership they formed from. With equal slots a
    trim therefore never drops the first host (whose store a joiner meets the group at) and drops
    joiners before members."""
    candidates = [h for h in hosts if h.name not in departing]
    kept = {h.name for h in select_hosts(candidates, cap=cap, rule=rule)}
    return [h for h in candidates if h.name in kept]
