"""At interpreter exit, commit what open producers still hold in memory.

A script that produces and returns without `close()` is the most common shape of a Python job.
Every thread of a producer is a daemon thread, so without this hook whatever was still in
librdkafka's queue, in the hold-back or waiting for the writer's commit died with the process.

One `atexit` handler serves every producer. Producers are kept in a `weakref.WeakSet`: one that
was closed has left it (`forget`), one that was collected is gone from it, and the registry
never keeps a producer alive. At exit each producer still open is closed with its own
`exit_timeout` (`ResilientProducer.close` gives delivery the first share of it and committing to
the outbox the rest), one after the other: Python refuses new threads once it is shutting down.

Why this works at exit: `atexit` handlers run after the interpreter has joined the non-daemon
threads but before it stops the daemon ones, so the delivery thread and the writer still serve
`close()` here. Nothing runs after a `kill -9`: that is write-ahead mode's job (every message
committed before `produce()` returns, or within `commit_interval` in "batch" durability).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger("outbox")


class Closable(Protocol):
    """What the hook needs of a producer."""

    def close_at_exit(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def remember(producer: Closable) -> None:
    """Close `producer` at interpreter exit unless it was closed or collected before."""
    _open.add(producer)


def forget(producer: Closable) -> None:
    """`producer` was closed: the exit has nothing to do for it."""
    _open.discard(producer)


def close_all() -> None:
    """The `atexit` handler (also callable directly, e.g. from a signal handler)."""
    for producer in list(_open):
        try:
            producer.close_at_exit()
        except Exception:  # one producer's failure must not cost the others their messages
            log.exception("outbox: closing a producer at exit failed")
        _open.discard(producer)


atexit.register(close_all)
