"""The emulator's control API over real HTTP: authentication, validation, and fault behaviour."""
from __future__ import annotations

import asyncio
import importlib.util
import re
import time

import aiohttp
import pytest

from spotguard.emulator.clouds import CLOUD_NAMES
from spotguard.emulator.server import Emulator

SPOT = "/latest/meta-data/spot/instance-action"
LIFECYCLE = "/latest/meta-data/autoscaling/target-lifecycle-state"
CLOUDS_PRESENT = [c for c in CLOUD_NAMES if importlib.util.find_spec(f"spotguard.emulator.clouds.{c}")]

CONTROL_ROUTES = [
    ("POST", "/_emulator/notices", {"kind": "reclaim"}),
    ("GET", "/_emulator/notices", None),
    ("DELETE", "/_emulator/notices/n1", None),
    ("POST", "/_emulator/faults", {"kind": "status"}),
    ("DELETE", "/_emulator/faults", None),
    ("POST", "/_emulator/reset", None),
    ("GET", "/_emulator/requests", None),
    ("GET", "/_emulator/instance", None),
    ("POST", "/_emulator/instance", {"instance_id": "i-0000000000000000f"}),
]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(trust_env=False) as session:
        yield session


class Raw:
    """Plain HTTP calls to one emulator, with or without the control token."""

    def __init__(self, session: aiohttp.ClientSession, emu: Emulator):
        self.session, self.emu = session, emu
        self.auth = {"Authorization": f"Bearer {emu.control_token}"}

    async def control(self, method: str, path: str, body=None, *, headers=None, data=None):
        async with self.session.request(method, self.emu.url + path, json=body, data=data,
                                        headers=self.auth if headers is None else headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def get(self, path: str, timeout: float = 5.0):
        async with self.session.get(self.emu.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()


@pytest.fixture
async def aws(make_emulator, http):
    emu, _control = await make_emulator("aws")
    return Raw(http, emu)


# -- authentication -------------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, body", CONTROL_ROUTES, ids=[f"{m} {p}" for m, p, _ in CONTROL_ROUTES])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}],
                         ids=["none", "wrong-token", "other-scheme"])
async def test_control_api_requires_the_bearer_token(aws, method, path, body, headers):
    before = aws.emu.handler.instance_id
    status, reply = await aws.control(method, path, body, headers=headers)
    assert status == 401 and "token" in reply["error"]
    status, listed = await aws.control("GET", "/_emulator/notices")
    assert status == 200 and listed["notices"] == []  # the refused call changed nothing
    assert aws.emu.faults.rules == [] and aws.emu.handler.instance_id == before


@pytest.mark.parametrize("cloud", CLOUDS_PRESENT)
async def test_every_cloud_guards_its_control_api(make_emulator, http, cloud):
    emu, _ = await make_emulator(cloud)
    raw = Raw(http, emu)
    assert (await raw.control("POST", "/_emulator/reset", headers={}))[0] == 401
    assert (await raw.control("POST", "/_emulator/reset"))[0] == 200


async def test_correct_token_is_accepted_on_every_route(aws):
    assert (await aws.control("POST", "/_emulator/notices", {"kind": "reclaim", "in": 60}))[0] == 201
    assert (await aws.control("GET", "/_emulator/notices"))[0] == 200
    assert (await aws.control("DELETE", "/_emulator/notices/n1"))[0] == 200
    assert (await aws.control("POST", "/_emulator/faults", {"kind": "status"}))[0] == 201
    assert (await aws.control("DELETE", "/_emulator/faults"))[0] == 200
    assert (await aws.control("POST", "/_emulator/reset"))[0] == 200
    assert (await aws.control("GET", "/_emulator/requests"))[0] == 200


async def test_cloud_paths_need_no_control_token(aws):
    status, _ = await aws.get(LIFECYCLE)
    assert status == 200


# -- schedule / cancel / list / reset ---------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"kind": "explode"}, "kind"),
    ({}, "kind"),
    ({"kind": "reclaim", "in": -1}, "in"),
    ({"kind": "reclaim", "in": "soon"}, "in"),
    ({"kind": "reclaim", "in": True}, "in"),
    ({"kind": "reclaim", "in": 10 ** 9}, "in"),
    ({"kind": "reclaim", "lead": -5}, "lead"),
    ({"kind": "reclaim", "lead": None}, "lead"),
    ({"kind": "reclaim", "action": "reboot"}, "action"),
    ({"kind": "maintenance", "code": "oops"}, "code"),
    ({"kind": "maintenance", "state": "canceled"}, "state"),
    ({"kind": "maintenance", "duration": -1}, "duration"),
    ({"kind": "maintenance", "duration": "long"}, "duration"),
    ([1, 2], "body"),
    ("reclaim", "body"),
])
async def test_schedule_validation_names_the_field(aws, body, field):
    status, reply = await aws.control("POST", "/_emulator/notices", body)
    assert status == 400
    assert reply["error"].startswith(f"{field}:"), reply
    assert (await aws.control("GET", "/_emulator/notices"))[1]["notices"] == []


async def test_schedule_body_not_json(aws):
    status, reply = await aws.control("POST", "/_emulator/notices", data=b"{not json",
                                      headers={**aws.auth, "Content-Type": "application/json"})
    assert status == 400 and reply["error"].startswith("body:")


async def test_schedule_list_flip_and_cancel(aws):
    before = time.time()
    status, later = await aws.control("POST", "/_emulator/notices", {"kind": "reclaim", "in": 30, "lead": 90})
    assert status == 201 and later["served_at"] is None
    assert before + 30 <= later["serve_at"] <= time.time() + 30
    status, now = await aws.control("POST", "/_emulator/notices", {"kind": "rebalance"})
    assert now["served_at"] is not None and now["deadline"] == pytest.approx(now["served_at"] + 600)
    _, listed = await aws.control("GET", "/_emulator/notices")
    assert [n["id"] for n in listed["notices"]] == [later["id"], now["id"]]
    assert (await aws.get(SPOT))[0] == 404  # the scheduled reclaim has not flipped yet

    status, canceled = await aws.control("DELETE", f"/_emulator/notices/{later['id']}")
    assert status == 200 and canceled["canceled_at"] is not None and canceled["served_at"] is None
    status, reply = await aws.control("DELETE", "/_emulator/notices/n999")
    assert status == 404 and "n999" in reply["error"]


async def test_a_notice_flips_on_time(aws):
    _, scheduled = await aws.control("POST", "/_emulator/notices", {"kind": "reclaim", "in": 0.2})
    assert (await aws.get(SPOT))[0] == 404
    await asyncio.sleep(0.4)
    status, body = await aws.get(SPOT)
    assert status == 200 and b'"terminate"' in body
    [listed] = (await aws.control("GET", "/_emulator/notices"))[1]["notices"]
    assert listed["served_at"] >= scheduled["serve_at"] - 0.01


async def test_canceled_before_flip_never_appears(aws):
    _, scheduled = await aws.control("POST", "/_emulator/notices", {"kind": "reclaim", "in": 0.1})
    await aws.control("DELETE", f"/_emulator/notices/{scheduled['id']}")
    await asyncio.sleep(0.3)
    assert (await aws.get(SPOT))[0] == 404


async def test_reset_drops_notices_faults_and_counts(aws):
    await aws.control("POST", "/_emulator/notices", {"kind": "reclaim"})
    await aws.control("POST", "/_emulator/notices", {"kind": "lifecycle", "in": 5})
    await aws.control("POST", "/_emulator/faults", {"kind": "status", "path": LIFECYCLE, "count": 0})
    await aws.get(SPOT)
    assert (await aws.control("GET", "/_emulator/requests"))[1]["total"] == 1
    assert (await aws.control("POST", "/_emulator/reset")) == (200, {"reset": True})
    assert (await aws.control("GET", "/_emulator/notices"))[1]["notices"] == []
    assert (await aws.control("GET", "/_emulator/requests"))[1] == {"total": 0, "by_path": {}}
    assert (await aws.get(SPOT))[0] == 404
    assert (await aws.get(LIFECYCLE)) == (200, b"InService")


# -- faults -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"kind": "meltdown"}, "kind"),
    ({}, "kind"),
    ({"kind": "status", "path": "latest"}, "path"),
    ({"kind": "status", "path": 7}, "path"),
    ({"kind": "status", "count": -1}, "count"),
    ({"kind": "status", "count": "many"}, "count"),
    ({"kind": "latency", "seconds": -0.5}, "seconds"),
    ({"kind": "latency", "seconds": True}, "seconds"),
    ({"kind": "status", "status": 99}, "status"),
    ({"kind": "status", "status": 600}, "status"),
    ({"kind": "oversized", "bytes": -1}, "bytes"),
    ({"kind": "oversized", "bytes": 1 << 40}, "bytes"),
    ([{"kind": "status"}], "fault"),
])
async def test_fault_validation_names_the_field(aws, body, field):
    status, reply = await aws.control("POST", "/_emulator/faults", body)
    assert status == 400
    assert reply["error"].startswith(f"{field}:"), reply
    assert aws.emu.faults.rules == []


async def test_status_fault_count_and_path_prefix(aws):
    _, rule = await aws.control("POST", "/_emulator/faults", {"kind": "status", "status": 503, "count": 2,
                                                               "path": "/latest/meta-data/spot/"})
    assert rule["remaining"] == 2 and rule["kind"] == "status"
    assert (await aws.get(LIFECYCLE))[0] == 200  # other paths are untouched
    assert (await aws.get(SPOT))[0] == 503
    assert (await aws.get(SPOT))[0] == 503
    assert (await aws.get(SPOT))[0] == 404  # used up after `count` requests


async def test_fault_until_cleared_and_control_paths_exempt(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "status", "status": 429, "count": 0})
    for _ in range(3):
        assert (await aws.get(LIFECYCLE))[0] == 429
    assert (await aws.control("GET", "/_emulator/notices"))[0] == 200  # control never faulted
    assert (await aws.control("DELETE", "/_emulator/faults")) == (200, {"faults": []})
    assert (await aws.get(LIFECYCLE))[0] == 200


async def test_latency_fault_delays_the_answer(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "latency", "seconds": 0.3, "path": LIFECYCLE})
    start = time.monotonic()
    assert (await aws.get(LIFECYCLE)) == (200, b"InService")
    assert time.monotonic() - start >= 0.29


async def test_hang_fault_never_answers(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "hang", "path": LIFECYCLE})
    with pytest.raises(asyncio.TimeoutError):
        await aws.get(LIFECYCLE, timeout=0.3)
    assert (await aws.get(LIFECYCLE))[0] == 200  # count 1: the next request is answered


async def test_malformed_fault_is_200_with_a_corrupt_body(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "malformed", "path": SPOT})
    status, body = await aws.get(SPOT)
    assert status == 200
    with pytest.raises(ValueError):
        __import__("json").loads(body)


async def test_oversized_fault_sends_the_bytes_asked_for(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "oversized", "bytes": 300_000, "path": SPOT})
    status, body = await aws.get(SPOT)
    assert status == 200 and len(body) == 300_000


async def test_drop_fault_closes_the_connection(aws):
    await aws.control("POST", "/_emulator/faults", {"kind": "drop", "path": SPOT, "count": 2})
    with pytest.raises(aiohttp.ClientError):
        await aws.get(SPOT)
    assert (await aws.get(SPOT))[0] == 404


async def test_expired_token_fault_invalidates_issued_tokens(aws):
    async with aws.session.put(aws.emu.url + "/latest/api/token",
                               headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}) as resp:
        token = await resp.text()
    headers = {"X-aws-ec2-metadata-token": token}
    async with aws.session.get(aws.emu.url + LIFECYCLE, headers=headers) as resp:
        assert resp.status == 200
    await aws.control("POST", "/_emulator/faults", {"kind": "expired-token"})
    async with aws.session.get(aws.emu.url + LIFECYCLE, headers=headers) as resp:
        assert resp.status == 401


async def test_request_counts_by_path(aws):
    await aws.get(SPOT)
    await aws.get(SPOT)
    await aws.get(LIFECYCLE)
    _, counts = await aws.control("GET", "/_emulator/requests")
    assert counts == {"total": 3, "by_path": {SPOT: 2, LIFECYCLE: 1}}


# -- the instance -----------------------------------------------------------------------------------

INSTANCE_ID_READS = {  # cloud -> (path, query, headers, the form of that cloud's instance ids)
    "aws": ("/latest/meta-data/instance-id", {}, {}, r"i-[0-9a-f]{17}"),
    "gcp": ("/computeMetadata/v1/instance/id", {}, {"Metadata-Flavor": "Google"}, r"[1-9][0-9]{18}"),
    "azure": ("/metadata/instance/compute/vmId", {"api-version": "2021-02-01", "format": "text"},
              {"Metadata": "true"}, r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"),
    "alibaba": ("/latest/meta-data/instance-id", {}, {}, r"i-[0-9a-z]{20}"),
}


async def served_instance_id(http: aiohttp.ClientSession, emu: Emulator) -> str:
    """The instance id the emulated cloud serves on its own path (with the headers it asks for)."""
    path, query, headers, form = INSTANCE_ID_READS[emu.cloud]
    async with http.get(emu.url + path, params=query, headers=headers) as resp:
        assert resp.status == 200
        text = await resp.text()
    assert re.fullmatch(form, text), text
    return text


@pytest.mark.parametrize("cloud", sorted(INSTANCE_ID_READS))
async def test_every_emulated_vm_is_a_new_instance(make_emulator, http, cloud):
    first, _ = await make_emulator(cloud)
    second, _ = await make_emulator(cloud)
    ids = [await served_instance_id(http, emu) for emu in (first, second)]
    assert ids == [first.handler.instance_id, second.handler.instance_id] and ids[0] != ids[1]
    assert await served_instance_id(http, first) == ids[0]  # the same VM: the same id on every read


@pytest.mark.parametrize("cloud", sorted(INSTANCE_ID_READS))
async def test_replacing_the_instance_keeps_the_name_and_the_notices(make_emulator, http, cloud):
    emu, control = await make_emulator(cloud)
    raw = Raw(http, emu)
    await control.schedule(emu.handler.kinds[0], lead=300)
    old = await control.instance_id()
    new = await control.replace_instance()
    assert new != old and await served_instance_id(http, emu) == new == await control.instance_id()
    assert [n["served_at"] is not None for n in await control.notices()] == [True]
    assert (await raw.control("POST", "/_emulator/instance", {"instance_id": 7}))[0] == 400
    status, reply = await raw.control("POST", "/_emulator/instance", {"instance_id": "two words"})
    assert status == 400 and reply["error"].startswith("instance_id:")
    assert await control.instance_id() == new  # a refused id changes nothing


@pytest.mark.parametrize("cloud", sorted(INSTANCE_ID_READS))
async def test_the_instance_id_can_be_given(make_emulator, http, cloud):
    given = {"aws": "i-0123456789abcdef0", "gcp": "4520031799277581759",
             "azure": "02aab8a4-74ef-476e-8182-f6d2ba4166a6", "alibaba": "i-bp67acfmxazb4ph3pqx0"}[cloud]
    emu, control = await make_emulator(cloud, instance_id=given)
    assert await served_instance_id(http, emu) == given
    assert await control.replace_instance(given) == given  # the same id again: as a test may need


async def test_azure_serves_the_vm_id_as_a_leaf_only(make_emulator, http):
    emu, _ = await make_emulator("azure")
    url = emu.url + "/metadata/instance/compute/vmId"
    async with http.get(url, params={"api-version": "2021-02-01"}, headers={"Metadata": "true"}) as resp:
        assert resp.status == 400  # without format=text
    async with http.get(url, params={"api-version": "2021-02-01", "format": "text"}) as resp:
        assert resp.status == 400  # without the Metadata header
