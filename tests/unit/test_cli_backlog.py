"""`outbox status` says what is left and why, and lists leases by owner.

A real SQLite outbox holds one row in each state, with fixed times in 2100 so that the output
is exact; the gone owner is a real process of this host that has exited.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox
from outbox.stores.owners import describe_owner, new_owner

T_BACKOFF = 4102444800.0  # 2100-01-01 00:00:00Z
T_GONE = T_BACKOFF + 3600
T_ALIVE = T_BACKOFF + 7200


def exited_owner() -> str:
    """The owner name of a process of this host that has exited (and was reaped)."""
    out = subprocess.run(
        [sys.executable, "-c", "from outbox.stores.owners import new_owner; print(new_owner('producer'))"],
        capture_output=True, text=True, check=True,
    )
    return out.stdout.strip()


def msg(topic: str, key: bytes | None, i: int, **kw: float) -> NewMessage:
    return NewMessage(topic=topic, value=b"v%d" % i, key=key, msg_id=f"m{i}", **kw)  # type: ignore[arg-type]


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    path = str(tmp_path / "o.db")
    gone, alive = exited_owner(), new_owner("drain")
    store = SQLiteOutbox(path)
    store.enqueue([msg("orders", b"a", 1)], lease_owner=gone, lease_until=T_GONE)
    store.enqueue([msg("orders", b"a", 2), msg("orders", b"a", 3)])  # wait behind the gone owner
    store.enqueue([msg("orders", b"b", 4)], lease_owner=alive, lease_until=T_ALIVE)
    store.enqueue([msg("orders", b"b", 5)])  # waits behind the live owner
    store.enqueue([msg("pay", b"c", 6, next_attempt_at=T_BACKOFF)])  # backing off
    store.enqueue([msg("pay", b"c", 7), msg("pay", b"d", 8), msg("pay", None, 9)])
    store.add_dead([msg("pay", None, 10)], failed_at=T_BACKOFF)
    store.close()
    yield path, gone, alive


def status(*args: str) -> str:
    result = CliRunner().invoke(cli, ["status", *args], env={"OUTBOX_URL": ""}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_status_text_says_what_is_left_and_lists_leases(outbox: tuple[str, str, str]) -> None:
    path, gone, alive = outbox
    out = status("--outbox", path)
    g, a = describe_owner(gone), describe_owner(alive)
    w = max(len(g), len(a), len("OWNER"))
    assert "pending         9 (2 leased now)\n" in out
    assert "next due        now\n" in out  # row 8, 9 are due; so are the gone owner's rows
    section = out[out.index("what is left:") : out.index("pending by topic:")]
    assert section == (
        "what is left:\n"
        "  2 due now\n"
        "  1 backing off until 2100-01-01 00:00:00Z\n"
        f"  1 leased by {g} (gone: the next drain takes its rows at once) until 2100-01-01 01:00:00Z\n"
        f"  2 waiting behind 1 row(s) of their key leased by {g} until 2100-01-01 01:00:00Z\n"
        f"  1 leased by {a} (alive) until 2100-01-01 02:00:00Z\n"
        f"  1 waiting behind 1 row(s) of their key leased by {a} until 2100-01-01 02:00:00Z\n"
        "  1 waiting behind rows of their key backing off until 2100-01-01 00:00:00Z\n"
        "  1 dead-lettered (see: outbox dlq list)\n"
        "\n"
        "leases by owner:\n"
        f"  {'OWNER'.ljust(w)}  STATE  LEASED  WAITING  UNTIL\n"
        f"  {g.ljust(w)}  gone   1       2        2100-01-01 01:00:00Z\n"
        f"  {a.ljust(w)}  alive  1       1        2100-01-01 02:00:00Z\n"
        "\n"
    )


def test_status_json_says_what_is_left(outbox: tuple[str, str, str]) -> None:
    path, gone, alive = outbox
    doc = json.loads(status("--outbox", path, "--json"))
    assert doc["next_due_in_seconds"] == 0
    assert doc["backlog"] == {
        "due_now": 2,
        "backing_off": 1,
        "backing_off_until": {"first": "2100-01-01T00:00:00.000Z", "last": "2100-01-01T00:00:00.000Z"},
        "waiting_behind_backoff": 1,
        "waiting_behind_backoff_until": "2100-01-01T00:00:00.000Z",
        "leases": [
            {"owner": gone, "name": describe_owner(gone), "state": "gone", "leased": 1, "waiting": 2,
             "until": "2100-01-01T01:00:00.000Z"},
            {"owner": alive, "name": describe_owner(alive), "state": "alive", "leased": 1, "waiting": 1,
             "until": "2100-01-01T02:00:00.000Z"},
        ],
        "dead": 1,
    }


def test_status_next_due_is_not_now_when_every_due_row_waits_behind_a_live_lease(tmp_path: Path) -> None:
    """No "(next due: now)" while nothing can move."""
    path = str(tmp_path / "o.db")
    store = SQLiteOutbox(path)
    alive = new_owner("producer")
    store.enqueue([msg("orders", b"a", 1)], lease_owner=alive, lease_until=T_ALIVE)
    store.enqueue([msg("orders", b"a", 2)])
    store.close()
    out = status("--outbox", path)
    assert "next due        2100-01-01 02:00:00Z (in " in out
    assert "what is left:\n" f"  1 leased by {describe_owner(alive)} (alive) until 2100-01-01 02:00:00Z\n" in out
    assert json.loads(status("--outbox", path, "--json"))["next_due_at"] == "2100-01-01T02:00:00.000Z"


def test_status_of_a_foreign_owner_says_its_leases_expire(tmp_path: Path) -> None:
    path = str(tmp_path / "o.db")
    store = SQLiteOutbox(path)
    store.enqueue([msg("orders", b"a", 1)], lease_owner="worker-7", lease_until=T_ALIVE)
    store.close()
    out = status("--outbox", path)
    assert "  1 leased by worker-7 (not on this host: its leases expire) until 2100-01-01 02:00:00Z\n" in out
    assert "  worker-7  unknown  1       0        2100-01-01 02:00:00Z\n" in out
