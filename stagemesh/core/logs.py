"""Logging for every service: one line per record, as text or as JSON.

Structured fields travel as ``log.info(msg, *args, extra={"fields": {...}})``:
text logs show the message (which already says it all), JSON logs add the
fields as keys, with the trace and span ids when a span is active.
"""
from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        try:
            from opentelemetry import trace

            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                entry["trace_id"], entry["span_id"] = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        except ImportError:
            pass
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # third-party chatter stays at warning unless asked for
    for name in ("aiohttp.access", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
