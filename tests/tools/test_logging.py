"""Embedding hygiene: the library logs through the standard `logging` tree under `speckernel`,
never to stdout, and leaves the host application's logging and structlog set-up alone."""

from __future__ import annotations

import logging

import pytest
import structlog

from speckernel import log
from speckernel.config import EngineConfig
from speckernel.conformance import check_speculator


def test_events_go_through_logging_not_stdout(capsys: pytest.CaptureFixture[str],
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="speckernel"):
        log.get("unit").info("an_event", answer=42)
    assert capsys.readouterr().out == ""
    (record,) = [r for r in caplog.records if r.name == "speckernel.unit"]
    assert "event='an_event'" in record.getMessage() and "answer=42" in record.getMessage()


def test_configure_shows_one_handler_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger("speckernel")
    saved = (root.level, list(root.handlers), root.propagate)
    try:
        log.configure("info")
        log.configure("info")  # twice: still one handler
        log.get("unit").info("shown")
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("event='shown'") == 1
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        root.propagate = saved[2]


@pytest.mark.slow
def test_the_engine_leaves_the_hosts_structlog_alone(capsys: pytest.CaptureFixture[str]) -> None:
    before = structlog.get_config()
    check_speculator("ngram", k=2, max_tokens=4, prompts=("The sky is",))
    assert structlog.get_config() == before
    assert "engine_core_ready" not in capsys.readouterr().out
    assert EngineConfig().log_level == "warning"
