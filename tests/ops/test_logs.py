"""Logging: JSON lines with Cloud Logging's fields, context from ``extra=``, never the payload."""

from __future__ import annotations

import datetime
import io
import json
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from google.api_core import client_logging

from sidecar.ops.logs import parse_level, setup_logging, severity


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def lines_of(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_cloud_logging_fields(restore_root_logger: None) -> None:
    stream = io.StringIO()
    setup_logging("json", "INFO", stream=stream)
    before = datetime.datetime.now(datetime.UTC)

    logging.getLogger("sidecar.pipeline.ingest").warning("paused: %d undelivered", 12)

    (entry,) = lines_of(stream)
    assert entry["severity"] == "WARNING"
    assert entry["message"] == "paused: 12 undelivered"
    assert entry["logger"] == "sidecar.pipeline.ingest"
    logged_at = datetime.datetime.fromisoformat(entry["time"].replace("Z", "+00:00"))
    assert entry["time"].endswith("Z")
    assert abs((logged_at - before).total_seconds()) < 60


def test_json_carries_context_but_never_payload(restore_root_logger: None) -> None:
    stream = io.StringIO()
    setup_logging("json", "DEBUG", stream=stream)

    logging.getLogger("sidecar.delivery.servicer").info(
        "delivered",
        extra={
            "subscription": "orders",
            "key": "o/1 ключ",
            "message_id": "m-1",
            "delivery_id": "d-1",
            "attempt": 2,
            "data": "SECRET-PAYLOAD",
            "payload": b"SECRET-PAYLOAD",
            "attributes": {"secret": "SECRET-PAYLOAD"},
            "body_bytes": b"SECRET-PAYLOAD",
            "sizes": [1, 2],
        },
    )

    raw = stream.getvalue()
    assert "SECRET-PAYLOAD" not in raw
    (entry,) = lines_of(stream)
    assert {k: entry[k] for k in ("subscription", "key", "message_id", "delivery_id", "attempt")} == {
        "subscription": "orders",
        "key": "o/1 ключ",
        "message_id": "m-1",
        "delivery_id": "d-1",
        "attempt": 2,
    }
    assert "sizes" not in entry and "data" not in entry


def test_json_exception_goes_to_stack_trace_on_one_line(restore_root_logger: None) -> None:
    stream = io.StringIO()
    setup_logging("json", "INFO", stream=stream)

    try:
        raise RuntimeError("store unavailable\nsecond line")
    except RuntimeError:
        logging.getLogger("sidecar.store").exception("persist failed")

    assert len(stream.getvalue().splitlines()) == 1
    (entry,) = lines_of(stream)
    assert entry["severity"] == "ERROR"
    assert entry["message"] == "persist failed"
    assert "Traceback" in entry["stack_trace"]
    assert "RuntimeError: store unavailable" in entry["stack_trace"]


def test_level_filters_and_critical_maps(restore_root_logger: None) -> None:
    stream = io.StringIO()
    setup_logging("json", "warning", stream=stream)
    log = logging.getLogger("sidecar.wiring.app")

    log.info("hidden")
    log.critical("boom")

    assert [(e["severity"], e["message"]) for e in lines_of(stream)] == [("CRITICAL", "boom")]


def test_setup_twice_replaces_its_own_handler(restore_root_logger: None) -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("json", "INFO", stream=first)
    setup_logging("json", "INFO", stream=second)

    logging.getLogger("x").info("once")

    assert first.getvalue() == ""
    assert [e["message"] for e in lines_of(second)] == ["once"]


def test_text_format_is_readable_with_context_and_traceback(restore_root_logger: None) -> None:
    stream = io.StringIO()
    setup_logging("text", "INFO", stream=stream)

    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("sidecar.pipeline.ingest").error(
            "dead-lettered", exc_info=True, extra={"subscription": "orders", "data": "SECRET-PAYLOAD"}
        )

    text = stream.getvalue()
    first_line = text.splitlines()[0]
    assert "ERROR" in first_line
    assert "sidecar.pipeline.ingest: dead-lettered [subscription=orders]" in first_line
    assert "ValueError: bad" in text
    assert "SECRET-PAYLOAD" not in text


def test_text_goes_to_stderr_and_json_to_stdout(restore_root_logger: None, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("text", "INFO")
    logging.getLogger("t").info("to stderr")
    setup_logging("json", "INFO")
    logging.getLogger("t").info("to stdout")

    captured = capsys.readouterr()
    assert "to stderr" in captured.err and "to stderr" not in captured.out
    assert json.loads(captured.out.strip())["message"] == "to stdout"


@pytest.mark.parametrize(
    ("levelno", "name"),
    [(5, "DEBUG"), (10, "DEBUG"), (20, "INFO"), (25, "INFO"), (30, "WARNING"), (40, "ERROR"), (50, "CRITICAL")],
)
def test_severity_names(levelno: int, name: str) -> None:
    assert severity(levelno) == name


def test_bad_format_or_level_is_a_clear_error(restore_root_logger: None) -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        setup_logging("xml", "INFO")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        parse_level("LOUD")
    assert parse_level("warn") == logging.WARNING
    assert parse_level("15") == 15


@pytest.fixture
def restore_hooks() -> Iterator[None]:
    google = logging.getLogger("google")
    saved = (threading.excepthook, google.propagate, google.level)
    # pytest restores warnings.showwarning after every test, while logging still believes it
    # captures warnings from an earlier setup_logging: start from a clean state.
    logging.captureWarnings(False)
    yield
    threading.excepthook, google.propagate, _ = saved
    google.setLevel(saved[2])
    logging.captureWarnings(False)


def test_google_libraries_threads_and_warnings_log_json_lines(
    restore_root_logger: None, restore_hooks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    setup_logging("json", "INFO", stream=stream)
    # What building the first Google client does: google-api-core cuts "google" off from the root
    # unless it is configured (here it is, so its warnings still reach the JSON handler).
    monkeypatch.setattr(client_logging, "_LOGGING_INITIALIZED", False)
    client_logging.initialize_logging()
    assert logging.getLogger("google").propagate

    logging.getLogger("google.api_core.bidi").warning("Background thread did not exit.")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("an old api", DeprecationWarning, stacklevel=1)

    def fail() -> None:
        raise ValueError("Cannot invoke RPC: Channel closed!")

    thread = threading.Thread(target=fail, name="Thread-ConsumeBidirectionalStream")
    thread.start()
    thread.join()

    entries = lines_of(stream)  # every line parses, or this raises
    assert [(e["severity"], e["logger"]) for e in entries] == [
        ("WARNING", "google.api_core.bidi"),
        ("WARNING", "py.warnings"),
        ("ERROR", "sidecar.ops.logs"),
    ]
    assert entries[0]["message"] == "Background thread did not exit."
    assert "an old api" in entries[1]["message"]
    assert entries[2]["message"] == "uncaught exception in Thread-ConsumeBidirectionalStream"
    assert "ValueError: Cannot invoke RPC: Channel closed!" in entries[2]["stack_trace"]
