"""JSON-lines logging to stderr, one object per record, for every long-running command."""
from __future__ import annotations

import json
import logging
import sys
from typing import ClassVar
import time


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: ts, level, logger, msg, plus any `extra` fields."""

    _STANDARD: ClassVar[set[str]] = set(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", json_format: bool = True) -> None:
    """Routes the root logger to stderr, as JSON lines unless json_format is False."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if json_format else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
