"""`outbox.ui.masking`: each kind of rule, the defaults, JSON kept valid, text, binary and header
values, the rules' files, and the edit that must never store a mask."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.records import OutboxMessage, Status
from outbox.ui.masking import MASK, NO_MASKS, MaskedEdit, Masker, MaskRules, luhn_ok, parse_json_path

VISA = "4111111111111111"  # Luhn-valid test numbers
MASTERCARD_GROUPED = "5500 0000 0000 0004"
AMEX_DASHED = "3782-822463-10005"
DEFAULTS = Masker()
NONE = Masker(MaskRules(defaults=False))


def shown(masker: Masker, value: bytes) -> str:
    out, _ = masker.value(value)
    assert out is not None
    return out.decode("utf-8")


def test_header_names_exact_glob_and_case_insensitive() -> None:
    m = Masker(MaskRules(headers=("X-Customer-SSN", "x-pii-*"), defaults=False))
    assert m.header("x-customer-ssn", b"123") == (MASK.encode(), True)
    assert m.header("X-PII-email", b"a@b.c") == (MASK.encode(), True)
    assert m.header("x-pii", b"kept") == (b"kept", False)
    assert m.header("trace", b"\xff\x00") == (b"\xff\x00", False)  # bytes kept as they are
    assert m.header("x-customer-ssn", None) == (None, False)  # no value: nothing to mask


@pytest.mark.parametrize("name", ["Authorization", "proxy-authorization", "X-Api-Key", "x-apikey", "api_key",
                                  "X-Auth-Token", "password", "db-passwd", "client_secret"])
def test_default_header_names(name: str) -> None:
    assert DEFAULTS.header(name, b"Bearer abc") == (MASK.encode(), True)
    assert NONE.header(name, b"Bearer abc") == (b"Bearer abc", False)


@pytest.mark.parametrize("name", ["trace", "outbox-id", "outbox-group", "outbox-original-timestamp", "content-type"])
def test_other_headers_are_kept(name: str) -> None:
    assert DEFAULTS.header(name, b"1700000000000") == (b"1700000000000", False)
    assert DEFAULTS.header(name, None) == (None, False)


def test_json_paths_mask_their_fields_and_keep_the_document_valid() -> None:
    m = Masker(MaskRules(json_paths=("$.card.number", "$.user.email", "$.items[*].pan", "$.tags[1]",
                                     "$['odd.key']", "$..ssn"), defaults=False))
    value = {"card": {"number": VISA, "expiry": "12/30"}, "user": {"email": "a@b.c", "name": "Ann"},
             "items": [{"pan": 1, "qty": 2}, {"pan": {"deep": True}}], "tags": ["a", "b", "c"], "odd.key": 3,
             "nested": {"list": [{"ssn": "078-05-1120"}]}, "ssn": None}
    out, masked = m.value(json.dumps(value).encode())
    assert masked and out is not None
    assert json.loads(out) == {
        "card": {"number": MASK, "expiry": "12/30"}, "user": {"email": MASK, "name": "Ann"},
        "items": [{"pan": MASK, "qty": 2}, {"pan": MASK}], "tags": ["a", MASK, "c"], "odd.key": MASK,
        "nested": {"list": [{"ssn": MASK}]}, "ssn": MASK,
    }


def test_the_root_path_masks_the_whole_json_value() -> None:
    m = Masker(MaskRules(json_paths=("$",), defaults=False))
    assert m.value(b'{"a": 1}') == (json.dumps(MASK, ensure_ascii=False).encode(), True)
    assert m.value(b"not json") == (b"not json", False)  # a JSON path only reads JSON


@pytest.mark.parametrize("path", ["card.number", "$.a[", "$.a[x]", "$a", "$.a.", "$['a]"])
def test_a_json_path_that_cannot_be_read_is_a_config_error(path: str) -> None:
    with pytest.raises(ConfigError, match="JSON path"):
        Masker(MaskRules(json_paths=(path,)))


def test_json_path_steps() -> None:
    assert parse_json_path("$.a[0][*]..b['c.d'].*") == (
        ("key", "a"), ("index", 0), ("any", None), ("deep", "b"), ("key", "c.d"), ("any", None))


def test_default_json_fields_at_any_depth() -> None:
    value = {"user": "ann", "password": "hunter2", "auth": {"accessToken": "t", "refresh_token": "r"},
             "list": [{"apiKey": "k"}, {"API_KEY": ["a", "b"]}], "Authorization": "Bearer x", "passwd": 1,
             "client-secret": {"a": 1}, "count": 3}
    out = json.loads(shown(DEFAULTS, json.dumps(value).encode()))
    assert out == {"user": "ann", "password": MASK, "auth": {"accessToken": MASK, "refresh_token": MASK},
                   "list": [{"apiKey": MASK}, {"API_KEY": MASK}], "Authorization": MASK, "passwd": MASK,
                   "client-secret": MASK, "count": 3}
    assert json.loads(shown(NONE, json.dumps(value).encode())) == value


@pytest.mark.parametrize("number", [VISA, MASTERCARD_GROUPED, AMEX_DASHED, "6011000990139424"])
def test_card_numbers_anywhere_in_text(number: str) -> None:
    assert shown(DEFAULTS, f"paid with {number}, thanks".encode()) == f"paid with {MASK}, thanks"
    doc = json.loads(shown(DEFAULTS, json.dumps({"note": f"card {number}", "n": 7}).encode()))
    assert doc == {"note": f"card {MASK}", "n": 7}


@pytest.mark.parametrize("text", [
    "4111111111111112",  # fails the Luhn check
    "1700000000000",  # a millisecond timestamp: starts 1
    "411111111111",  # 12 digits
    "order 41111111111111111111",  # 20 digits
])
def test_what_is_not_a_card_number_is_kept(text: str) -> None:
    assert DEFAULTS.value(text.encode()) == (text.encode(), False)


def test_a_card_number_written_as_a_json_number_is_masked_whole() -> None:
    out = json.loads(shown(DEFAULTS, b'{"pan": 4111111111111111, "ts": 1700000000000}'))
    assert out == {"pan": MASK, "ts": 1700000000000}


def test_json_too_deep_to_read_is_masked_whole_and_odd_json_stays_valid() -> None:
    assert DEFAULTS.value(b"[" * 100_000 + b"]" * 100_000) == (MASK.encode(), True)
    assert DEFAULTS.value(b"[" * 990 + b'"x"' + b"]" * 990) == (MASK.encode(), True)
    assert NONE.value(b"[" * 100_000 + b"]" * 100_000)[1] is False  # no rule: nothing to read
    out, masked = DEFAULTS.value(b'{"s": "\\ud800", "password": "p"}')  # a lone surrogate, escaped
    assert masked and out is not None and json.loads(out) == {"s": "\ud800", "password": MASK}
    stored = row(b'{"s": "\\ud800", "password": "p", "n": 1}', [])
    changed = DEFAULTS.row(stored).row.value
    assert changed is not None
    with pytest.raises(MaskedEdit):
        DEFAULTS.restore(stored, changed.replace(b'"n": 1', b'"n": 2'), [])


def test_luhn() -> None:
    assert luhn_ok(VISA) and luhn_ok("79927398713") and not luhn_ok("79927398710")


def test_named_secrets_in_text_keep_their_name() -> None:
    text = b"user=ann&password=hunter2&next=/home Authorization: Bearer abc.def api-key: 'k1'"
    assert shown(DEFAULTS, text) == f"user=ann&password={MASK}&next=/home Authorization: {MASK} api-key: '{MASK}'"


def test_regexes_mask_matches_or_their_first_group() -> None:
    m = Masker(MaskRules(regexes=(r"\d{3}-\d{2}-\d{4}", r"email=(\S+)"), defaults=False))
    assert shown(m, b"ssn 078-05-1120 email=a@b.c end") == f"ssn {MASK} email={MASK} end"
    assert m.header("note", b"ssn 078-05-1120") == (f"ssn {MASK}".encode(), True)
    assert m.text("failed on 078-05-1120") == f"failed on {MASK}"
    assert m.text(None) is None


def test_a_regex_that_does_not_compile_or_matches_empty_text_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"masking regex '\(unclosed'"):
        Masker(MaskRules(regexes=("(unclosed",)))
    with pytest.raises(ConfigError, match="matches empty text, so it would mask between every character"):
        Masker(MaskRules(regexes=(r"\d*",)))


def test_nothing_masked_keeps_the_stored_bytes_exactly() -> None:
    for value in (b'{"b":1,  "a":[1,2.50]}', b"plain text", b"", b"\xff\xfe\x00", None):
        assert DEFAULTS.value(value) == (value, False)


def test_binary_values_are_masked_whole_when_a_rule_matches() -> None:
    binary = b"\xff\xfe\x00 card " + VISA.encode() + b" \x01"
    assert DEFAULTS.value(binary) == (MASK.encode(), True)
    assert DEFAULTS.header("blob", binary) == (MASK.encode(), True)
    assert NONE.value(binary) == (binary, False)
    assert DEFAULTS.value(bytes(range(256)) * 2) == (bytes(range(256)) * 2, False)


def test_defaults_off_keeps_only_the_rules_given() -> None:
    m = Masker(MaskRules(headers=("x-ssn",), defaults=False))
    assert m.value(f'{{"password": "p", "card": "{VISA}"}}'.encode())[1] is False
    assert m.header("Authorization", b"x") == (b"x", False)
    assert m.header("x-ssn", b"x") == (MASK.encode(), True)
    assert NO_MASKS.value(b'{"password": "p"}') == (b'{"password": "p"}', False)


def row(value: bytes | None, headers: list[tuple[str, bytes | None]], error: str | None = None) -> OutboxMessage:
    now = time.time()
    return OutboxMessage(1, "m-1", "orders", b"customer-4111111111111111", value, headers, -1, Status.DEAD, 3, now,
                         now, now, now, error)


def test_a_row_is_shown_masked_but_its_key_and_times_are_not() -> None:
    stored = row(b'{"password": "p", "n": 1}', [("authorization", b"Bearer t"), ("trace", b"t-1"), ("none", None)],
                 f"builtins.ValueError (consumer): bad card {VISA}")
    masked = DEFAULTS.row(stored)
    assert masked.masked and masked.value_masked and masked.masked_headers == {0} and masked.error_masked
    assert json.loads(masked.row.value or b"") == {"password": MASK, "n": 1}
    assert masked.row.headers == [("authorization", MASK.encode()), ("trace", b"t-1"), ("none", None)]
    assert masked.row.last_error == f"builtins.ValueError (consumer): bad card {MASK}"
    assert (masked.row.key, masked.row.id, masked.row.created_at) == (stored.key, stored.id, stored.created_at)
    plain = DEFAULTS.row(row(b"ok", [("trace", b"t")], "MSG_SIZE_TOO_LARGE (10): too big"))
    assert not plain.masked


STORED = row(b'{"card": "4111111111111111", "price": "x"}',
             [("authorization", b"Bearer t1"), ("trace", b"t"), ("authorization", b"Bearer t2")])


def test_an_edit_posted_back_with_its_masks_unchanged_restores_the_stored_bytes() -> None:
    shown_row = DEFAULTS.row(STORED).row
    edit = DEFAULTS.restore(STORED, shown_row.value, shown_row.headers)
    assert (edit.value, edit.headers, edit.changes_masked) == (STORED.value, STORED.headers, False)
    # An unmasked header changed, one added; the masked ones left as shown keep their bytes.
    edit = DEFAULTS.restore(STORED, shown_row.value, [*shown_row.headers[:1], ("trace", b"fixed"),
                                                     shown_row.headers[2], ("by", b"ops")])
    assert edit.headers == [("authorization", b"Bearer t1"), ("trace", b"fixed"), ("authorization", b"Bearer t2"),
                            ("by", b"ops")]
    assert edit.value == STORED.value and not edit.changes_masked


def test_masked_text_changed_with_the_mask_still_in_it_is_refused() -> None:
    shown_row = DEFAULTS.row(STORED).row
    assert shown_row.value is not None
    changed = shown_row.value.replace(b'"x"', b'"3"')
    with pytest.raises(MaskedEdit, match="value: it still holds the mask"):
        DEFAULTS.restore(STORED, changed, shown_row.headers)
    with pytest.raises(MaskedEdit, match="header 'authorization': it still holds the mask"):
        DEFAULTS.restore(STORED, shown_row.value, [("authorization", b"Bearer " + MASK.encode())])


def test_changing_or_dropping_a_masked_part_is_said() -> None:
    shown_row = DEFAULTS.row(STORED).row
    revealed = DEFAULTS.restore(STORED, b'{"card": "4111111111111111", "price": 3}', shown_row.headers)
    assert revealed.changes_masked and revealed.value == b'{"card": "4111111111111111", "price": 3}'
    dropped = DEFAULTS.restore(STORED, shown_row.value, shown_row.headers[:2])
    assert dropped.changes_masked and dropped.headers == STORED.headers[:2]
    swapped = DEFAULTS.restore(STORED, shown_row.value, [("authorization", b"Bearer new"), *shown_row.headers[1:]])
    assert swapped.changes_masked
    same = DEFAULTS.restore(STORED, STORED.value, STORED.headers)  # the revealed message, unchanged
    assert not same.changes_masked and (same.value, same.headers) == (STORED.value, STORED.headers)


def test_a_stored_value_holding_the_mask_itself_may_be_edited() -> None:
    stored = row(f"already {MASK} here".encode(), [])
    edit = DEFAULTS.restore(stored, f"already {MASK} here, edited".encode(), [])
    assert edit.value == f"already {MASK} here, edited".encode() and not edit.changes_masked


def test_rules_from_json_and_toml_files(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text(json.dumps({"headers": ["x-ssn"], "json_paths": ["$.a"], "defaults": False}))
    (tmp_path / "m.toml").write_text('regexes = ["\\\\d{3}-\\\\d{2}-\\\\d{4}"]\njson_paths = ["$.user.email"]\n')
    assert MaskRules.load(tmp_path / "m.json") == MaskRules(headers=("x-ssn",), json_paths=("$.a",), defaults=False)
    assert MaskRules.load(tmp_path / "m.toml") == MaskRules(regexes=(r"\d{3}-\d{2}-\d{4}",),
                                                            json_paths=("$.user.email",))
    both = MaskRules(headers=("a",)).extended(MaskRules(headers=("b",), defaults=False))
    assert both == MaskRules(headers=("a", "b"), defaults=False)


@pytest.mark.parametrize(("content", "error"), [
    ('{"header": ["x"]}', "unknown key(s) header"),
    ('{"headers": "x"}', "headers must be a list of non-empty strings"),
    ('{"defaults": "no"}', "defaults must be true or false"),
    ("[1]", "must be an object of rules"),
    ("{", "cannot read them"),
])
def test_a_bad_rules_file_is_a_config_error_naming_it(tmp_path: Path, content: str, error: str) -> None:
    path = tmp_path / "rules.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"masking rules {path}: .*{error.replace('(', '.').replace(')', '.')}"):
        MaskRules.load(path)
    with pytest.raises(ConfigError, match="cannot read them"):
        MaskRules.load(tmp_path / "missing.toml")
