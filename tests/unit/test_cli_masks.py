"""Masking on the command line: `outbox dlq show` and `outbox dlq list` mask as the console does,
`--reveal` shows every byte and is recorded in the audit log, the `--mask-*` options and files
set the rules; and `outbox ui`'s role tokens are checked before anything is served."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox
from outbox.ui.masking import MASK

CARD = "4111-1111-1111-1111"
PASSWORD = "hunter2-Pa55"
VALUE = json.dumps({"order": 7, "card": CARD, "user": {"email": "ann@example.com", "password": PASSWORD}})


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    base = {"OUTBOX_URL": "", "OUTBOX_MASK_CONFIG": "", "OUTBOX_UI_TOKEN": "", "OUTBOX_UI_VIEWER_TOKEN": "",
            "OUTBOX_UI_OPERATOR_TOKEN": "", "OUTBOX_UI_ADMIN_TOKEN": ""}
    return CliRunner().invoke(cli, list(args), env={**base, **(env or {})}, catch_exceptions=False)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[str, SQLiteOutbox, list[int]]]:
    """Two dead letters with secrets (a JSON value and a header; a binary value), one without."""
    path = str(tmp_path / "outbox.db")
    store = SQLiteOutbox(path)
    ids = store.add_dead([
        NewMessage("orders", VALUE.encode(), key=b"customer-7", msg_id="s1",
                   headers=[("Authorization", b"Bearer abc"), ("trace", b"t-1"), ("empty", None)], attempts=2,
                   last_error=f"builtins.ValueError (consumer): card {CARD} refused"),
        NewMessage("orders", b"\xff\x00 " + CARD.encode(), key=b"customer-8", msg_id="s2"),
        NewMessage("orders", b"plain", key=b"customer-9", msg_id="p1", last_error="MSG_SIZE_TOO_LARGE (10): big"),
    ], failed_at=time.time())
    yield path, store, ids
    store.close()


def secretless(text: str) -> bool:
    return all(s not in text for s in (CARD, PASSWORD, "Bearer abc", CARD.encode().hex()))


def test_dlq_show_masks_by_default(db: tuple[str, SQLiteOutbox, list[int]]) -> None:
    path, store, (secret, binary, plain) = db
    result = run("dlq", "show", str(secret), "--outbox", path)
    assert result.exit_code == 0 and secretless(result.stdout)
    assert f"  Authorization: {MASK}\n  trace: t-1\n  empty: null\n" in result.stdout
    assert f"last error    builtins.ValueError (consumer): card {MASK} refused\n" in result.stdout
    assert "key           customer-7\n" in result.stdout  # keys are not masked
    assert f"value (utf-8, {len(VALUE)} bytes):\n" in result.stdout  # the stored size
    value = json.loads(result.stdout.split("bytes):\n", 1)[1])
    assert value == {"order": 7, "card": MASK, "user": {"email": "ann@example.com", "password": MASK}}
    assert "--reveal shows every byte" in result.stderr
    binary_out = run("dlq", "show", str(binary), "--outbox", path, "--encoding", "hex").stdout
    assert binary_out.endswith(f"value (hex, {len(CARD) + 3} bytes):\n{MASK.encode().hex()}\n")
    plain_result = run("dlq", "show", str(plain), "--outbox", path)
    assert plain_result.stdout.endswith("value (utf-8, 5 bytes):\nplain\n") and "--reveal" not in plain_result.stderr
    assert store.audit_log() == []  # looking, masked, is not recorded


def test_dlq_show_json_and_list_json_mask_and_say_so(db: tuple[str, SQLiteOutbox, list[int]]) -> None:
    path, _store, (secret, binary, plain) = db
    doc = json.loads(run("dlq", "show", str(secret), "--outbox", path, "--json").stdout)
    assert doc["masked"] is True and doc["size"] == len(VALUE)
    assert json.loads(doc["value"])["card"] == MASK
    assert doc["headers"][0] == {"name": "Authorization", "value": MASK, "encoding": "utf-8"}
    listed = run("dlq", "list", "--outbox", path, "--json")
    assert listed.exit_code == 0 and secretless(listed.stdout)
    docs = json.loads(listed.stdout)
    assert [(d["id"], d["masked"]) for d in docs] == [(secret, True), (binary, True), (plain, False)]
    assert (docs[1]["value"], docs[1]["value_encoding"]) == (MASK, "utf-8")
    assert docs[2]["value"] == "plain"
    text = run("dlq", "list", "--outbox", path).stdout
    assert f"card {MASK} refused" in text and secretless(text)


def test_reveal_shows_every_byte_and_is_audited(db: tuple[str, SQLiteOutbox, list[int]]) -> None:
    path, store, (secret, binary, plain) = db
    doc = json.loads(run("dlq", "show", str(secret), "--outbox", path, "--json", "--reveal").stdout)
    assert (doc["value"], doc["masked"]) == (VALUE, False)
    assert doc["headers"][0]["value"] == "Bearer abc"
    [entry] = store.audit_log()
    assert (entry.action, json.loads(entry.filter), entry.count) == ("reveal", {"ids": [secret]}, 1)
    assert entry.who.startswith("cli")
    docs = json.loads(run("dlq", "list", "--outbox", path, "--json", "--reveal", "--limit", "2").stdout)
    assert [d["value"] for d in docs] == [VALUE, (b"\xff\x00 " + CARD.encode()).hex()]
    entries = store.audit_log()
    assert [(e.action, json.loads(e.filter), e.count) for e in entries] == [
        ("reveal", {"ids": [secret, binary]}, 2), ("reveal", {"ids": [secret]}, 1)]
    assert json.loads(run("dlq", "list", "--outbox", path, "--json", "--reveal", "--topic", "none").stdout) == []
    assert len(store.audit_log()) == 2  # nothing shown, nothing recorded
    result = run("dlq", "show", "999", "--outbox", path, "--reveal")
    assert result.exit_code == 1 and len(store.audit_log()) == 2
    assert plain  # the third dead letter was never revealed
    assert all(str(plain) not in e.filter for e in store.audit_log())


def test_mask_options_and_file_set_the_rules(db: tuple[str, SQLiteOutbox, list[int]], tmp_path: Path) -> None:
    path, _store, (secret, _binary, _plain) = db
    doc = json.loads(run("dlq", "show", str(secret), "--outbox", path, "--json", "--no-default-masks",
                         "--mask-json-path", "$.user.email", "--mask-header", "TRACE",
                         "--mask-regex", r"refused").stdout)
    assert json.loads(doc["value"]) == {"order": 7, "card": CARD, "user": {"email": MASK, "password": PASSWORD}}
    assert [h["value"] for h in doc["headers"]] == ["Bearer abc", MASK, None]
    assert doc["last_error"] == f"builtins.ValueError (consumer): card {CARD} {MASK}"
    rules = tmp_path / "masks.toml"
    rules.write_text('json_paths = ["$.order"]\nheaders = ["tr*"]\n')
    doc = json.loads(run("dlq", "show", str(secret), "--outbox", path, "--json", "--mask-config", str(rules)).stdout)
    assert json.loads(doc["value"]) == {"order": MASK, "card": MASK, "user": {"email": "ann@example.com",
                                                                              "password": MASK}}
    assert [h["value"] for h in doc["headers"]] == [MASK, MASK, None]
    from_env = run("dlq", "list", "--outbox", path, "--json", env={"OUTBOX_MASK_CONFIG": str(rules)})
    assert json.loads(json.loads(from_env.stdout)[0]["value"])["order"] == MASK


@pytest.mark.parametrize(("args", "error"), [
    (["--mask-regex", "(open"], "masking regex '(open'"),
    (["--mask-json-path", "card.number"], "JSON path 'card.number': must start with $"),
    (["--mask-config", "/nonexistent/masks.json"], "masking rules /nonexistent/masks.json: cannot read them"),
])
def test_a_bad_rule_is_a_usage_error_and_shows_nothing(
    db: tuple[str, SQLiteOutbox, list[int]], args: list[str], error: str
) -> None:
    path, store, (secret, _binary, _plain) = db
    for command in (["dlq", "show", str(secret)], ["dlq", "list"]):
        result = run(*command, "--outbox", path, "--reveal", *args)
        assert result.exit_code == 2 and error in result.stderr, result.output
        assert result.stdout == ""
    assert store.audit_log() == []


def test_ui_role_tokens_are_checked_before_serving(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    SQLiteOutbox(str(db)).close()
    short, good, other = tmp_path / "short", tmp_path / "good", tmp_path / "other"
    short.write_text("tiny-secret\n")
    good.write_text("viewer-token-0123456789\n")
    other.write_text("viewer-token-0123456789")
    ui = ["ui", "--outbox", str(db), "--host", "0.0.0.0"]
    cases = [
        (["--viewer-token-file", str(short)], {}, f"--viewer-token-file {short}: the token has fewer than 16"),
        (["--operator-token-file", str(tmp_path / "missing")], {}, "--operator-token-file: cannot read"),
        (["--viewer-token-file", str(good)], {"OUTBOX_UI_VIEWER_TOKEN": "x" * 20},
         "give the viewer token once: --viewer-token-file or OUTBOX_UI_VIEWER_TOKEN"),
        (["--viewer-token-file", str(good), "--admin-token-file", str(other)], {},
         "the viewer and the admin token are the same"),
        ([], {"OUTBOX_UI_OPERATOR_TOKEN": "short"}, "OUTBOX_UI_OPERATOR_TOKEN: the token has fewer than 16"),
        (["--viewer-token-file", str(good)], {"OUTBOX_UI_TOKEN": "viewer-token-0123456789"},
         "one token is given two roles"),
        ([], {}, "give a token"),
    ]
    for args, env, error in cases:
        result = run(*ui, *args, env=env)
        assert result.exit_code == 2 and error in result.stderr, (args, result.output)
        assert "tiny-secret" not in result.output and "viewer-token-0123456789" not in result.output
