"""One reclaim source per cloud over the metadata emulator, and what a freshly started one reads:
shared by the tests of the instance in notice ids (sources, and the Guard's gate)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spotguard.agent.sources.alibaba import EcsMetadataClient, TerminationTimeSource
from spotguard.agent.sources.aws import ImdsClient, SpotInterruptionSource
from spotguard.agent.sources.azure import AzureImdsClient, ScheduledEventsSource
from spotguard.agent.sources.base import Source
from spotguard.agent.sources.gcp import PreemptedSource
from spotguard.agent.sources.http import MetadataClient
from spotguard.wire.notice import Kind, Notice
from tests.source_harness import SourceRunner

NODE = "node-1"


@dataclass(frozen=True)
class Cloud:
    """How to build one cloud's reclaim source on an emulator, and where its instance id is."""

    name: str
    source: Callable[[str], Source]
    instance_path: str
    options: dict = field(default_factory=dict)  # the emulator's


CLOUDS = {
    "aws": Cloud("aws", lambda url: SpotInterruptionSource(ImdsClient(url, timeout=0.5), NODE, 0.2, owns_client=True),
                 "/latest/meta-data/instance-id"),
    "gcp": Cloud("gcp", lambda url: PreemptedSource(MetadataClient(url, timeout=0.5), NODE, 0.0, wait_seconds=1,
                                                    owns_client=True),
                 "/computeMetadata/v1/instance/id"),
    "azure": Cloud("azure", lambda url: ScheduledEventsSource(AzureImdsClient(url, timeout=0.5), NODE, 0.25),
                   "/metadata/instance/compute/vmId", {"rate_limit": 0}),  # several agents read at once here
    "alibaba": Cloud("alibaba", lambda url: TerminationTimeSource(EcsMetadataClient(url, timeout=0.5), NODE, 0.2,
                                                                  owns_client=True),
                     "/latest/meta-data/instance-id"),
}


def is_notice(update) -> bool:
    return isinstance(update, Notice)


async def read_once(cloud: Cloud, url: str) -> Notice:
    """The reclaim notice a freshly started source (an agent started now) reads."""
    source = cloud.source(url)
    async with SourceRunner(source) as run:
        notice = await run.wait_for(is_notice)
        await run.wait_until(lambda: source.stats.polls >= 3, what="two more polls")
    assert run.updates == [notice], "the same instance's notice changed or left across polls"
    # a poll that times out on a loaded machine is retried and changes no id; any other error is a fault here
    assert set(source.stats.errors) <= {"timeout"}, source.stats.errors
    assert notice.kind is Kind.RECLAIM
    return notice
