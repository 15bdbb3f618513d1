"""The debug log's rate limits: per tag, and once per key, with state that tests can reset."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from nsa_core.debug_log import debug_log_once, reset_log_state
from nsa_core.toggles import toggles_overridden


@pytest.fixture(autouse=True)
def fresh_log_state() -> Iterator[None]:
    reset_log_state()
    yield
    reset_log_state()


def logged(caplog: pytest.LogCaptureFixture, tag: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(tag + " ")]


def test_a_once_line_logs_once_per_key_while_the_log_is_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with toggles_overridden(debug_log=True), caplog.at_level(logging.INFO, logger="nsa"):
        debug_log_once("dev:0", "dev.line", device=0)
        debug_log_once("dev:0", "dev.line", device=0)
        debug_log_once("dev:1", "dev.line", device=1)
    assert logged(caplog, "dev.line") == ["dev.line device=0", "dev.line device=1"]


def test_a_call_with_the_log_off_does_not_use_up_the_key(caplog: pytest.LogCaptureFixture) -> None:
    """The order-dependent failure this guards against: an earlier caller with the log off
    marked the device as logged, and a later test with the log on never saw its line."""
    with toggles_overridden(debug_log=False), caplog.at_level(logging.INFO, logger="nsa"):
        debug_log_once("dev:0", "dev.line", device=0)
    assert logged(caplog, "dev.line") == []
    with toggles_overridden(debug_log=True), caplog.at_level(logging.INFO, logger="nsa"):
        debug_log_once("dev:0", "dev.line", device=0)
    assert logged(caplog, "dev.line") == ["dev.line device=0"]


def test_reset_forgets_the_keys(caplog: pytest.LogCaptureFixture) -> None:
    with toggles_overridden(debug_log=True), caplog.at_level(logging.INFO, logger="nsa"):
        debug_log_once("dev:0", "dev.line", device=0)
        reset_log_state()
        debug_log_once("dev:0", "dev.line", device=0)
    assert len(logged(caplog, "dev.line")) == 2
