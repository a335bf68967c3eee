"""When the process ends, commit what open producers still hold in memory; after a fork, disown them.

A script that produces and returns without `close()` is the most common shape of a Python job.
Every thread of a producer is a daemon thread, so without this hook whatever was still in
librdkafka's queue, in the hold-back or waiting for the writer's commit died with the process.

One registry serves every producer: `remember` at start, `forget` once a close has finished.
Producers are kept in a `weakref.WeakSet`, so the registry never keeps one alive. `close_all`
closes each producer still open with its own `exit_timeout` (`ResilientProducer.close` gives
delivery the first share of it and committing to the outbox the rest), one after the other:
Python refuses new threads once it is shutting down. A producer whose close another thread had
begun is waited for, not skipped: the process must not end under it. It runs:

- at interpreter exit (`atexit`): handlers run after the interpreter has joined the non-daemon
  threads but before it stops the daemon ones, so the delivery thread and the writer still serve
  `close()` here;
- at SIGTERM (`outbox.producer.sigterm`), before the process ends as the signal's default action
  would.

While it runs, `stopping` is true: a `produce()` that another thread calls meanwhile waits for
the end of the process instead of handing a message to a producer being closed (it would be
accepted and then lost), and `close_all` first waits for the calls already under way.

After `os.fork()` the child has none of the parent's threads, librdkafka's included. The child's
copy of every producer is disowned (`Closable.disown`): it is closed in the child without
touching what it shares with the parent (its outbox connection, its drain process), and its
next call raises `ProducerForkedError`, which names the fix. Nothing is accepted in the child and
then lost, and the parent's messages stay the parent's.

Nothing runs after a `kill -9`: that is write-ahead mode's job (every message committed before
`produce()` returns with durability "sync"; within a bounded window with "batch").
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Protocol

log = logging.getLogger("outbox")

#: How long `close_all` waits for `produce()` calls under way on other threads to return.
IN_FLIGHT_WAIT = 2.0


class Closable(Protocol):
    """What the hook needs of a producer."""

    def close_at_exit(self) -> None: ...

    def stop_producing(self) -> None: ...

    def disown(self, parent_pid: int) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
#: True while `close_all` runs: producers refuse new messages (`park`).
stopping = False
#: The code objects of the calls that accept a message (`ResilientProducer.produce`), to find
#: the threads still inside one (`_in_flight`). Empty in the compiled build, whose functions
#: have no frames: there the wait is skipped.
_accepting: set[CodeType] = set()


def remember(producer: Closable) -> None:
    """Close `producer` when the process ends unless it was closed or collected before."""
    _open.add(producer)


def forget(producer: Closable) -> None:
    """`producer` was closed: the end of the process has nothing to do for it."""
    _open.discard(producer)


def accepting(function: Callable[..., object]) -> None:
    """`function` accepts messages: `close_all` waits for the calls of it under way."""
    code = getattr(function, "__code__", None)
    if isinstance(code, CodeType):
        _accepting.add(code)


def close_all() -> None:
    """Close every open producer within its `exit_timeout` (the `atexit` handler, and SIGTERM's)."""
    global stopping
    stopping = True
    try:
        producers = list(_open)
        for producer in producers:
            producer.stop_producing()
        _wait_for_calls_in_flight()
        for producer in producers:
            try:
                producer.close_at_exit()
            except Exception:  # one producer's failure must not cost the others their messages
                log.exception("outbox: closing a producer at exit failed")
            _open.discard(producer)
    finally:
        stopping = False  # the producers are closed: each call now says so itself


def park() -> None:
    """A `produce()` while the process stops: the thread waits for the end instead of returning.

    The main thread is never parked: it is the one ending the process (an `atexit` handler of
    the application may still call `produce()`, and must hear the producer is closed).
    """
    if threading.current_thread() is threading.main_thread():
        return
    while True:
        time.sleep(3600)


def _wait_for_calls_in_flight() -> None:
    """Wait (a bounded time) until no other thread is inside a call that accepts a message."""
    if not _accepting:
        return
    deadline = time.monotonic() + IN_FLIGHT_WAIT
    while _in_flight() and time.monotonic() < deadline:
        time.sleep(0.001)


def _in_flight() -> bool:
    me = threading.get_ident()
    park_code = park.__code__
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        f: FrameType | None = frame
        while f is not None:
            if f.f_code is park_code:
                break
            if f.f_code in _accepting:
                return True
            f = f.f_back
    return False


def _disown_after_fork() -> None:
    """In the child of a fork: every producer of the parent is the parent's alone."""
    parent = os.getppid()
    for producer in list(_open):
        producer.disown(parent)
    _open.clear()


atexit.register(close_all)
os.register_at_fork(after_in_child=_disown_after_fork)
