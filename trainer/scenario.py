"""Dry-run scenarios: what happens to which simulated node, and when.

A scenario is a YAML file (or the embedded default) like:

    name: default
    cloud: aws                 # aws | gcp | azure | alibaba
    workers: 2                 # simulated nodes, one training rank each
    framework: ddp             # ddp | fsdp2 | deepspeed | hf | accelerate | lightning
    policy: elastic            # elastic | fixed
    min_workers: 1
    steps: 300                 # total training steps
    step_seconds: 0.05         # synthetic extra time per step (makes a run watchable)
    events:
      - {at: 6, kind: reclaim, node: node-1, lead: 20}
      - {at: 18, kind: capacity, node: node-1}

Event kinds: `reclaim` (spot reclaim notice with `lead` seconds of warning), `rebalance`,
`maintenance` (with `lead`), `cancel` (withdraws the maintenance scheduled on `node`),
`gpu-fault` (a fatal Xid through the fake NVML backend), `capacity` (the node comes back).
`at` is seconds after training first starts. `long_step: {step: S, seconds: T}` makes step S (the
number the trainer passes to `guard.step`, 0-based) take T seconds instead of `step_seconds`, in
every run that trains it (an evaluation pass, a first compile, a data stall: a resumed run that
trains step S again waits again). `exit_on_drain: true` makes the reference trainer's Guard end
the process on a drain (the Guard's default, what users' scripts do), and so run the deadline
watchdog; by default the trainer leaves by itself after a drain and has none. Both are options of
the reference trainer (ddp, fsdp2, deepspeed). `allow_steps_lost: N` declares that the scenario
expects up to N steps lost (a notice too short for a fresh save); any more fails the run.
`frameworks: [ddp, fsdp2]` lists the frameworks the scenario is written to pass with (default:
its `framework`); the bundled-scenario test runs every bundled scenario with each of them.
`expect: {decisions: N, memberships: N, changes: N, agreed: N}` (each optional) states how many
supervisor decisions, memberships the supervisor pushes, membership changes of the ranks, and
injected notices the ranks agreed on the scenario must see (a notice that must change nothing:
0); any other count fails the run.

A scenario can also be a spot trace (`t_seconds,event,node` with `add`/`preempt` rows; the
bundled ones and their format are in trainer/traces/): see `scenario_from_trace`.

Contract: `load_scenario` either returns a fully valid `Scenario` or raises `ScenarioError`
whose message names the file, the line and the field; nothing is started before that.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

CLOUDS = ("aws", "gcp", "azure", "alibaba")
FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "hf", "accelerate", "lightning")
# The others relaunch (the Trainer and Lightning integrations: README, 'Membership changes in place').
# DeepSpeed changes in place with ZeRO-1/2, the reference trainer's stages.
IN_PLACE_FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "accelerate")
# The frameworks the reference trainer (trainer/train.py) runs; the others run their integration's script.
REFERENCE_TRAINER_FRAMEWORKS = ("ddp", "fsdp2", "deepspeed")
MEMBERSHIP_PATHS = ("in-place", "restart")
POLICIES = ("elastic", "fixed")
EVENT_KINDS = ("reclaim", "rebalance", "maintenance", "cancel", "gpu-fault", "capacity")
# The events whose node the simulated cloud takes (out until a capacity event replaces it); what
# a notice means to the ranks and the supervisor is spotguard.wire.notice_policy's, not this.
TAKING_KINDS = ("reclaim", "gpu-fault")
DEFAULT_LEAD = {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "alibaba": 120.0}

DEFAULT_SCENARIO = """\
name: default
cloud: aws
workers: 2
framework: ddp
policy: elastic
min_workers: 1
steps: 360
step_seconds: 0.05
events:
  - {at: 4, kind: reclaim, node: node-1, lead: 15}
  - {at: 9, kind: capacity, node: node-1}
"""


class ScenarioError(ValueError):
    """A scenario is invalid; the message names where (file:line) and which field."""


@dataclass(frozen=True)
class ScenarioEvent:
    at: float
    kind: str
    node: str
    lead: float | None = None  # notice lead time; None: the cloud's usual lead
    line: int = 0  # where it was written, for messages


@dataclass(frozen=True)
class Scenario:
    name: str
    cloud: str = "aws"
    workers: int = 2
    framework: str = "ddp"
    policy: str = "elastic"
    min_workers: int = 1
    steps: int = 240
    step_seconds: float = 0.05
    checkpoint_every: int = 0  # periodic checkpoints every K steps (0: only on notices)
    allow_steps_lost: int = 0  # steps the scenario expects to lose (a notice too short for a save)
    membership: str = ""  # in-place | restart; "" picks: in place for elastic DDP/FSDP2 jobs
    start_at_min: bool = False  # in place: train once min_workers nodes are ready, the others join in place
    frameworks: tuple[str, ...] = ()  # the frameworks it is written to pass with; () means `framework`
    expect: tuple[tuple[str, int], ...] = ()  # (what, count): decisions | memberships | changes | agreed
    long_step: tuple[int, float] | None = None  # (step, seconds): one step that takes that long
    exit_on_drain: bool = False  # the trainer's Guard ends the process on a drain (the deadline watchdog runs)
    events: tuple[ScenarioEvent, ...] = field(default_factory=tuple)

    @property
    def allowed_frameworks(self) -> tuple[str, ...]:
        """The frameworks this scenario passes with (the bundled-scenario test runs each)."""
        return self.frameworks or (self.framework,)

    @property
    def in_place(self) -> bool:
        """Whether membership changes happen in place (survivors keep running) or by relaunch."""
        if self.membership:
            return self.membership == "in-place"
        return self.policy == "elastic" and self.framework in IN_PLACE_FRAMEWORKS

    @property
    def nodes(self) -> list[str]:
        return [f"node-{i}" for i in range(self.workers)]

    def with_overrides(self, **changes: Any) -> Scenario:
        """A copy with the given fields replaced (None values ignored), re-validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        updated = replace(self, **changes)
        _check_semantics(updated, "<override>")
        return updated


_TOP_FIELDS = {"name", "cloud", "workers", "framework", "frameworks", "policy", "min_workers", "steps",
               "step_seconds", "checkpoint_every", "allow_steps_lost", "membership", "start_at_min", "expect",
               "long_step", "exit_on_drain", "events"}
EXPECTED = ("decisions", "memberships", "changes", "agreed")
_EVENT_FIELDS = {"at", "kind", "node", "lead"}


def _where(origin: str, node: yaml.Node | None) -> str:
    return f"{origin}:{node.start_mark.line + 1}" if node is not None else origin


def _number(value: Any, where: str, name: str, *, integer: bool = False, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "a whole number" if integer else "a number"
        raise ScenarioError(f"{where}: {name}: expected {kind}, got {value!r}")
    if value < low:
        raise ScenarioError(f"{where}: {name}: must be >= {low:g}, got {value!r}")
    return value


def parse_scenario(text: str, origin: str = "<scenario>") -> Scenario:
    """Parses scenario YAML; ScenarioError names origin:line and the field."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{origin}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict) or not isinstance(root, yaml.MappingNode):
        raise ScenarioError(f"{origin}:1: a scenario is a mapping of fields (name, cloud, events, ...)")
    key_nodes = {k.value: (k, v) for k, v in root.value}
    for key in data:
        if key not in _TOP_FIELDS:
            raise ScenarioError(f"{_where(origin, key_nodes.get(key, (None,))[0])}: {key}: unknown field "
                                f"(known: {', '.join(sorted(_TOP_FIELDS))})")

    def at(key: str) -> str:
        return _where(origin, key_nodes.get(key, (None, None))[1])

    name = data.get("name", Path(origin).stem)
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{at('name')}: name: expected a non-empty string")
    fields: dict[str, Any] = {"name": name}
    for key, choices in (("cloud", CLOUDS), ("framework", FRAMEWORKS), ("policy", POLICIES),
                         ("membership", MEMBERSHIP_PATHS)):
        if key in data:
            if data[key] not in choices:
                raise ScenarioError(f"{at(key)}: {key}: expected one of {', '.join(choices)}, got {data[key]!r}")
            fields[key] = data[key]
    for key in ("workers", "min_workers", "steps", "checkpoint_every", "allow_steps_lost"):
        if key in data:
            low = 0 if key in ("checkpoint_every", "allow_steps_lost") else 1
            fields[key] = int(_number(data[key], at(key), key, integer=True, low=low))
    if "frameworks" in data:
        listed = data["frameworks"]
        if not isinstance(listed, list) or not listed or any(f not in FRAMEWORKS for f in listed) \
                or len(set(listed)) != len(listed):
            raise ScenarioError(f"{at('frameworks')}: frameworks: expected a list of distinct frameworks out of "
                                f"{', '.join(FRAMEWORKS)}, got {listed!r}")
        fields["frameworks"] = tuple(listed)
    for key in ("start_at_min", "exit_on_drain"):
        if key in data:
            if not isinstance(data[key], bool):
                raise ScenarioError(f"{at(key)}: {key}: expected true or false, got {data[key]!r}")
            fields[key] = data[key]
    if "long_step" in data:
        fields["long_step"] = _long_step(data["long_step"], at("long_step"))
    if "expect" in data:
        fields["expect"] = _expectations(data["expect"], at("expect"))
    if "step_seconds" in data:
        fields["step_seconds"] = float(_number(data["step_seconds"], at("step_seconds"), "step_seconds"))

    fields["events"] = _events(data.get("events", []), key_nodes.get("events", (None, None))[1], at("events"), origin)
    scenario = Scenario(**fields)
    _check_semantics(scenario, origin)
    return scenario


def _events(events_raw: Any, events_node: yaml.Node | None, where_list: str, origin: str
            ) -> tuple[ScenarioEvent, ...]:
    """The scenario's `events`, sorted by time; ScenarioError names the event's line and field."""
    if not isinstance(events_raw, list):
        raise ScenarioError(f"{where_list}: events: expected a list")
    events = []
    for index, raw in enumerate(events_raw):
        node = events_node.value[index] if isinstance(events_node, yaml.SequenceNode) else None
        where = _where(origin, node)
        line = node.start_mark.line + 1 if node is not None else 0
        if not isinstance(raw, dict):
            raise ScenarioError(f"{where}: events[{index}]: expected a mapping with at, kind, node")
        for key in raw:
            if key not in _EVENT_FIELDS:
                raise ScenarioError(f"{where}: events[{index}].{key}: unknown field (known: at, kind, node, lead)")
        for key in ("at", "kind", "node"):
            if key not in raw:
                raise ScenarioError(f"{where}: events[{index}].{key}: missing")
        if raw["kind"] not in EVENT_KINDS:
            raise ScenarioError(f"{where}: events[{index}].kind: expected one of {', '.join(EVENT_KINDS)}, "
                                f"got {raw['kind']!r}")
        if not isinstance(raw["node"], str):
            raise ScenarioError(f"{where}: events[{index}].node: expected a node name such as node-0")
        lead = raw.get("lead")
        if lead is not None:
            lead = float(_number(lead, where, f"events[{index}].lead"))
        events.append(ScenarioEvent(at=float(_number(raw["at"], where, f"events[{index}].at")), kind=raw["kind"],
                                    node=raw["node"], lead=lead, line=line))
    return tuple(sorted(events, key=lambda e: e.at))


def _long_step(raw: Any, where: str) -> tuple[int, float]:
    if not isinstance(raw, dict) or set(raw) != {"step", "seconds"}:
        raise ScenarioError(f"{where}: long_step: expected a mapping with step and seconds, got {raw!r}")
    seconds = float(_number(raw["seconds"], where, "long_step.seconds"))
    if seconds <= 0:
        raise ScenarioError(f"{where}: long_step.seconds: must be > 0, got {raw['seconds']!r}")
    return int(_number(raw["step"], where, "long_step.step", integer=True)), seconds


def _expectations(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, dict) or not raw:
        raise ScenarioError(f"{where}: expect: expected a mapping of {', '.join(EXPECTED)} to counts")
    out = []
    for key, value in raw.items():
        if key not in EXPECTED:
            raise ScenarioError(f"{where}: expect.{key}: unknown (known: {', '.join(EXPECTED)})")
        out.append((key, int(_number(value, where, f"expect.{key}", integer=True))))
    return tuple(out)


def _check_semantics(s: Scenario, origin: str) -> None:
    if s.membership == "in-place" and (s.policy != "elastic" or s.framework not in IN_PLACE_FRAMEWORKS):
        raise ScenarioError(f"{origin}: membership: in-place needs policy elastic and framework "
                            f"{' or '.join(IN_PLACE_FRAMEWORKS)} (the Trainer and Lightning integrations "
                            "relaunch: README, 'Membership changes in place')")
    relaunching = [f for f in s.frameworks if f not in IN_PLACE_FRAMEWORKS]
    if s.membership == "in-place" and relaunching:
        raise ScenarioError(f"{origin}: frameworks: {', '.join(relaunching)} relaunch; membership in-place allows "
                            f"{', '.join(IN_PLACE_FRAMEWORKS)}")
    if s.start_at_min and not s.in_place:
        raise ScenarioError(f"{origin}: start_at_min: needs membership changes in place (policy elastic, "
                            f"framework {' or '.join(IN_PLACE_FRAMEWORKS)})")
    options = [name for name, value in (("long_step", s.long_step), ("exit_on_drain", s.exit_on_drain)) if value]
    others = [f for f in s.allowed_frameworks if f not in REFERENCE_TRAINER_FRAMEWORKS]
    if options and others:
        raise ScenarioError(f"{origin}: {options[0]}: an option of the reference trainer "
                            f"({', '.join(REFERENCE_TRAINER_FRAMEWORKS)}), not of {', '.join(others)}")
    if s.long_step is not None and s.long_step[0] >= s.steps:
        raise ScenarioError(f"{origin}: long_step.step: {s.long_step[0]} is not below steps ({s.steps})")
    if s.min_workers > s.workers:
        raise ScenarioError(f"{origin}: min_workers: {s.min_workers} is more than workers ({s.workers})")
    nodes = set(s.nodes)
    for i, e in enumerate(s.events):
        where = f"{origin}:{e.line}" if e.line else origin
        if e.node not in nodes:
            raise ScenarioError(f"{where}: events[{i}].node: {e.node!r} is not one of {', '.join(sorted(nodes))}")


BUNDLED = Path(__file__).with_name("scenarios")


def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped with spotguard (trainer/scenarios/*.yaml)."""
    return sorted(p.stem for p in BUNDLED.glob("*.yaml"))


BUNDLED_TRACES = Path(__file__).with_name("traces")


def bundled_traces() -> list[str]:
    """Names of the spot traces shipped with spotguard (trainer/traces/*.csv, see its README)."""
    return sorted(p.stem for p in BUNDLED_TRACES.glob("*.csv"))


def find_trace(name_or_path: str | Path) -> Path:
    """The trace file `name_or_path` names: an existing file, else a bundled trace by name (with
    or without `.csv`); ScenarioError listing the bundled names if it is neither."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = p.name[: -len(".csv")] if p.name.endswith(".csv") else p.name
    if p.parent == Path() and name in bundled_traces():
        return BUNDLED_TRACES / f"{name}.csv"
    raise ScenarioError(f"{name_or_path}: no such file, nor a bundled trace (bundled: {', '.join(bundled_traces())})")


def load_scenario(path: str | Path | None) -> Scenario:
    """The scenario in `path` (YAML, or a spot trace .csv), a bundled scenario or trace by name,
    or the embedded default for None."""
    if path is None:
        return parse_scenario(DEFAULT_SCENARIO, "<default scenario>")
    p = Path(path)
    if not p.exists() and str(path) in bundled_scenarios():
        p = BUNDLED / f"{path}.yaml"
    elif not p.exists() and str(path) in bundled_traces():
        p = BUNDLED_TRACES / f"{path}.csv"
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read ({exc.strerror})") from None
    if p.suffix == ".csv":
        return scenario_from_trace(text, origin=str(p))
    return parse_scenario(text, str(p))


@dataclass(frozen=True)
class TraceRow:
    t: float
    event: str
    node: str
    line: int


def parse_trace(text: str, origin: str = "<trace>") -> list[TraceRow]:
    """Rows of a `t_seconds,event,node` trace (format: trainer/traces/README.md).

    ScenarioError names `origin:line: field:` of the first bad row: a wrong header, a wrong
    column count, a time that is not a finite number >= 0 or goes back, an unknown event, an
    empty node id, an `add` of a node that is live or a `preempt` of one that is not.
    """
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or [h.strip() for h in header] != ["t_seconds", "event", "node"]:
        raise ScenarioError(f"{origin}:1: header: expected t_seconds,event,node")
    rows = []
    last_t = 0.0
    live: set[str] = set()
    for line, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 3:
            raise ScenarioError(f"{origin}:{line}: row: expected 3 columns (t_seconds,event,node), got {len(row)}")
        try:
            t = float(row[0])
        except ValueError:
            raise ScenarioError(f"{origin}:{line}: t_seconds: not a number: {row[0]!r}") from None
        if not math.isfinite(t) or t < 0:
            raise ScenarioError(f"{origin}:{line}: t_seconds: must be a finite number >= 0, got {row[0]!r}")
        if t < last_t:
            raise ScenarioError(f"{origin}:{line}: t_seconds: {t:g} goes back in time (previous {last_t:g})")
        event, node = row[1].strip(), row[2].strip()
        if event not in ("add", "preempt"):
            raise ScenarioError(f"{origin}:{line}: event: expected add or preempt, got {row[1]!r}")
        if not node:
            raise ScenarioError(f"{origin}:{line}: node: empty node id")
        if event == "add" and node in live:
            raise ScenarioError(f"{origin}:{line}: node: {node!r} added while it is live")
        if event == "preempt" and node not in live:
            raise ScenarioError(f"{origin}:{line}: node: {node!r} preempted while it is not live")
        (live.add if event == "add" else live.discard)(node)
        rows.append(TraceRow(t, event, node, line))
        last_t = t
    return rows


def live_at(rows: list[TraceRow], start: float) -> list[str]:
    """Trace nodes live just before `start` (added earlier, not yet preempted), in order of their add."""
    live: dict[str, None] = {}
    for row in rows:
        if row.t >= start:
            break
        if row.event == "add":
            live[row.node] = None
        else:
            live.pop(row.node, None)
    return list(live)


def scenario_from_trace(text: str, origin: str = "<trace>", workers: int = 2, time_scale: float = 60.0,
                        window: float | None = None, start: float = 0.0, lead: float = 15.0,
                        steps: int = 600, step_seconds: float = 0.05, cloud: str | None = None) -> Scenario:
    """Replays the window [start, start + window] of a real spot trace on `workers` local slots,
    `time_scale` times faster.

    The nodes live at `start` hold the slots first, in order of their add (the first `workers`
    of them; `trace_slots_at` names them). Then the window's rows replay in order: an add that
    finds a free slot takes it (capacity returning, if after the window's first instant), a
    preempt of a node that holds a slot becomes a reclaim of that slot with `lead` seconds of
    notice and frees it. Rows of nodes that hold no slot change nothing.
    """
    rows = parse_trace(text, origin)
    slots = trace_slots_at(rows, workers, start)
    free = [f"node-{i}" for i in range(workers) if f"node-{i}" not in slots.values()]
    events: list[ScenarioEvent] = []
    for row in rows:
        if row.t < start or (window is not None and row.t > start + window):
            continue
        at = (row.t - start) / time_scale
        if row.event == "add" and free:
            slots[row.node] = free.pop(0)
            if at > 0:
                events.append(ScenarioEvent(at=at, kind="capacity", node=slots[row.node], line=row.line))
        elif row.event == "preempt" and row.node in slots:
            slot = slots.pop(row.node)
            events.append(ScenarioEvent(at=at, kind="reclaim", node=slot, lead=lead, line=row.line))
            free.append(slot)
    if cloud is None:
        cloud = "gcp" if "gcp" in Path(origin).name else "aws"
    scenario = Scenario(name=Path(origin).stem, cloud=cloud, workers=workers, steps=steps,
                        step_seconds=step_seconds, events=tuple(events))
    _check_semantics(scenario, origin)
    return scenario


def trace_slots_at(rows: list[TraceRow], workers: int, start: float) -> dict[str, str]:
    """{trace node: slot} at `start`: the first `workers` nodes live there, in order of their add,
    on node-0, node-1, ...; slots beyond the live nodes stay free."""
    return {node: f"node-{i}" for i, node in enumerate(live_at(rows, start)[:workers])}
