"""A tiny Prometheus text exposition (format 0.0.4): counters, gauges and histograms with labels.

Contract: `Registry.render()` returns valid exposition text: one `# HELP` and `# TYPE` line per
family, then its samples; label values and help text are escaped as the format requires.
Collectors registered with `add_collector` run just before rendering, so values mirrored from
elsewhere (source stats, marker stats) are read at scrape time, not pushed on every change.
Not thread-safe: use from one event loop.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
LabelValues = tuple[str, ...]


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels_text(names: Sequence[str], values: Sequence[str], extra: tuple[str, str] | None = None) -> str:
    pairs = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values)]
    if extra is not None:
        pairs.append(f'{extra[0]}="{_escape_label(extra[1])}"')
    return "{" + ",".join(pairs) + "}" if pairs else ""


class _Family:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        if not _NAME.match(name):
            raise ValueError(f"bad metric name {name!r}")
        for label in labels:
            if not _LABEL.match(label) or label.startswith("__"):
                raise ValueError(f"bad label name {label!r}")
        self.name, self.help, self.labels = name, help, tuple(labels)
        self._values: dict[LabelValues, float] = {}

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: expected labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labels)

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0)

    def samples(self) -> Iterable[str]:
        for key, value in sorted(self._values.items()):
            yield f"{self.name}{_labels_text(self.labels, key)} {format_value(value)}"

    def render(self) -> str:
        head = f"# HELP {self.name} {_escape_help(self.help)}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.samples())


class Counter(_Family):
    """A monotonically increasing count. Name it `*_total`."""

    kind = "counter"

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0) + amount

    def set_total(self, total: float, **labels: str) -> None:
        """Mirrors a total counted elsewhere (e.g. a source's own error counter)."""
        self._values[self._key(labels)] = total


class Gauge(_Family):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = value

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0) + amount

    def clear(self) -> None:
        self._values.clear()


class Histogram(_Family):
    """Observations counted into cumulative `le` buckets, with `_sum` and `_count`."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = ()):
        super().__init__(name, help, labels)
        if "le" in self.labels:
            raise ValueError("'le' is reserved in histograms")
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.buckets = tuple(bounds)
        self._series: dict[LabelValues, list[float]] = {}  # bucket counts..., sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        series = self._series.setdefault(key, [0.0] * (len(self.buckets) + 2))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                series[i] += 1
        series[-2] += value
        series[-1] += 1

    def count(self, **labels: str) -> int:
        series = self._series.get(self._key(labels))
        return 0 if series is None else int(series[-1])

    def samples(self) -> Iterable[str]:
        for key, series in sorted(self._series.items()):
            for bound, count in zip(self.buckets, series):
                labels = _labels_text(self.labels, key, ("le", format_value(bound)))
                yield f"{self.name}_bucket{labels} {format_value(count)}"
            yield f"{self.name}_sum{_labels_text(self.labels, key)} {format_value(series[-2])}"
            yield f"{self.name}_count{_labels_text(self.labels, key)} {format_value(series[-1])}"


class Registry:
    """Holds metric families in registration order and renders them."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._collectors: list[Callable[[], None]] = []

    def _add(self, family: _Family) -> _Family:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} registered twice")
        self._families[family.name] = family
        return family

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labels))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labels))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = ()) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets))  # type: ignore[return-value]

    def families(self) -> dict[str, tuple[str, ...]]:
        """Every registered family's name -> its label names (what a scrape can show)."""
        return {name: family.labels for name, family in self._families.items()}

    def add_collector(self, collector: Callable[[], None]) -> None:
        self._collectors.append(collector)

    def render(self) -> str:
        for collector in self._collectors:
            try:
                collector()
            except Exception:  # a broken collector must not break the scrape
                log.exception("metrics collector failed")
        return "".join(f.render() for f in self._families.values())


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
