"""Process-wide logging: one JSON object per line for Cloud Logging, or plain text for humans.

JSON (``--log-format json``, the default for ``run``), on stdout, one object per line:

- ``severity``: Cloud Logging's names (DEBUG, INFO, WARNING, ERROR, CRITICAL), which its agents
  read to set the entry's severity; ``message``; ``time`` (RFC 3339, UTC, microseconds);
  ``logger`` (the module's logger name);
- ``stack_trace`` when an exception (or ``stack_info``) is attached: Error Reporting groups
  entries by this field;
- context passed with ``extra=``: ``subscription``, ``key``, ``message_id``, ``delivery_id`` and
  any other extra whose value is a plain scalar (str, int, float, bool, None).

Never the payload: extras named ``data``, ``payload`` or ``attributes`` are dropped, and so is any
extra whose value is not a scalar (bytes, dicts, lists: the shapes a message body comes in). What
goes into the message text itself is up to the caller: log ids, counts and reasons only.

Text (``--log-format text``), on stderr so that a command's own output on stdout (``demo``'s
summary) stays clean: ``<time> <LEVEL> <logger>: <message> [k=v ...]`` plus the traceback.

``setup_logging`` replaces the handler it installed earlier, so calling it twice (tests, a
subcommand that reconfigures) never duplicates lines.

Nothing else writes to stdout or stderr: the Google libraries' loggers propagate to this handler
(``google.api_core`` otherwise cuts the ``google`` logger off from the root when the first client is
built, and its warnings then reach stderr as bare text through logging's last resort), warnings go
through logging, and an exception that ends a thread is logged instead of printed.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from typing import Any, Literal, TextIO

LogFormat = Literal["json", "text"]

CONTEXT_FIELDS = ("subscription", "key", "message_id", "delivery_id")
"""The ``extra=`` fields the project's modules pass; listed first in every line that has them."""

_PAYLOAD_FIELDS = frozenset({"data", "payload", "attributes", "body"})

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
"""Attributes every LogRecord has; anything else on a record came from ``extra=``."""

_SCALARS = (str, int, float, bool, type(None))

_HANDLER_MARK = "_pubsub_sidecar_handler"


def severity(levelno: int) -> str:
    """Cloud Logging's severity name for a Python level (custom levels round down)."""
    if levelno >= logging.CRITICAL:
        return "CRITICAL"
    if levelno >= logging.ERROR:
        return "ERROR"
    if levelno >= logging.WARNING:
        return "WARNING"
    if levelno >= logging.INFO:
        return "INFO"
    return "DEBUG" if levelno > logging.NOTSET else "DEFAULT"


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's ``extra=`` fields that may be logged: scalars, payload names excluded."""
    context: dict[str, Any] = {}
    for name in CONTEXT_FIELDS:
        value = record.__dict__.get(name)
        if value is not None and isinstance(value, _SCALARS):
            context[name] = value
    for name, value in record.__dict__.items():
        if name in _RECORD_FIELDS or name in context or name in _PAYLOAD_FIELDS or name.startswith("_"):
            continue
        if isinstance(value, _SCALARS):
            context[name] = value
    return context


def _rfc3339(created: float) -> str:
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "severity": severity(record.levelno),
            "message": record.getMessage(),
            "time": _rfc3339(record.created),
            "logger": record.name,
        }
        for name, value in context_of(record).items():
            entry.setdefault(name, value)  # an extra never overwrites the fields above
        stack = self._stack_trace(record)
        if stack:
            entry["stack_trace"] = stack
        return json.dumps(entry, ensure_ascii=False, default=str)

    def _stack_trace(self, record: logging.LogRecord) -> str:
        parts = []
        if record.exc_info and record.exc_info[0] is not None:
            parts.append(self.formatException(record.exc_info))
        elif record.exc_text:
            parts.append(record.exc_text)
        if record.stack_info:
            parts.append(self.formatStack(record.stack_info))
        return "\n".join(parts)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> [k=v ...]``, then the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_rfc3339(record.created)} {record.levelname:<8} {record.name}: {record.getMessage()}"
        context = context_of(record)
        if context:
            line += " [" + " ".join(f"{name}={value}" for name, value in context.items()) + "]"
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def parse_level(level: str | int) -> int:
    """A logging level from ``"info"``, ``"WARNING"``, ``"10"`` or 10; raises ValueError."""
    if isinstance(level, int):
        return level
    text = level.strip().upper()
    if text.isdigit():
        return int(text)
    if text == "WARN":
        text = "WARNING"
    value = logging.getLevelNamesMapping().get(text)
    if value is None:
        raise ValueError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


def setup_logging(fmt: LogFormat, level: str | int = "INFO", stream: TextIO | None = None) -> logging.Handler:
    """Send the root logger to stdout as JSON or to stderr as text; returns the installed handler.

    ``stream`` overrides the destination (tests). Raises ValueError on an unknown format or level.
    """
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        default_stream: TextIO = sys.stdout
    elif fmt == "text":
        formatter = TextFormatter()
        default_stream = sys.stderr
    else:
        raise ValueError(f"unknown log format {fmt!r}: use json or text")
    levelno = parse_level(level)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
            old.close()
    handler = logging.StreamHandler(stream if stream is not None else default_stream)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(levelno)
    _route_everything_through(root)
    return handler


_GOOGLE_LOGGER = "google"
"""google-api-core's ``client_logging.initialize_logging`` (run when a client is built) sets this
logger's ``propagate`` to False unless it is already configured; a level counts as configured, and
``propagate`` is set back in case a client was built first."""


def _route_everything_through(root: logging.Logger) -> None:
    google = logging.getLogger(_GOOGLE_LOGGER)
    google.propagate = True
    google.setLevel(root.level)
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
    logging.getLogger(__name__).error("uncaught exception in %s", name, exc_info=exc_info)  # type: ignore[arg-type]
