"""HookReporter's contract: `report` never raises; a report it cannot send returns False."""
from __future__ import annotations

from spotguard.hooks.hook_reporter import HookReporter


def test_a_sidecar_url_without_a_host_is_a_failed_report_not_an_exception():
    reporter = HookReporter("http:///sidecar", None, rank=0, world_size=1)
    assert reporter.report("n1", 3, "drained", 0.5) is False
    assert reporter.sent == []
