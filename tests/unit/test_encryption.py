"""Encryption at rest: the key ring, its key sources, and a SQLite outbox that stores payloads
encrypted (real files, read back raw). Delivery through Kafka is tests/integration/test_encryption.py."""

from __future__ import annotations

import base64
import logging
import pickle
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.errors import ConfigError, DecryptionError
from outbox.records import NewMessage, Status
from outbox.stores.base import Failure, Settlement
from outbox.stores.encryption import Key, KeyRing, as_key_ring, key_id
from outbox.stores.memory import MemoryOutbox
from outbox.stores.sqlite import SQLiteOutbox

MARKER = b"CARD-4111-1111-1111-1111"
HEADER_MARKER = b"SECRET-HEADER-VALUE"
SECRET_A = bytes(range(32))
SECRET_B = bytes(range(100, 132))


def messages(n: int, *, tag: str = "m", key: bytes | None = b"k") -> list[NewMessage]:
    return [
        NewMessage("orders", MARKER + b"-" + str(i).encode(), key, [("outbox-id", f"{tag}-{i}".encode()),
                   ("card", HEADER_MARKER)], msg_id=f"{tag}-{i}", timestamp=1_700_000_000_000 + i)
        for i in range(n)
    ]


def raw_bytes(path: Path) -> bytes:
    """The file and its WAL, as bytes on disk."""
    out = path.read_bytes()
    wal = Path(str(path) + "-wal")
    return out + (wal.read_bytes() if wal.exists() else b"")


@pytest.fixture
def ring() -> KeyRing:
    return KeyRing([Key(SECRET_A)])


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "o.db"


@pytest.fixture
def store(path: Path, ring: KeyRing) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(path))
    s.set_encryption(ring)
    yield s
    s.close()


# -- keys and their sources ----------------------------------------------------------------


def test_a_key_file_may_hold_raw_bytes_hex_or_base64(tmp_path: Path) -> None:
    raw, hexed, b64, urlsafe = (tmp_path / n for n in ("raw", "hex", "b64", "url"))
    raw.write_bytes(SECRET_B)
    hexed.write_text(SECRET_B.hex() + "\n")
    b64.write_text(base64.b64encode(SECRET_B).decode())
    urlsafe.write_text(base64.urlsafe_b64encode(SECRET_B).decode())
    keys = [Key.from_file(p) for p in (raw, hexed, b64, urlsafe)]
    assert {k.id for k in keys} == {key_id(SECRET_B)}
    assert all(k == Key(SECRET_B) for k in keys)


def test_a_key_of_the_wrong_length_is_named_clearly(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 31)
    with pytest.raises(ConfigError, match=r"key file .*short\.key: not a key: give 32 raw bytes.*31 characters given"):
        Key.from_file(short)
    with pytest.raises(ConfigError, match="must be 32 bytes.*16 bytes"):
        Key.from_text(base64.b64encode(b"y" * 16).decode())
    with pytest.raises(ConfigError, match="must be 32 bytes.*got 33 bytes"):
        Key(b"z" * 33)
    with pytest.raises(ConfigError, match=r"cannot read it"):
        Key.from_file(tmp_path / "missing.key")


def test_keys_from_an_environment_variable_and_a_callable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_KEY", SECRET_A.hex())
    assert Key.from_env("APP_KEY").id == key_id(SECRET_A)
    monkeypatch.setenv("OUTBOX_ENCRYPTION_KEYS", f"{base64.b64encode(SECRET_B).decode()}, {SECRET_A.hex()}")
    from_env = KeyRing.from_env()
    assert from_env is not None and from_env.ids == (key_id(SECRET_B), key_id(SECRET_A))
    monkeypatch.delenv("OUTBOX_ENCRYPTION_KEYS")
    assert KeyRing.from_env() is None
    with pytest.raises(ConfigError, match="APP_MISSING is not set"):
        Key.from_env("APP_MISSING")
    calls: list[int] = []

    def kms() -> bytes:
        calls.append(1)
        return SECRET_B

    assert Key.from_callable(kms).id == key_id(SECRET_B) and calls == [1]
    assert Key.from_callable(lambda: SECRET_A.hex(), name="vault").id == key_id(SECRET_A)
    with pytest.raises(ConfigError, match="key source vault: .*got 3 bytes"):
        Key.from_callable(lambda: b"abc", name="vault")


def test_a_key_never_shows_its_bytes() -> None:
    key = Key(SECRET_A)
    ring = KeyRing([key])
    for text in (repr(key), str(key), repr(ring)):
        assert key.id in text
        assert SECRET_A.hex() not in text and base64.b64encode(SECRET_A).decode() not in text
    # As docs/encryption.md says: str (an f-string, a log line) is the id alone.
    assert (str(key), f"{key}", repr(key)) == (key.id, key.id, f"Key(id='{key.id}')")
    assert len(key.id) == 16 and int(key.id, 16) >= 0 and ring.ids == (key.id,) == (ring.current,)
    with pytest.raises(DecryptionError) as info:
        ring.open("0123456789abcdef", b"\0" * 40, b"")
    assert "0123456789abcdef" in str(info.value) and SECRET_A.hex() not in str(info.value)


def test_the_newest_key_seals_and_every_key_opens() -> None:
    old, new = Key(SECRET_A), Key(SECRET_B)
    sealed_old = KeyRing([old]).seal(b"payload", b"here")
    ring = KeyRing([new, old, new])  # the same key twice is kept once
    assert ring.ids == (new.id, old.id) and ring.current == new.id
    sealed_new = ring.seal(b"payload", b"here")
    assert ring.open(old.id, sealed_old, b"here") == b"payload" == ring.open(new.id, sealed_new, b"here")
    assert ring.seal(b"payload", b"here") != sealed_new  # a fresh nonce each time
    with pytest.raises(DecryptionError, match=f"does not decrypt with key {new.id}"):
        ring.open(new.id, sealed_new, b"elsewhere")  # bound to where it was stored
    copy = pickle.loads(pickle.dumps(ring))  # a drain in its own process gets the ring this way
    assert copy.ids == ring.ids and copy.open(old.id, sealed_old, b"here") == b"payload"


def test_encryption_takes_a_ring_a_key_or_keys() -> None:
    key = Key(SECRET_A)
    assert as_key_ring(None) is None
    ring = as_key_ring(key)
    assert ring is not None and ring.ids == (key.id,)
    assert as_key_ring(ring) is ring
    listed = as_key_ring([Key(SECRET_B), key])
    assert listed is not None and listed.current == key_id(SECRET_B)
    with pytest.raises(ConfigError, match="at least one key"):
        KeyRing([])


def test_a_store_that_cannot_encrypt_says_so() -> None:
    with pytest.raises(ConfigError, match="MemoryOutbox does not encrypt"):
        MemoryOutbox().set_encryption(KeyRing([Key(SECRET_A)]))


# -- the SQLite outbox ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 40], ids=["one-message rows", "a group"])
def test_payloads_are_nowhere_in_the_file_nor_its_wal(store: SQLiteOutbox, path: Path, ring: KeyRing, n: int) -> None:
    store.enqueue(messages(n))
    store.add_dead(messages(2, tag="d"), failed_at=time.time())
    data = raw_bytes(path)
    assert MARKER not in data and HEADER_MARKER not in data
    assert b"d-1" in data and b"orders" in data  # msg_ids and topics stay in clear
    raw = sqlite3.connect(path)
    assert {k for (k,) in raw.execute("SELECT DISTINCT enc_key FROM outbox")} == {ring.current}
    raw.close()
    got = store.messages()
    assert [m.value for m in got] == [m.value for m in messages(n)] + [m.value for m in messages(2, tag="d")]
    assert all(("card", HEADER_MARKER) in m.headers for m in got)
    claimed = store.claim("w", 100, 30, now=time.time())
    assert [m.value for m in claimed] == [m.value for m in messages(n)]


def test_without_encryption_new_rows_carry_no_key_id(path: Path) -> None:
    plain = SQLiteOutbox(str(path))
    try:
        plain.enqueue(messages(3) + messages(20, tag="g"))
        assert MARKER in raw_bytes(path)
        raw = sqlite3.connect(path)
        assert raw.execute("SELECT COUNT(*) FROM outbox WHERE enc_key IS NOT NULL").fetchone() == (0,)
        raw.close()
    finally:
        plain.close()


def test_a_missing_or_wrong_key_leaves_rows_pending_and_names_the_key(path: Path, store: SQLiteOutbox,
                                                                        ring: KeyRing) -> None:
    ids = store.enqueue(messages(3) + messages(20, tag="g"))
    store.close()
    for given in (None, KeyRing([Key(SECRET_B)])):
        other = SQLiteOutbox(str(path))
        other.set_encryption(given)
        try:
            with pytest.raises(DecryptionError, match=f"key {ring.current}") as info:
                other.claim("w", 100, 30, now=time.time())
            assert info.value.key_id == ring.current
            with pytest.raises(DecryptionError, match=ring.current):
                other.messages()
            stats = other.stats(now=time.time())
            assert (stats.pending, stats.dead, stats.leased) == (23, 0, 0)  # nothing leased, nothing dead
        finally:
            other.close()
    again = SQLiteOutbox(str(path))
    again.set_encryption(KeyRing([Key(SECRET_B), Key(SECRET_A)]))
    try:
        claimed = again.claim("w", 100, 30, now=time.time())
        assert [m.id for m in claimed] == ids and all(m.attempts == 0 for m in claimed)
    finally:
        again.close()


def test_exploded_groups_failures_and_edits_stay_encrypted(store: SQLiteOutbox, path: Path) -> None:
    ids = store.enqueue(messages(20))
    now = time.time()
    claimed = store.claim("w", 100, 30, now=now)
    # One failure explodes the group: its messages become rows of their own, encrypted each.
    store.apply(Settlement(delivered=ids[:10], failures=[Failure(ids[10], "boom", None, "E", now, None)],
                           released=ids[11:]), now=now)
    assert len(claimed) == 20
    dead = store.list_dead()
    assert [m.id for m in dead] == [ids[10]] and dead[0].value == MARKER + b"-10"
    assert store.redrive_edited(ids[10], value=MARKER + b"-edited", headers=[("card", HEADER_MARKER)], now=now)
    assert store.get(ids[10]).value == MARKER + b"-edited"
    assert [m.value for m in store.trace("m-12")] == [MARKER + b"-12"]
    rest = store.messages()
    assert [m.id for m in rest] == ids[10:] and rest[0].status is Status.PENDING
    data = raw_bytes(path)
    assert MARKER not in data and HEADER_MARKER not in data


def test_a_drain_store_error_is_logged_once_and_rows_stay(path: Path, store: SQLiteOutbox,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The drain's store-error path: DecryptionError is a StoreError, so a background worker
    logs it at ERROR once, counts it in its health, and backs off; the rows stay pending."""
    from outbox.drain.workers import Drainer

    store.enqueue(messages(20))
    store.close()
    keyless = SQLiteOutbox(str(path))
    seen: list[Exception] = []
    drainer = Drainer(keyless, {"bootstrap.servers": "127.0.0.1:1"}, on_store_error=seen.append)
    try:
        with caplog.at_level(logging.ERROR, logger="outbox.drain"):
            for _ in range(3):
                assert drainer._claim(None, True, [], True) == []
        assert drainer.health.store_errors == 3 and len(seen) == 3
        assert all(isinstance(e, DecryptionError) for e in seen)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and key_id(SECRET_A) in errors[0].getMessage()
        stats = keyless.stats(now=time.time())
        assert (stats.pending, stats.dead, stats.leased) == (20, 0, 0)
    finally:
        keyless.close()


def test_a_rotation_reencrypts_old_rows_in_batches_and_skips_leased_ones(path: Path, store: SQLiteOutbox) -> None:
    old_ids = store.enqueue(messages(3, tag="s") + messages(40, tag="g"))  # 3 rows, then a group
    leased = store.enqueue(messages(2, tag="l"))
    dead = store.add_dead(messages(1, tag="d"), failed_at=time.time())
    now = time.time()
    store.claim("drain", 100, 60, now=now)  # leases every pending row...
    store.apply(Settlement(released=old_ids), now=now)  # ...and gives all but `leased` back
    store.close()
    new = Key(SECRET_B)
    rotating = SQLiteOutbox(str(path))
    rotating.set_encryption(KeyRing([new, Key(SECRET_A)]))
    try:
        first = rotating.rotate_keys(now=time.time(), batch=2)
        assert (first.reencrypted, first.left) == (3 + 40 + 1, 2)  # the leased rows are left
        raw = sqlite3.connect(path)
        assert dict(raw.execute("SELECT enc_key, SUM(n) FROM outbox GROUP BY enc_key")) == {
            new.id: 44, key_id(SECRET_A): 2}
        raw.close()
        rotating.apply(Settlement(released=leased), now=time.time())
        second = rotating.rotate_keys(now=time.time())
        assert (second.reencrypted, second.left) == (2, 0)
    finally:
        rotating.close()
    only_new = SQLiteOutbox(str(path))
    only_new.set_encryption(KeyRing([new]))  # the old key can be dropped now
    try:
        got = only_new.messages()
        assert [m.id for m in got] == [*old_ids, *leased, *dead]
        assert [m.value for m in got] == [m.value for m in messages(3, tag="s") + messages(40, tag="g")
                                          + messages(2, tag="l") + messages(1, tag="d")]
        assert [m.id for m in only_new.claim("w", 100, 30, now=time.time())] == [*old_ids, *leased]
    finally:
        only_new.close()
    assert MARKER not in raw_bytes(path)


def test_a_rotation_needs_keys(store: SQLiteOutbox) -> None:
    store.set_encryption(None)
    with pytest.raises(ConfigError, match="no encryption keys given"):
        store.rotate_keys(now=time.time())


def test_the_spark_job_refuses_an_outbox_with_rows_encrypted_with_a_key_not_given(
    path: Path, store: SQLiteOutbox, ring: KeyRing
) -> None:
    from spark_drain.job import _bulk_read
    from spark_drain.options import JobOptions

    options = JobOptions(outbox=f"sqlite:///{path}", bootstrap_servers="127.0.0.1:1")
    assert _bulk_read(options).grouped  # in clear (empty): read as before
    store.enqueue(messages(2))
    with pytest.raises(ConfigError, match=rf"encrypted with key\(s\) {ring.current}, which no key was given for: "
                                          r"pass each with --key-file PATH"):
        _bulk_read(options)
    other = KeyRing([Key(SECRET_B)])
    with pytest.raises(ConfigError, match=rf"key\(s\) {ring.current}, which are not among the given keys"):
        _bulk_read(JobOptions(outbox=options.outbox, bootstrap_servers="127.0.0.1:1", keys=other))
    assert _bulk_read(JobOptions(outbox=options.outbox, bootstrap_servers="127.0.0.1:1",
                                 keys=KeyRing([Key(SECRET_B), Key(SECRET_A)]))).grouped


def test_bytes_moved_to_another_row_or_column_do_not_decrypt(path: Path, store: SQLiteOutbox, ring: KeyRing) -> None:
    a, b = store.add_dead(messages(2, tag="d"), failed_at=time.time())
    raw = sqlite3.connect(path)
    raw.execute("UPDATE outbox SET value = (SELECT value FROM outbox WHERE id = ?) WHERE id = ?", (a, b))
    raw.commit()
    with pytest.raises(DecryptionError, match=f"message {b}: does not decrypt with key {ring.current}"):
        store.get(b)
    raw.execute("UPDATE outbox SET headers = value WHERE id = ?", (a,))  # a value's bytes as headers
    raw.commit()
    raw.close()
    with pytest.raises(DecryptionError, match=f"message {a}: does not decrypt"):
        store.get(a)
    assert store.stats(now=time.time()).dead == 2  # still there, nothing changed by reading


def test_rows_in_clear_stay_readable_beside_encrypted_ones_until_a_rotation(path: Path) -> None:
    plain = SQLiteOutbox(str(path))
    try:
        clear_ids = plain.enqueue(messages(3, tag="c") + messages(20, tag="cg"))
    finally:
        plain.close()
    mixed = SQLiteOutbox(str(path))
    mixed.set_encryption(KeyRing([Key(SECRET_A)]))
    try:
        sealed_ids = mixed.enqueue(messages(2, tag="e"))
        got = mixed.claim("w", 100, 30, now=time.time())
        assert [m.id for m in got] == clear_ids + sealed_ids
        assert [m.value for m in got] == [m.value for m in messages(3, tag="c") + messages(20, tag="cg")
                                          + messages(2, tag="e")]
        mixed.apply(Settlement(released=[m.id for m in got]), now=time.time())
        assert MARKER in raw_bytes(path)  # the rows written in clear
        rotation = mixed.rotate_keys(now=time.time())
        assert (rotation.reencrypted, rotation.left) == (23, 0)
        assert [m.value for m in mixed.messages()] == [m.value for m in got]
    finally:
        mixed.close()
    # Closed, the WAL is checkpointed away, and the clear bytes were zeroed (secure_delete).
    assert MARKER not in raw_bytes(path) and HEADER_MARKER not in raw_bytes(path)
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT COUNT(*) FROM outbox WHERE enc_key IS NULL").fetchone() == (0,)
    raw.close()
