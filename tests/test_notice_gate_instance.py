"""The Guard's gate and the instance in notice ids: "already answered" never suppresses the
notice of a VM re-created under the same name.

The job resumed from the checkpoint that answered a node's notice (`NoticeGate.answered`); the
node's VM is then re-created under its name and announces the same event, byte for byte (GCP's
`preempted` TRUE, same ETag): the new VM's notice must be acted on, while a re-sent copy of the
answered one stays ignored. The ids come from the real sources over HTTP.
"""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spotguard.hooks.notice_gate import Action, NoticeGate
from tests.cloud_sources import CLOUDS, read_once


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
async def test_an_answered_notice_does_not_suppress_the_recreated_instances(make_emulator, cloud):
    emu, control = await make_emulator(cloud, **CLOUDS[cloud].options)
    await control.schedule("reclaim", lead=60)
    answered = await read_once(CLOUDS[cloud], emu.url)
    await control.replace_instance()
    recreated = await read_once(CLOUDS[cloud], emu.url)

    gate = NoticeGate(horizon_seconds=120)
    gate.answered(answered.id)  # the checkpoint the job resumed from answered the old VM's notice
    now = datetime.now(UTC)
    again = gate.offer(answered, now)
    assert (again.action, again.why) == (Action.IGNORE, "answered")  # a re-sent copy never drains again
    decision = gate.offer(recreated, now)
    assert decision.action is Action.ACT and gate.pending == recreated
