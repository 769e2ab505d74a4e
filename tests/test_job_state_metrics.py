"""The per-job state gauges the alerts read (`spotguard_job_suspended`, `spotguard_job_on_demand`)
follow the decision record of each managed job."""
from __future__ import annotations

from spotguard.supervisor.cluster_cache import ClusterCache
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.cost_keeper import CostKeeper
from spotguard.supervisor.jobs import BY_KIND
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.wire import names


def job(name: str, status: str | None) -> dict:
    annotations = {names.ANN_POLICY: "elastic"}
    if status is not None:
        annotations[names.ANN_STATUS] = status
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "train", "annotations": annotations},
            "spec": {"parallelism": 2, "completions": 2, "template": {"spec": {"containers": []}}}}


def test_state_gauges_follow_the_record():
    adapters = dict(BY_KIND)
    cache = ClusterCache(adapters)
    cache.apply_job(adapters["Job"], "SYNC", [
        job("suspended", '{"v":1,"phase":"Suspended"}'),
        job("gave-up", '{"v":1,"phase":"GaveUp"}'),
        job("fallen-back", '{"v":1,"phase":"Running","capacity":"on-demand"}'),
        job("fresh", None),
        job("unreadable", "{not json"),
    ])
    metrics = SupervisorMetrics()
    CostKeeper(CostLedger(), cache, adapters, None, metrics, lambda: True).collect()  # type: ignore[arg-type]
    text = metrics.render()

    def value(family: str, name: str) -> str | None:
        prefix = f'{family}{{namespace="train",job="{name}",kind="Job"}} '
        return next((line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)), None)

    assert [value("spotguard_job_suspended", n) for n in ("suspended", "gave-up", "fallen-back", "fresh")] == \
        ["1", "1", "0", "0"]
    assert [value("spotguard_job_on_demand", n) for n in ("suspended", "fallen-back", "fresh")] == ["0", "1", "0"]
    assert value("spotguard_job_suspended", "unreadable") is None  # no record: no state to report
