"""The control plane's logs: structured (JSON, one object a line) for collectors, or text lines for a person at a
terminal; a record logged with ``extra={"job_id": ...}`` carries the job id (a field in JSON, `key=value` in text)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is emitted as a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value …`, the extra fields after the message."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extra = " ".join(
            f"{key}={value}" for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")
        )
        line = f"{moment} {record.levelname:<7} {record.name}: {record.getMessage()}" + (
            f"  [{extra}]" if extra else ""
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(
    level: int | str = logging.INFO, stream: TextIO | None = None, log_format: str = "json"
) -> logging.Handler:
    """Send the root logger (and uvicorn's, which otherwise keep their own handlers) to one handler: JSON lines, text
    lines, or (auto) text on a terminal and JSON otherwise."""
    stream = stream or sys.stderr
    text = log_format == "text" or (log_format == "auto" and stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter() if text else JsonFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    return handler
