"""The application's `oauth_cb`, as every client of a producer calls it.

An `oauth_cb` that raises is a token that cannot be had (the token service is down, its
credentials were revoked): librdkafka gets a token failure (confluent-kafka turns the exception
into one), the brokers refuse the client once its token has expired, and the producer's circuit
opens as for a token the broker rejects. What the callback raised is kept, its class alone, so
that the circuit's line names it: an exception's text may carry what the token service answered,
and is never logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class TokenSource:
    """Calls the application's `oauth_cb` and keeps when it last raised, and what.

    Picklable when `fn` is (a drain process gets it with its settings).
    """

    __slots__ = ("fn", "failed")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        #: (time.monotonic(), the exception's class name) of the latest call, if it raised.
        self.failed: tuple[float, str] | None = None

    def __call__(self, oauthbearer_config: Any) -> Any:
        try:
            token = self.fn(oauthbearer_config)
        except Exception as exc:
            self.failed = (time.monotonic(), type(exc).__name__)
            raise
        self.failed = None
        return token

    def failed_within(self, seconds: float) -> str | None:
        """What the callback raised, if its latest call raised less than `seconds` ago."""
        failed = self.failed
        return failed[1] if failed is not None and time.monotonic() - failed[0] < seconds else None

    def __getstate__(self) -> tuple[Callable[[Any], Any], None]:
        return self.fn, None

    def __setstate__(self, state: tuple[Callable[[Any], Any], None]) -> None:
        self.fn, self.failed = state
