"""Log formats: plain text, or JSON lines carrying conversation ids (``--log-format json``).

Modules log through ``logging.getLogger(__name__)`` as usual and pass what a line is about
with ``extra=context(conv=..., peer=..., seq=...)``. :class:`JsonFormatter` writes one JSON
object per record::

    {"ts": "2025-01-02T03:04:05.678Z", "level": "INFO", "logger": "meshinfer.peer.node",
     "message": "...", "peer": "3f2a...", "conv": "9b1c...", "seq": 4}

``conv``, ``peer`` and ``seq`` appear only when the record carries them; ``exc`` holds a
formatted traceback when there is one. Only the CLI installs handlers (:func:`configure`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO

#: Record attributes copied into a JSON line when set (through ``extra=``).
CONTEXT_FIELDS = ("peer", "conv", "seq")
#: Format of text lines (the default ``--log-format``).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")


def context(*, conv: str | None = None, peer: str | None = None, seq: int | None = None) -> dict:
    """The ``extra=`` mapping for a log call about a conversation, a peer and/or a step."""
    return {k: v for k, v in (("conv", conv), ("peer", peer), ("seq", seq)) if v is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601, ms), level, logger, message, and the
    :data:`CONTEXT_FIELDS` present on the record. Never raises for odd ``extra`` values
    (they are written with ``str``)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: int, fmt: str = "text", *, stream: IO[str] | None = None) -> None:
    """Send meshinfer's logs to ``stream`` (stderr) at ``level`` in format ``fmt``.

    Replaces the handler a previous call installed on the root logger (others, such as
    pytest's, stay); quiets ``websockets``.

    Raises:
        ValueError: ``fmt`` is not one of :data:`LOG_FORMATS`.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.name = "meshinfer"
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.name == "meshinfer"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("websockets").setLevel(logging.WARNING)
