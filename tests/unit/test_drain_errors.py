"""Where a drain worker's error is reported: once, by whoever hears of it. No Kafka needed (the
claim fails before anything is sent)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from outbox import Drainer
from outbox.records import NewMessage
from outbox.stores import MemoryOutbox


class ClaimFails(MemoryOutbox):
    def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the claim broke")


def failed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("outbox")]


@pytest.mark.parametrize("workers", [1, 3])
def test_a_run_raises_its_workers_error_and_logs_only_what_the_caller_cannot_hear(
    workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    store = ClaimFails()
    store.enqueue([NewMessage("t", b"v", b"k")])
    drainer = Drainer(store, {"bootstrap.servers": "127.0.0.1:1"}, workers=workers)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="the claim broke"):
        drainer.run(until_empty=True)
    lines = failed_lines(caplog)
    # The caller's own worker: raised, not logged. Each other thread's: logged once, where it ends.
    assert len(lines) == workers - 1, lines
    assert all(line.endswith("failed; the rows it holds come back when their lease ends") for line in lines)
    assert not any("could not settle" in line for line in lines)  # a failed claim is raised once
