"""The service's log lines: plain text, or one JSON object per line for log collectors.

Inside an HTTP request, JSON lines carry the request's id (the one its response's `x-request-id`
header and the SDK's `request_id` show), so a client's report leads to the server's lines.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]

# Set by the API's request-id middleware for the duration of each request.
request_id: ContextVar[str | None] = ContextVar("pagedbatch_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as `{"time", "level", "logger", "message"}`, plus `request_id` inside a request
    and `exception` when one is attached."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        current = request_id.get()
        if current is not None:
            line["request_id"] = current
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: LogFormat, level: int = logging.INFO) -> None:
    """One stderr handler on the root logger, replacing any; every library's loggers (uvicorn's,
    Celery's) propagate to it."""
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
