"""Which cloud is this machine on? DMI first (no network), then metadata probes.

`detect_cloud()` returns "aws", "gcp", "azure", "alibaba" or None:
1. DMI (`/sys/class/dmi/id`): sys_vendor, product_name, bios_vendor, chassis_asset_tag.
   "Amazon EC2" -> aws; "Google" -> gcp; "Microsoft Corporation" with product "Virtual Machine",
   or Azure's chassis asset tag 7783-7084-3265-9085 -> azure; "Alibaba Cloud" -> alibaba.
2. Otherwise every cloud's metadata endpoint is probed at once, each with the header that cloud
   requires, and the first that answers with its cloud's signature wins:
   - aws: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` -> 200 and a token;
   - gcp: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` -> a reply
     carrying `Metadata-Flavor: Google` back;
   - azure: `GET /metadata/instance/compute/name` or `/metadata/scheduledevents` with
     `Metadata: true` -> 200 (scheduled events: a JSON object with `DocumentIncarnation`);
   - alibaba: `PUT /latest/api/token` with `X-aliyun-ecs-metadata-token-ttl-seconds` -> 200 and a
     token, or `GET /latest/meta-data/region-id` -> 200 (AWS has no such path).
   With `base_url` given, all probes go to that one URL (an emulator, a proxy); without it, each
   cloud's own address. Every probe is bounded by `timeout`; a failed probe is just "no".
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable

from spotguard.agent.sources.base import SourceError
from spotguard.agent.sources.http import MetadataClient

log = logging.getLogger(__name__)

DMI_DIR = "/sys/class/dmi/id"
DMI_FILES = ("sys_vendor", "product_name", "bios_vendor", "chassis_asset_tag")
AZURE_ASSET_TAG = "7783-7084-3265-9085"
DEFAULT_URLS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://169.254.169.254",  # metadata.google.internal without a DNS lookup
    "azure": "http://169.254.169.254",
    "alibaba": "http://100.100.100.200",
}
PROBE_MAX_BODY = 4096


def read_dmi(dmi_dir: str = DMI_DIR) -> dict[str, str]:
    """The DMI fields detection uses, stripped; a missing or unreadable file is left out."""
    fields = {}
    for name in DMI_FILES:
        try:
            with open(os.path.join(dmi_dir, name), "rb") as f:
                fields[name] = f.read(256).decode("utf-8", "replace").strip()
        except OSError:
            continue
    return fields


def cloud_from_dmi(fields: dict[str, str]) -> str | None:
    """The cloud the DMI fields name, or None."""
    vendor = fields.get("sys_vendor", "")
    product = fields.get("product_name", "")
    bios = fields.get("bios_vendor", "")
    if "Amazon EC2" in (vendor, bios) or vendor.startswith("Amazon"):
        return "aws"
    if vendor.startswith("Google") or product.startswith("Google Compute Engine"):
        return "gcp"
    if fields.get("chassis_asset_tag") == AZURE_ASSET_TAG or (
            vendor == "Microsoft Corporation" and product == "Virtual Machine"):
        return "azure"
    if vendor.startswith("Alibaba Cloud") or product.startswith("Alibaba Cloud"):
        return "alibaba"
    return None


async def _probe_aws(http: MetadataClient) -> bool:
    resp = await http.request("PUT", "/latest/api/token",
                              headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    return resp.status == 200 and bool(resp.body.strip())


async def _probe_gcp(http: MetadataClient) -> bool:
    resp = await http.request("GET", "/computeMetadata/v1/instance/preempted",
                              headers={"Metadata-Flavor": "Google"})
    return resp.status < 500 and resp.headers.get("Metadata-Flavor") == "Google"


async def _probe_azure(http: MetadataClient) -> bool:
    headers = {"Metadata": "true"}
    name, events = await asyncio.gather(
        http.request("GET", "/metadata/instance/compute/name", headers=headers,
                     params={"api-version": "2021-02-01", "format": "text"}),
        http.request("GET", "/metadata/scheduledevents", headers=headers,
                     params={"api-version": "2020-07-01"}),
        return_exceptions=True)
    if not isinstance(name, BaseException) and name.status == 200 and name.body.strip():
        return True
    if isinstance(events, BaseException) or events.status != 200:
        return False
    try:
        body = json.loads(events.body)
    except ValueError:
        return False
    return isinstance(body, dict) and "DocumentIncarnation" in body


async def _probe_alibaba(http: MetadataClient) -> bool:
    token, region = await asyncio.gather(
        http.request("PUT", "/latest/api/token", headers={"X-aliyun-ecs-metadata-token-ttl-seconds": "60"}),
        http.request("GET", "/latest/meta-data/region-id"),
        return_exceptions=True)
    for resp in (token, region):
        if not isinstance(resp, BaseException) and resp.status == 200 and resp.body.strip():
            return True
    return False


PROBES: dict[str, Callable[[MetadataClient], Awaitable[bool]]] = {
    "aws": _probe_aws, "gcp": _probe_gcp, "azure": _probe_azure, "alibaba": _probe_alibaba,
}


async def probe_cloud(base_url: str | None = None, timeout: float = 0.5) -> str | None:
    """Probes every cloud's metadata endpoint concurrently; the first positive answer wins."""
    clients = {cloud: MetadataClient(base_url or DEFAULT_URLS[cloud], timeout=timeout, max_body=PROBE_MAX_BODY)
               for cloud in PROBES}

    async def probe(cloud: str) -> str | None:
        try:
            return cloud if await PROBES[cloud](clients[cloud]) else None
        except SourceError as exc:
            log.debug("cloud probe %s: %s", cloud, exc)
            return None

    tasks = [asyncio.create_task(probe(cloud), name=f"probe:{cloud}") for cloud in PROBES]
    try:
        for next_done in asyncio.as_completed(tasks, timeout=timeout * 2 + 0.5):
            try:
                found = await next_done
            except TimeoutError:
                return None
            if found is not None:
                return found
        return None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)


async def detect_cloud(base_url: str | None = None, dmi_dir: str = DMI_DIR, timeout: float = 0.5) -> str | None:
    """The cloud this machine runs on (aws, gcp, azure, alibaba), or None; see the module doc.

    DMI is read in a thread (file reads never run on the event loop).
    """
    cloud = cloud_from_dmi(await asyncio.to_thread(read_dmi, dmi_dir))
    if cloud is not None:
        return cloud
    return await probe_cloud(base_url, timeout)
