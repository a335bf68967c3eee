"""The exit hook's registry: open producers are closed at exit, closed or collected ones cost nothing."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

from outbox import ConfigError, ResilientProducer
from outbox.producer import exithook


class Producer:
    def __init__(self, fail: bool = False) -> None:
        self.closed_at_exit = 0
        self.fail = fail

    def close_at_exit(self) -> None:
        self.closed_at_exit += 1
        if self.fail:
            raise RuntimeError("cannot close")

    def stop_producing(self) -> None:
        pass

    def disown(self, parent_pid: int) -> None:
        pass


def test_each_open_producer_is_closed_once_even_when_another_fails() -> None:
    a, b, c = Producer(fail=True), Producer(), Producer()
    for p in (a, b, c):
        exithook.remember(p)
    exithook.forget(c)  # closed by the application
    exithook.close_all()
    exithook.close_all()
    assert (a.closed_at_exit, b.closed_at_exit, c.closed_at_exit) == (1, 1, 0)


def test_the_registry_does_not_keep_a_producer_alive() -> None:
    p = Producer()
    ref = weakref.ref(p)
    exithook.remember(p)
    del p
    gc.collect()
    assert ref() is None


def test_a_closed_producer_leaves_the_registry(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    p = ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}", drain_workers=0)
    assert p in exithook._open
    p.close(5)
    assert p not in exithook._open


@pytest.mark.parametrize("timeout", [-1, float("nan"), "10"])
def test_a_bad_exit_timeout_is_a_clear_error_and_opens_nothing(timeout: object, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"exit_timeout must be a number of seconds >= 0, got "):
        ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}", exit_timeout=timeout)  # type: ignore[arg-type]
    assert not db.exists()


def test_a_script_that_returns_without_close_commits_what_it_produced(tmp_path: Path) -> None:
    """No broker at all: the circuit opens, and the exit commits every message still in memory."""
    script = textwrap.dedent(
        """
        import sys
        from outbox import ResilientProducer
        p = ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{sys.argv[1]}", drain_workers=0)
        for i in range(500):
            p.produce("orders", b"%d" % i, key=b"k%d" % (i % 5))
        """
    )
    db = tmp_path / "o.db"
    subprocess.run([sys.executable, "-c", script, str(db)], check=True, timeout=120)
    from outbox import SQLiteOutbox

    with SQLiteOutbox(str(db), create=False) as store:
        values = sorted(int(m.value or b"") for m in store.messages())
    assert values == list(range(500))
