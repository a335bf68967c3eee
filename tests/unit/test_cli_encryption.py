"""The `outbox` command with an encrypted outbox: keys from --key-file or
$OUTBOX_ENCRYPTION_KEYS, the missing key named, and `outbox keys rotate`. Real SQLite files."""

from __future__ import annotations

import json
import time
from pathlib import Path

from click.testing import CliRunner, Result
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox
from outbox.stores.encryption import Key, KeyRing

OLD = bytes(range(32))
NEW = bytes(range(7, 39))
MARKER = b"PAYSLIP-CONFIDENTIAL"


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    base = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": "", "OUTBOX_ENCRYPTION_KEYS": ""}
    return CliRunner().invoke(cli, list(args), env={**base, **(env or {})}, catch_exceptions=False)


def encrypted_outbox(tmp_path: Path) -> tuple[str, Path, Path]:
    """An outbox with 20 pending messages (a group) and 2 dead letters under OLD; its key files."""
    old_file, new_file = tmp_path / "old.key", tmp_path / "new.key"
    old_file.write_bytes(OLD)
    new_file.write_text(NEW.hex())
    path = str(tmp_path / "o.db")
    store = SQLiteOutbox(path)
    store.set_encryption(KeyRing([Key(OLD)]))
    store.enqueue([NewMessage("orders", MARKER + b"%d" % i, b"k", msg_id=f"m{i}") for i in range(20)])
    store.add_dead([NewMessage("orders", MARKER + b"-dead%d" % i, b"k", msg_id=f"d{i}") for i in range(2)],
                   failed_at=time.time())
    store.close()
    return path, old_file, new_file


def test_dlq_commands_read_an_encrypted_outbox_with_its_key(tmp_path: Path) -> None:
    path, old_file, _ = encrypted_outbox(tmp_path)
    listed = run("dlq", "list", "--outbox", path, "--key-file", str(old_file), "--json")
    assert listed.exit_code == 0, listed.output
    items = json.loads(listed.output)
    assert len(items) == 2
    shown = run("dlq", "show", str(items[0]["id"]), "--outbox", path, "--reveal", "--json",
                env={"OUTBOX_ENCRYPTION_KEYS": OLD.hex()})
    assert shown.exit_code == 0, shown.output
    assert "PAYSLIP-CONFIDENTIAL-dead0" in shown.output


def test_a_missing_key_is_one_error_line_naming_the_key_id(tmp_path: Path) -> None:
    path, _, new_file = encrypted_outbox(tmp_path)
    for extra in ([], ["--key-file", str(new_file)]):
        result = run("dlq", "list", "--outbox", path, *extra)
        assert result.exit_code == 1
        assert Key(OLD).id in result.stderr and "Traceback" not in result.output
        assert OLD.hex() not in result.output + result.stderr


def test_a_bad_key_file_is_a_usage_error(tmp_path: Path) -> None:
    path, _, _ = encrypted_outbox(tmp_path)
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"\xff" * 16)
    result = run("dlq", "list", "--outbox", path, "--key-file", str(bad))
    assert result.exit_code == 2
    assert "bad.key" in result.stderr and "16 bytes" in result.stderr


def test_keys_rotate_reencrypts_so_the_old_key_can_be_dropped(tmp_path: Path) -> None:
    path, old_file, new_file = encrypted_outbox(tmp_path)
    result = run("keys", "rotate", "--outbox", path, "--key-file", str(new_file), "--key-file", str(old_file),
                 "--batch", "1", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["key_id"], doc["reencrypted"], doc["left"]) == (Key(NEW).id, 22, 0)
    again = run("dlq", "list", "--outbox", path, "--key-file", str(new_file), "--json")
    assert again.exit_code == 0 and len(json.loads(again.output)) == 2
    assert run("keys", "rotate", "--outbox", path).exit_code == 1  # no key given
