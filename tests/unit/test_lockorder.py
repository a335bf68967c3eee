"""The one lock order of the producer and the drain (`outbox.lockorder`), as the tests check it."""

from __future__ import annotations

import threading

import pytest

from outbox import lockorder
from outbox.lockorder import LockOrderError, new_condition, new_lock, new_rlock


def test_the_test_suite_checks_the_order() -> None:
    assert lockorder.CHECKED


def test_a_lock_taken_while_holding_a_later_one_raises_naming_both() -> None:
    backlog, writer = new_lock("key backlog"), new_lock("writer")
    with writer, pytest.raises(LockOrderError, match="lock 'key backlog' taken while holding 'writer'"):
        backlog.acquire()
    assert backlog.acquire(blocking=False)  # the refused one was not taken
    backlog.release()
    with backlog, writer:  # in order
        pass


def test_two_locks_of_one_name_are_not_nested() -> None:
    a, b = new_lock("writer"), new_lock("writer")
    with a, pytest.raises(LockOrderError, match="'writer' taken while holding 'writer'"):
        b.acquire()


def test_a_reentrant_lock_is_taken_again_and_released_in_turn() -> None:
    backlog, fence = new_rlock("key backlog"), new_lock("send fence")
    with backlog:
        with backlog, fence:
            pass
        with fence:  # still held once: what comes after it may be taken
            pass
    with fence, pytest.raises(LockOrderError):
        backlog.acquire()


def test_each_thread_has_its_own_held_locks() -> None:
    writer, backlog = new_lock("writer"), new_lock("key backlog")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with backlog:  # this thread holds nothing
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    with writer:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert errors == []


def test_a_condition_waits_and_is_notified_on_a_checked_lock() -> None:
    lock = new_lock("writer")
    cond = new_condition("writer", lock)
    ready: list[int] = []

    def notify() -> None:
        with cond:
            ready.append(1)
            cond.notify()

    with cond:
        threading.Thread(target=notify).start()
        assert cond.wait_for(lambda: ready, timeout=10)
    own = new_condition("poll report")  # on a checked RLock of its own
    with own:
        assert not own.wait(0.01)


def test_a_name_outside_the_order_is_refused() -> None:
    with pytest.raises(ValueError, match="lock 'nope' is not in outbox.lockorder.ORDER"):
        new_lock("nope")
