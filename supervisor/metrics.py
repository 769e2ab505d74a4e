"""The supervisor's Prometheus metrics and its small aiohttp server (/metrics, /healthz).

Families (prefix `spotguard_supervisor_` for operation, `spotguard_job_` per job; job labels
are namespace, job, kind):
- `spotguard_supervisor_leader` (gauge): 1 while this replica holds the Lease.
- `spotguard_supervisor_managed_jobs` (gauge): managed jobs seen.
- `spotguard_supervisor_decisions_total{action,reason}` (counter): decisions applied.
- `spotguard_supervisor_conflicts_total` (counter): writes refused with 409 (re-read, retried).
- `spotguard_supervisor_errors_total` (counter): failed reconciles (retried with backoff).
- `spotguard_supervisor_notice_to_patch_seconds` (histogram): node notice seen -> job patched.
- `spotguard_job_cost_dollars`, `spotguard_job_on_demand_equivalent_dollars`,
  `spotguard_job_savings_ratio`, `spotguard_job_spot_node_hours`,
  `spotguard_job_on_demand_node_hours` (gauges): cost accounting (cost.py).
- `spotguard_job_reclaims_survived` (gauge): from the decision record.
- `spotguard_job_steps_lost` (gauge): from the job annotation `spotguard.io/steps-lost`.
- `spotguard_job_suspended` (gauge, 0/1): 1 while the decision record's phase is Suspended or
  GaveUp (spotguard keeps the job suspended).
- `spotguard_job_on_demand` (gauge, 0/1): 1 while the job runs on on-demand capacity after a
  fallback (the record's `capacity`).
- `spotguard_pods_missing_sidecar{namespace}` (gauge): live pods labelled `spotguard.io/inject`
  admitted without the sidecar while the injector did not answer (sidecar_watch.py).
The alerts in daemonset/monitoring/prometheus-rule.yaml read these names.
"""
from __future__ import annotations

from aiohttp import web

from spotguard.metrics import CONTENT_TYPE, LATENCY_BUCKETS, Registry

JOB_LABELS = ("namespace", "job", "kind")


class SupervisorMetrics:
    """Holds the families listed in the module docstring."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.leader = r.gauge("spotguard_supervisor_leader", "1 while this replica holds the Lease")
        self.managed_jobs = r.gauge("spotguard_supervisor_managed_jobs", "Managed jobs seen")
        self.decisions = r.counter("spotguard_supervisor_decisions_total", "Decisions applied", ("action", "reason"))
        self.conflicts = r.counter("spotguard_supervisor_conflicts_total", "Writes refused with 409 and retried")
        self.errors = r.counter("spotguard_supervisor_errors_total", "Failed reconciles, retried with backoff")
        self.notice_to_patch = r.histogram("spotguard_supervisor_notice_to_patch_seconds",
                                           "Node notice seen by the supervisor -> job patched", buckets=LATENCY_BUCKETS)
        self.cost = r.gauge("spotguard_job_cost_dollars", "Node cost so far", JOB_LABELS)
        self.on_demand = r.gauge("spotguard_job_on_demand_equivalent_dollars",
                                 "What the same node-hours would have cost on demand", JOB_LABELS)
        self.savings = r.gauge("spotguard_job_savings_ratio", "1 - cost / on-demand equivalent", JOB_LABELS)
        self.spot_hours = r.gauge("spotguard_job_spot_node_hours", "Node-hours on spot nodes", JOB_LABELS)
        self.on_demand_hours = r.gauge("spotguard_job_on_demand_node_hours", "Node-hours on on-demand nodes",
                                       JOB_LABELS)
        self.reclaims = r.gauge("spotguard_job_reclaims_survived", "Notices the job went through (decision record)",
                                JOB_LABELS)
        self.steps_lost = r.gauge("spotguard_job_steps_lost",
                                  "Training steps lost to reclaims (spotguard.io/steps-lost)", JOB_LABELS)
        self.suspended = r.gauge("spotguard_job_suspended", "1 while spotguard keeps the job suspended", JOB_LABELS)
        self.on_demand_now = r.gauge("spotguard_job_on_demand",
                                     "1 while the job runs on on-demand capacity after a fallback", JOB_LABELS)
        self.pods_missing_sidecar = r.gauge("spotguard_pods_missing_sidecar",
                                            "Live pods labelled spotguard.io/inject that were admitted without "
                                            "the sidecar (the injector did not answer)", ("namespace",))

    def render(self) -> str:
        return self.registry.render()


def metrics_app(metrics: SupervisorMetrics) -> web.Application:
    async def get_metrics(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", healthz)
    return app
