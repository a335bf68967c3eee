"""Waiting for an outcome in the tests: poll a condition until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    cond: Callable[[], bool], timeout: float, what: str, *, every: float = 0.2,
    check: Callable[[], None] | None = None,
) -> None:
    """Return once `cond()` is true; fail the test naming `what` after `timeout` seconds.

    `check`, when given, runs before each try and may raise to fail the wait early (a background
    loop that died will never make `cond` true).
    """
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        if cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        time.sleep(every)
