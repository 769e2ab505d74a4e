"""The node agent's metrics (families on `spotguard.metrics.Registry`), fed by the notice table."""
from __future__ import annotations

from spotguard.metrics import LATENCY_BUCKETS, Registry
from spotguard.wire.notice import Notice, now_utc

LEAD_BUCKETS = (0, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 21600, 86400)


class AgentMetrics:
    """The node agent's metrics (prefix `spotguard_`). What each one means:

    - `spotguard_notices{kind,source}` (gauge): live notices now.
    - `spotguard_notice_changes_total{event,kind,source}` (counter): changes published
      (event = new | changed | withdrawn).
    - `spotguard_detection_latency_seconds{source}` (histogram): for each new notice, the time
      from the source's read that first showed it (its `detected_at`) to its publication to
      every subscriber queue: the agent's own share of the detection path.
    - `spotguard_notice_lead_seconds{kind}` (histogram): for each new notice with a deadline,
      deadline minus detection: the time the job was given.
    - `spotguard_source_last_success_age_seconds{source}` (gauge): seconds since the source's
      last successful read; a notice appearing now is seen at the latest this long plus one
      read later, so this bounds the detection delay (and shows a stuck source).
    - `spotguard_source_polls_total{source}`, `spotguard_source_errors_total{source,reason}`.
    - `spotguard_subscribers` (gauge), `spotguard_subscribers_dropped_total` (slow readers cut off),
      `spotguard_streams_refused_total{status}` (429: a client's share used up; 503: all taken).
    - `spotguard_node_marking_total{result}`: the node marker's counters (marked, unmarked,
      errors, events).
    - `spotguard_gpu_warnings_total{reason}`: GPU warnings (not fatal, so not notices).
    - `spotguard_reports_total{result}`, `spotguard_approvals_total{result}`.
    - `spotguard_ready` (gauge, 0/1).
    """

    def __init__(self, registry: Registry | None = None):
        r = self.registry = registry or Registry()
        self.notices = r.gauge("spotguard_notices", "Live notices on this node.", ("kind", "source"))
        self.changes = r.counter("spotguard_notice_changes_total", "Notice changes published to subscribers.",
                                 ("event", "kind", "source"))
        self.detection = r.histogram("spotguard_detection_latency_seconds",
                                     "Seconds from the source read that first showed a notice to its publication.",
                                     ("source",), LATENCY_BUCKETS)
        self.lead = r.histogram("spotguard_notice_lead_seconds",
                                "Seconds from detection to the deadline, for new notices with a deadline.",
                                ("kind",), LEAD_BUCKETS)
        self.source_age = r.gauge("spotguard_source_last_success_age_seconds",
                                  "Seconds since the source's last successful read (-1: none yet).", ("source",))
        self.source_polls = r.counter("spotguard_source_polls_total", "Reads attempted by each source.", ("source",))
        self.source_errors = r.counter("spotguard_source_errors_total", "Failed source reads by reason.",
                                       ("source", "reason"))
        self.subscribers = r.gauge("spotguard_subscribers", "Open stream subscriptions.")
        self.dropped = r.counter("spotguard_subscribers_dropped_total",
                                 "Stream subscribers cut off for falling too far behind.")
        self.streams_refused = r.counter("spotguard_streams_refused_total",
                                         "Stream requests refused: 429 per-client cap, 503 total cap.", ("status",))
        self.marking = r.counter("spotguard_node_marking_total", "Node marker results.", ("result",))
        self.gpu_warnings = r.counter("spotguard_gpu_warnings_total", "GPU health warnings.", ("reason",))
        self.reports = r.counter("spotguard_reports_total", "POST /v1/reports by result.", ("result",))
        self.approvals = r.counter("spotguard_approvals_total", "Early approvals by result.", ("result",))
        self.ready = r.gauge("spotguard_ready", "1 once the agent is ready.")
        self.ready.set(0)
        self.subscribers.set(0)
        self.dropped.inc(0)

        self._live: dict[str, str] = {}  # live notice id -> kind

    def observe(self, published) -> None:
        """Table listener: counts a published change (a `table.Published`)."""
        change = published.change
        if not isinstance(change, Notice):
            kind = self._live.pop(change.notice_id, "")
            self.changes.inc(event="withdrawn", kind=kind, source=change.source)
            return
        kind, source = change.kind.value, change.source
        if change.id in self._live:
            self.changes.inc(event="changed", kind=kind, source=source)
            return
        self._live[change.id] = kind
        self.changes.inc(event="new", kind=kind, source=source)
        now = now_utc()
        self.detection.observe(max(0.0, (now - change.detected_at).total_seconds()), source=source)
        if change.deadline is not None:
            self.lead.observe(max(0.0, (change.deadline - change.detected_at).total_seconds()), kind=kind)

    def render(self) -> str:
        return self.registry.render()
