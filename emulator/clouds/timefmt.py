"""Timestamp formats the clouds use in their metadata bodies."""
from __future__ import annotations

from datetime import datetime, UTC
from email.utils import format_datetime


def iso_z(ts: float) -> str:
    """2020-04-24T17:11:44Z (AWS spot, Alibaba): whole seconds, UTC."""
    return datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc1123(ts: float) -> str:
    """Mon, 19 Sep 2016 18:29:47 GMT (Azure NotBefore)."""
    return format_datetime(datetime.fromtimestamp(int(ts), UTC), usegmt=True)


def aws_maintenance(ts: float) -> str:
    """21 Jan 2019 09:00:43 GMT (AWS scheduled maintenance)."""
    return datetime.fromtimestamp(int(ts), UTC).strftime("%d %b %Y %H:%M:%S GMT")
