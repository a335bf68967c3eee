"""The application's client callbacks on the re-senders: a raise is counted, never fatal."""

from __future__ import annotations

import logging

import pytest

from outbox.drain.callbacks import CallbackErrors, guarded


def boom(*args: object) -> None:
    raise RuntimeError("bug in the application's callback")


def test_a_raising_callback_is_counted_logged_once_and_returns(caplog: pytest.LogCaptureFixture) -> None:
    errors = CallbackErrors()
    config = guarded({"stats_cb": boom, "error_cb": boom, "bootstrap.servers": "x"}, errors, client="a test client")
    with caplog.at_level(logging.ERROR, logger="outbox"):
        for _ in range(3):
            assert config["stats_cb"]("{}") is None
        config["error_cb"](None)
    assert errors.count == 4
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 2  # one per callback: the repeats are counted, not logged again
    assert "stats_cb raised on a test client" in lines[0]
    assert config["bootstrap.servers"] == "x"


def test_a_raising_oauth_cb_is_raised_again_and_named_by_its_class_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A token that cannot be had is an outage the circuit names: not a callback error, no text logged."""
    errors = CallbackErrors()
    config = guarded({"oauth_cb": boom}, errors, client="a test client")
    with caplog.at_level(logging.DEBUG, logger="outbox"), pytest.raises(RuntimeError):
        config["oauth_cb"]("")
    assert errors.count == 0
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records] == [
        (logging.DEBUG, "outbox: the application's oauth_cb raised RuntimeError on a test client", None)
    ]


def test_a_callback_that_works_is_called_with_its_arguments() -> None:
    seen: list[tuple[object, ...]] = []
    config = guarded({"throttle_cb": lambda *a: seen.append(a) or "ok"}, CallbackErrors(), client="c")
    assert config["throttle_cb"]("event") == "ok"
    assert seen == [("event",)]
