"""The producer's and the drain's locks, and the one order in which a thread may hold them.

Every lock of `outbox.producer` and `outbox.drain` is made here, by name. A thread that holds
some of them takes another only if it comes later in `ORDER`: two threads can then never wait
for each other. `docs/DESIGN.md` ("Threads and locks") says which thread takes which.

The order is checked, not trusted: with ``OUTBOX_CHECK_LOCK_ORDER=1`` in the environment when
this module is first imported (the test suite sets it), each lock is a checked one, and taking
a lock out of order raises `LockOrderError` in the thread that did, naming both locks. Without
it a lock is the plain `threading` one: nothing is added to any call.
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: Outermost first: a thread holding one of these takes only those after it.
ORDER: tuple[str, ...] = (
    # KeyBacklog: which keys queue behind the outbox; held while it ends a key's gate, sending
    # the key's held messages (a refused send is settled, which may count toward the circuit).
    "key backlog",
    # CircuitBreaker; held while its opening starts the hold-back or arms the send fence, and
    # while it tells the process's refusals.
    "circuit",
    "refusals",  # Refusals: the circuits open for one refusal of the credentials
    "hold-back",  # Holdback: what waits while librdkafka hands messages back
    "send fence",  # SendFence: keyed first sends in librdkafka
    "write-ahead",  # WriteAhead: a batch's rows in flight
    "writer",  # GroupCommitWriter: the rows queued for the next commit
    "drain",  # Drainer: its counts, limits and claim timings
    "drain progress",  # Drainer: settled batches, for workers waiting on them
    "drain process",  # DrainProcess: its pipe to the child
    "drain process reports",  # the child's end of the pipe
    "callback errors",  # CallbackErrors
    "poll report",  # PollReport: callbacks served, errors to raise
)
_RANK = {name: i for i, name in enumerate(ORDER)}

#: A file to append each (held, taken) pair seen to, instead of checking: how `ORDER` is found
#: (``OUTBOX_LOCK_ORDER_LEARN=path``, for the project's own maintainers).
_LEARN = os.environ.get("OUTBOX_LOCK_ORDER_LEARN")
_seen: set[tuple[str, str]] = set()
CHECKED = os.environ.get("OUTBOX_CHECK_LOCK_ORDER") == "1" or bool(_LEARN)


def _learn(held: str, taken: str) -> None:
    """Learning: append a pair the first time this process sees it (a killed process keeps its own)."""
    if (held, taken) not in _seen:
        _seen.add((held, taken))
        with open(_LEARN or "", "a") as f:
            f.write(f"{held}\t{taken}\n")


class LockOrderError(RuntimeError):
    """A thread took a lock while holding one that `ORDER` puts after it."""


_held = threading.local()


def _stack() -> list[_Checked]:
    """The checked locks this thread holds, in the order it took them."""
    stack: list[_Checked] | None = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


class _Checked:
    """A lock that checks `ORDER` when it is taken (``OUTBOX_CHECK_LOCK_ORDER=1``)."""

    def __init__(self, name: str, lock: Any, reentrant: bool) -> None:
        if name not in _RANK:
            raise ValueError(f"lock {name!r} is not in outbox.lockorder.ORDER")
        self.name = name
        self._rank = _RANK[name]
        self._lock = lock
        self._reentrant = reentrant

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        stack = _stack()
        if not (self._reentrant and self in stack):
            for held in stack:
                if _LEARN:
                    _learn(held.name, self.name)
                elif held._rank >= self._rank:
                    raise LockOrderError(
                        f"lock {self.name!r} taken while holding {held.name!r}; the order is "
                        f"{' -> '.join(ORDER)} (outbox.lockorder)"
                    )
        got: bool = self._lock.acquire(blocking, timeout)
        if got:
            stack.append(self)
        return got

    def release(self) -> None:
        self._lock.release()
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):  # its latest taking
            if stack[i] is self:
                del stack[i]
                break

    def _is_owned(self) -> bool:  # what threading.Condition asks of its lock
        return self in _stack()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def new_lock(name: str) -> Any:
    """A `threading.Lock` named `name` (of `ORDER`); checked under ``OUTBOX_CHECK_LOCK_ORDER=1``."""
    return _Checked(name, threading.Lock(), False) if CHECKED else threading.Lock()


def new_rlock(name: str) -> Any:
    """A `threading.RLock` named `name` (of `ORDER`); checked under ``OUTBOX_CHECK_LOCK_ORDER=1``."""
    return _Checked(name, threading.RLock(), True) if CHECKED else threading.RLock()


def new_condition(name: str, lock: Any = None) -> threading.Condition:
    """A `threading.Condition` on `lock` (one of `new_lock`'s), or on an RLock named `name`."""
    return threading.Condition(lock if lock is not None else new_rlock(name))
