"""A Spark send task's messages (`spark_drain.batches`) against the SDK's own re-sends: pure logic
on a real SQLite outbox's rows, read as Spark's JDBC reader hands them to `explode_batches`."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from outbox.drain.sendloop import resend
from outbox.drain.settle import DELIVERED, Decision, Verdict
from outbox.errors import DecryptionError
from outbox.records import NewMessage
from outbox.stores import open_outbox
from outbox.stores.claimed import Resend
from outbox.stores.encryption import Key, KeyRing
from outbox.stores.sqlite import SQLiteOutbox
from spark_drain import send
from spark_drain.batches import BulkMessage, MessageChunk, chunks, explode_batches

from ..resend_cases import odd_messages

NOW = 1_000_000.0
STAMP = 1_795_634_888_790
#: `BulkRead.rows`' columns, as the job's JDBC read names them.
COLUMNS = ("id", "msg_id", "topic", "key", "value", "headers", "part", "attempts", "first_failed_at", "last_error",
           "timestamp", "n", "body", "enc_key")


def stored(path: Path, ring: KeyRing | None = None) -> tuple[list[pa.RecordBatch], list[Resend]]:
    """A group of common messages (the `outbox-id` header alone; some with a "not sent" error
    text), single rows off the common path, and a group of such messages, encrypted with `ring`
    when given; (the rows as the job reads them, the SDK's re-sends)."""
    common = [
        NewMessage("t", b"c-%d" % i, b"k%d" % (i % 3) if i % 4 else None,
                   [("outbox-id", b"c-%d" % i)] if i != 6 else [("app", b"x"), ("outbox-id", b"c-6")], i % 3 - 1,
                   f"c-{i}", 0, None, "_TRANSPORT (-195): down" if i % 2 else None, 0.0, None, None, STAMP + i)
        for i in range(20)
    ]  # one of them with a header of its own
    # Off the common path; five of them, so that the chunk sizes below come out as 45 messages.
    odd = odd_messages(NOW, STAMP)[:5]
    url = f"sqlite:///{path}"
    with open_outbox(url, encryption=ring) as store:
        assert isinstance(store, SQLiteOutbox)
        store.enqueue(common)  # one group row
        store.enqueue(odd)  # too few for a group: one row each
        store.enqueue([m._replace(msg_id=f"g{j}-{m.msg_id}") for j in range(4) for m in odd])  # a group of them
        sql = store.bulk_read().rows("status = 0", 0, 10**9)
        with store._snapshot() as c:
            rows = c.execute(sql).fetchall()
        expected = [resend(m) for m in store.claim("w", 100, 60.0, now=NOW + 10)]
    assert len(rows) == 1 + len(odd) + 1 and len(expected) == len(common) + 5 * len(odd)
    return [pa.RecordBatch.from_pydict(dict(zip(COLUMNS, map(list, zip(*rows, strict=True)), strict=True)))], expected


def in_id_order(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """What the job's `sortWithinPartitions("id")` does to the exploded messages."""
    out: list[pa.RecordBatch] = pa.Table.from_batches(batches).sort_by("id").to_batches()
    return out


def test_a_send_tasks_resends_are_the_sdks_re_sends_of_the_same_rows(tmp_path: Path) -> None:
    read, expected = stored(tmp_path / "outbox.db")
    messages = in_id_order(list(explode_batches(None, iter(read))))
    got = [r for chunk in chunks(iter(messages), 7) for r in chunk.resends(resend)]
    assert got == expected
    assert got[0] == ("t", b"c-0", None, -1, STAMP, [("outbox-id", b"c-0"), ("outbox-attempt", b"1")])
    assert got[1][5] == [
        ("outbox-id", b"c-1"), ("outbox-attempt", b"1"), ("outbox-last-error", b"_TRANSPORT (-195): down"),
    ]
    assert got[6][5] == [("app", b"x"), ("outbox-id", b"c-6"), ("outbox-attempt", b"1")]


def test_a_chunks_messages_read_one_by_one_are_re_sent_the_same(tmp_path: Path) -> None:
    read, expected = stored(tmp_path / "outbox.db")
    parts = list(chunks(iter(in_id_order(list(explode_batches(None, iter(read))))), 10))
    assert [len(p) for p in parts] == [10, 10, 10, 10, 5]
    assert [resend(m) for p in parts for m in p] == expected
    first = parts[0]
    assert first[0].headers == [("outbox-id", b"c-0")] and first[0].timestamp == STAMP
    assert first.groups.tolist() == [first.ids()[0] - 1] * 10 and first.sizes.tolist() == [20] * 10
    singles, group = parts[2].ids()[:5], parts[2].ids()[5:]
    assert parts[2].sizes.tolist() == [1] * 5 + [20] * 5
    assert parts[2].groups.tolist() == singles + [group[0] - 1] * 5


def test_messages_left_out_of_a_chunk_keep_the_others_in_order(tmp_path: Path) -> None:
    read, expected = stored(tmp_path / "outbox.db")
    chunk = MessageChunk.of(in_id_order(list(explode_batches(None, iter(read))))[0])
    kept = chunk.only([i % 2 == 0 for i in range(len(chunk))])
    assert list(kept.resends(resend)) == expected[::2]
    assert kept.ids() == chunk.ids()[::2] and kept.id_array.tolist() == kept.ids()
    assert kept.part(1, 3).ids() == kept.ids()[1:3]


def test_a_message_held_back_by_an_earlier_one_of_its_key_elsewhere_is_left_out(tmp_path: Path) -> None:
    read, expected = stored(tmp_path / "outbox.db")
    messages = in_id_order(list(explode_batches(None, iter(read))))
    first_k1 = next(m for m in MessageChunk.of(messages[0]) if m.key == b"k1")
    blockers = {("t", b"k1"): first_k1.id - 1}  # an earlier k1 message, not selected
    got = [m for chunk in chunks(iter(messages), 100, blockers) for m in chunk]
    assert [m.key for m in got].count(b"k1") == 0
    assert len(got) == len(expected) - sum(1 for r in expected if r[2] == b"k1")


def test_an_encrypted_outbox_s_rows_are_opened_on_the_executors_and_re_sent_as_the_sdk_does(tmp_path: Path) -> None:
    """Groups opened where they are exploded, one-message rows (still sealed through the shuffle)
    opened by the send task: the same re-sends as the SDK's claim from the encrypted store."""
    old, new = Key(os.urandom(32)), Key(os.urandom(32))
    read, expected = stored(tmp_path / "outbox.db", KeyRing([old]))
    assert set(read[0].column("enc_key").to_pylist()) == {old.id}
    ring = KeyRing([new, old])
    messages = in_id_order(list(explode_batches(ring, iter(read))))
    kids = pa.Table.from_batches(messages).column("enc_key").to_pylist()
    assert kids.count(old.id) == 5 and kids.count(None) == len(expected) - 5  # the singles cross the shuffle sealed
    got = [r for chunk in chunks(iter(messages), 7, ring=ring) for r in chunk.resends(resend)]
    assert got == expected

    with pytest.raises(DecryptionError, match=rf"messages \d+ to \d+ \(topic \S+\): encrypted with key {old.id}"):
        list(explode_batches(KeyRing([new]), iter(read)))
    with pytest.raises(DecryptionError, match=f"message .* key {old.id}, but no encryption key"):
        list(chunks(iter(messages), 7))


def test_an_export_holds_each_message_as_stored_and_a_sealed_groups_messages_sealed_again(tmp_path: Path) -> None:
    """`spark_drain.archive.archive_batches` over an encrypted outbox's rows: one-message rows
    exactly as stored (sealed with their old key), a group's messages sealed each with the newest
    key; opened, every message is what the store itself reads, headers in full."""
    from outbox.stores import sealed
    from outbox.stores.codec import decode_headers
    from spark_drain.archive import EXTRA, archive_batches

    old, new = Key(os.urandom(32)), Key(os.urandom(32))
    odd = odd_messages(NOW, STAMP)[:5]
    common = [NewMessage("t", b"c-%d" % i, b"k", [("outbox-id", b"c-%d" % i)], msg_id=f"c-{i}") for i in range(20)]
    with open_outbox(f"sqlite:///{tmp_path / 'outbox.db'}", encryption=KeyRing([old])) as store:
        assert isinstance(store, SQLiteOutbox)
        store.enqueue(common)  # one group row
        store.enqueue(odd)  # one row each
        sql = store.bulk_read().rows("status = 0", 0, 10**9, tuple(EXTRA))
        with store._snapshot() as c:
            cur = c.execute(sql)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        claimed = store.claim("w", 100, 60.0, now=NOW + 10)
    raw = {r[0]: r for r in rows}
    batch = pa.RecordBatch.from_pydict(dict(zip(names, map(list, zip(*rows, strict=True)), strict=True)))

    got = pa.Table.from_batches(list(archive_batches(KeyRing([new, old]), iter([batch])))).sort_by("id").to_pylist()

    assert [g["id"] for g in got] == [m.id for m in claimed]
    for g, m in zip(got, claimed, strict=True):
        assert (g["status"], g["topic"], g["key"], g["timestamp"]) == ("pending", m.topic, m.key, m.timestamp)
        if m.id in raw and raw[m.id][names.index("n")] == 1:  # a one-message row: as stored
            assert g["enc_key"] == old.id
            assert (g["value"], g["headers"]) == (raw[m.id][4], raw[m.id][5])
        else:
            assert g["enc_key"] == new.id and m.value not in (g["value"] or b"")
        value, headers = sealed.open_payload(g["enc_key"], g["id"], g["msg_id"], g["value"], g["headers"],
                                             KeyRing([new, old]))
        assert (value, decode_headers(headers)) == (m.value, list(m.headers))


class ScriptedLoop:
    """A send loop whose sends end as `fates` says (by value; delivered otherwise), recording what
    it was given: the send task's rule for a key's later rows is pure logic over these fates."""

    fates: dict[bytes, Decision] = {}
    sent: list[bytes] = []

    def __init__(self, config: object, policy: object) -> None:
        pass

    def start(self, chunk: MessageChunk) -> MessageChunk:
        ScriptedLoop.sent += [m.value or b"" for m in chunk]
        return chunk

    def wait(self, batch: MessageChunk) -> bool:
        return not any(m.value in self.fates for m in batch)

    def decide(self, batch: MessageChunk, now_fn: object) -> list[tuple[BulkMessage, Decision]]:
        return [(m, self.fates.get(m.value or b"", DELIVERED)) for m in batch]

    def close(self, timeout: float) -> int:
        return 0


@pytest.mark.parametrize(
    "fate",
    [
        Decision(Verdict.RELEASE, error="_TRANSPORT (-195): no broker answered"),
        Decision(Verdict.RESCHEDULE, at=NOW + 60, code=-195, name="_TRANSPORT", error="_TRANSPORT (-195): down"),
    ],
    ids=["given-back", "rescheduled"],
)
def test_a_keys_later_messages_wait_behind_one_that_stays_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fate: Decision
) -> None:
    url = f"sqlite:///{tmp_path}/o.db"
    with open_outbox(url) as store:
        store.enqueue([NewMessage("t", v, k, [("outbox-id", v)], -1, v.decode(), 0, None, None, 0.0, None, None, STAMP)
                       for k, v in [(b"k", b"k:1"), (b"j", b"j:1"), (b"k", b"k:2"), (b"j", b"j:2")]])
        assert isinstance(store, SQLiteOutbox)
        with store._snapshot() as c:
            rows = c.execute(store.bulk_read().rows("status = 0", 0, 10**9)).fetchall()
    batches = [pa.RecordBatch.from_pydict(dict(zip(COLUMNS, map(list, zip(*rows, strict=True)), strict=True)))]
    monkeypatch.setattr(send, "SendLoop", ScriptedLoop)
    monkeypatch.setattr(ScriptedLoop, "fates", {b"k:1": fate})
    monkeypatch.setattr(ScriptedLoop, "sent", [])
    sender = send.PartitionSender(send.SendConfig(url, {}))
    sender.run(chunks(iter(in_id_order(list(explode_batches(None, iter(batches))))), 1))
    # k:1 stays pending: k:2 is not sent after it (it would reach Kafka first once k:1 is re-sent).
    assert ScriptedLoop.sent == [b"k:1", b"j:1", b"j:2"]
    with open_outbox(url) as store:
        assert sorted(m.value or b"" for m in store.claim("w", 10, 60.0, now=time.time() + 3600)) == [b"k:1", b"k:2"]


def _view_batch(stored: list[bytes]) -> pa.RecordBatch:
    n = len(stored)
    return pa.RecordBatch.from_pydict({
        "id": pa.array(range(1, n + 1), pa.int64()), "msg_id": [f"m{i}" for i in range(n)], "topic": ["t"] * n,
        "key": [b"k"] * n, "value": [b"v"] * n, "headers": pa.array(stored, pa.binary()),
        "part": pa.array([None] * n, pa.int32()), "attempts": pa.array([0] * n, pa.int32()),
        "first_failed_at": pa.array([None] * n, pa.float64()), "last_error": pa.array([None] * n, pa.string()),
        "timestamp": pa.array([5] * n, pa.int64()),
    })


def test_a_transform_sees_the_common_messages_headers_as_it_sees_any_others() -> None:
    """Messages stored with the `outbox-id` header alone get it built as columns: the same view
    (`headers`, `header`) as the same header stored encoded; and a transform that leaves the
    headers out of its output sends them as stored."""
    from outbox.stores.codec import encode_headers
    from spark_drain.transform import decode_batches, finish_batches

    alone = next(decode_batches(None, True, None, iter([_view_batch([b"", b""])])))
    encoded = next(decode_batches(
        None, True, None, iter([_view_batch([encode_headers([("outbox-id", b"m0")]) or b"", b""])])
    ))
    for name in ("headers", "header"):
        assert alone.column(name).to_pylist() == encoded.column(name).to_pylist()
        assert alone.schema.field(name).type == encoded.schema.field(name).type
    assert alone.column("headers").to_pylist()[1] == [{"key": "outbox-id", "value": b"m1"}]
    (out,) = finish_batches("tests.unit.test_spark_batches:_exclaim", False, True, iter([alone]))
    assert out.column("value").to_pylist() == [b"v!", b"v!"]
    assert out.column("headers").to_pylist() == [b"", b""]  # stored as they were: the id alone


def _exclaim(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for b in batches:
        yield pa.RecordBatch.from_arrays(
            [b.column("id"), pa.array([v + b"!" for v in b.column("value").to_pylist()])], names=["id", "value"]
        )
