"""What people may see of a stored message: masking rules, applied to every view of it.

The console's pages and JSON API, `outbox dlq show` and `outbox dlq list --json` show a message
through one `Masker`. Three kinds of rules, each a `MaskRules` field:

* **header names** (`headers`): the value of a header so named is masked whole; a name is
  compared without regard to case and may be a glob (`x-secret-*`);
* **JSON paths** (`json_paths`) into a value that is JSON: `$.card.number`, `$.items[*].pan`,
  `$..password` (at any depth), `$.a['odd.name']`; the field's value, whatever it holds, becomes
  the mask, so the document stays valid JSON;
* **regular expressions** (`regexes`) over text: each match is masked (only its first group when
  it has one). They apply to a text value (in a JSON value: to each string in it), to header
  values and to the error text. A value that is not UTF-8 is searched as Latin-1 (one character
  per byte) and masked whole when a rule matches, since masking part of it would say nothing.

The defaults (`defaults=True`) mask headers and JSON fields whose name contains authorization,
password, passwd, secret, token or api_key / apikey (letters compared without case, `-` and
`_`), `name=value` / `name: value` pairs so named in text, and card numbers anywhere in text:
13 to 19 digits, optionally grouped by spaces or dashes, starting 2 to 6 (the card networks'
ranges: a millisecond timestamp starts 1), that pass the Luhn check.

Masked text is `MASK`. Only what is shown is masked: the stored bytes never change, and
`Masker.restore` turns a message posted back with its masks unchanged into the stored bytes
again, so an edit cannot write a mask into a message. Keys are not masked: filters and erasure
name messages by them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError
from outbox.records import Headers, OutboxMessage

__all__ = [
    "MASK", "NO_MASKS", "SENSITIVE_WORDS", "MaskRules", "MaskedEdit", "MaskedRow", "Masker", "Restored", "luhn_ok",
    "parse_json_path", "sensitive_name",
]

#: What a masked field, header value or match shows instead of its text.
MASK = "••••"
_MASK_BYTES = MASK.encode("utf-8")
_MASK_ESCAPED = json.dumps(MASK)[1:-1].encode("ascii")  # as JSON written in ASCII shows it

#: Words that make a header or JSON field's name sensitive (compared without case, `-` or `_`).
SENSITIVE_WORDS = ("authorization", "password", "passwd", "secret", "token", "apikey")

# Card numbers: 13-19 digits grouped by single spaces or dashes, first digit 2-6; Luhn checked.
_CARD = r"(?<![0-9])[2-6](?:[ -]?[0-9]){12,18}(?![0-9])"
# `password=...`, `api-key: ...`, `Authorization: Bearer ...` in text: the value (group 1).
_NAMED = (
    r"(?i)(?:authorization|password|passwd|secret|token|api[_-]?key)[\w-]*[\"']?\s*[:=]\s*[\"']?"
    r"((?:bearer\s+|basic\s+)?[^\s\"'&,;]+)"
)


@dataclass(frozen=True)
class MaskRules:
    """Which parts of a message are masked (see the module's documentation for each kind).

    Attributes:
        headers: header names (or globs, `x-secret-*`), compared without regard to case.
        json_paths: JSON paths into JSON values: `$.a.b`, `$.a[0]`, `$.a[*].b`, `$..name`.
        regexes: Python regular expressions over text; a rule with a group masks its first group.
        defaults: also the default rules (sensitive names, `name=value` pairs, card numbers).
    """

    headers: tuple[str, ...] = ()
    json_paths: tuple[str, ...] = ()
    regexes: tuple[str, ...] = ()
    defaults: bool = True

    def extended(self, other: MaskRules) -> MaskRules:
        """These rules and `other`'s; the defaults only when both keep them."""
        return MaskRules(
            headers=self.headers + other.headers, json_paths=self.json_paths + other.json_paths,
            regexes=self.regexes + other.regexes, defaults=self.defaults and other.defaults,
        )

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any], *, source: str = "masking rules") -> MaskRules:
        """Rules from a mapping with the keys `headers`, `json_paths`, `regexes` (lists of text)
        and `defaults` (true or false), each optional.

        Raises:
            ConfigError: an unknown key, or a value of the wrong type.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        fields: dict[str, Any] = {}
        for name in ("headers", "json_paths", "regexes"):
            items = doc.get(name, [])
            if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
                raise ConfigError(f"{source}: {name} must be a list of non-empty strings")
            fields[name] = tuple(items)
        defaults = doc.get("defaults", True)
        if not isinstance(defaults, bool):
            raise ConfigError(f"{source}: defaults must be true or false")
        return cls(defaults=defaults, **fields)

    @classmethod
    def load(cls, path: str | Path) -> MaskRules:
        """Rules from a file: TOML when its name ends in `.toml`, JSON otherwise.

        Raises:
            ConfigError: the file cannot be read or parsed, or holds something else than rules.
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
            doc = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
            raise ConfigError(f"masking rules {p}: cannot read them: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"masking rules {p}: must be an object of rules (headers, json_paths, regexes, defaults)")
        return cls.from_mapping(doc, source=f"masking rules {p}")


@dataclass(frozen=True)
class MaskedRow:
    """A stored message as it may be shown.

    Attributes:
        row: the message with its value, header values and error text masked (its id, key and
            times as stored).
        value_masked: the value shows a mask.
        masked_headers: the positions in `row.headers` of the header values that show a mask.
        error_masked: the error text shows a mask.
    """

    row: OutboxMessage
    value_masked: bool
    masked_headers: frozenset[int]
    error_masked: bool = False

    @property
    def masked(self) -> bool:
        """Whether anything shown is masked (the value, a header value or the error text)."""
        return self.value_masked or bool(self.masked_headers) or self.error_masked


@dataclass(frozen=True)
class Restored:
    """An edited message with its unchanged masks replaced by the stored bytes.

    Attributes:
        value, headers: what to store.
        changes_masked: a masked part (the value, a masked header) is changed or dropped: only
            whoever may see it revealed may do that.
    """

    value: bytes | None
    headers: Headers
    changes_masked: bool


class MaskedEdit(ValueError):
    """An edit that would store a mask: masked text changed, and the mask kept in it."""


# -- JSON paths -------------------------------------------------------------------------------

# One step of a path: ("key", name), ("index", n), ("any", None) or ("deep", name or None).
_Step = tuple[str, str | int | None]
_PATH_STEP = re.compile(
    r"""\.\.(?P<deep>\*|[^.\[\]]+)|\.(?P<key>\*|[^.\[\]]+)|\[(?P<index>\d+)\]|\[\*\]"""
    r"""|\['(?P<sq>(?:[^'\\]|\\.)*)'\]|\["(?P<dq>(?:[^"\\]|\\.)*)"\]"""
)


def parse_json_path(path: str) -> tuple[_Step, ...]:
    """`$.a.b[0]['c d'][*]..e` as steps.

    Raises:
        ConfigError: not a path this module reads.
    """
    if not path.startswith("$"):
        raise ConfigError(f"JSON path {path!r}: must start with $ (e.g. $.card.number)")
    steps: list[_Step] = []
    at = 1
    while at < len(path):
        m = _PATH_STEP.match(path, at)
        if m is None:
            raise ConfigError(f"JSON path {path!r}: cannot read it from {path[at:]!r} (use .name, [n], [*], "
                              "['name'] or ..name)")
        if m.group("deep") is not None:
            steps.append(("deep", None if m.group("deep") == "*" else m.group("deep")))
        elif m.group("key") is not None:
            steps.append(("any", None) if m.group("key") == "*" else ("key", m.group("key")))
        elif m.group("index") is not None:
            steps.append(("index", int(m.group("index"))))
        elif m.group("sq") is not None or m.group("dq") is not None:
            quoted = m.group("sq") if m.group("sq") is not None else m.group("dq")
            steps.append(("key", re.sub(r"\\(.)", r"\1", quoted)))
        else:
            steps.append(("any", None))
        at = m.end()
    return tuple(steps)


def _step_matches(kind: str, arg: str | int | None, part: str | int) -> bool:
    if kind in ("any", "deep"):
        return arg is None or part == arg
    if kind == "index":
        return part == arg
    return part == arg and isinstance(part, str)


def _path_matches(steps: tuple[_Step, ...], path: tuple[str | int, ...]) -> bool:
    """Whether the concrete `path` (keys and indexes from the root) is one `steps` names."""
    if not steps:
        return not path
    (kind, arg), rest = steps[0], steps[1:]
    if kind == "deep":  # any number of levels, then this name
        return any(_step_matches(kind, arg, path[i]) and _path_matches(rest, path[i + 1:]) for i in range(len(path)))
    return bool(path) and _step_matches(kind, arg, path[0]) and _path_matches(rest, path[1:])


# -- the masker -------------------------------------------------------------------------------


def sensitive_name(name: str) -> bool:
    """Whether a header or JSON field so named holds a secret, by the default rules."""
    squashed = re.sub(r"[-_\s]", "", name.lower())
    return any(word in squashed for word in SENSITIVE_WORDS)


def luhn_ok(digits: str) -> bool:
    """The Luhn check of a card number's digits."""
    total = 0
    for n, ch in enumerate(reversed(digits)):
        d = int(ch)
        if n % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(m: re.Match[str]) -> bool:
    digits = re.sub(r"[ -]", "", m.group(0))
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def _always(m: re.Match[str]) -> bool:
    return True


class Masker:
    """Applies one set of `MaskRules`; pure and thread-safe (compiled once).

    Raises:
        ConfigError: a rule that does not compile (naming it).
    """

    def __init__(self, rules: MaskRules | None = None) -> None:
        self.rules = rules if rules is not None else MaskRules()
        self._headers = tuple(h.lower() for h in self.rules.headers)
        self._paths = tuple(parse_json_path(p) for p in self.rules.json_paths)
        patterns: list[tuple[re.Pattern[str], Callable[[re.Match[str]], bool]]] = []
        for text in self.rules.regexes:
            try:
                pattern = re.compile(text)
            except re.error as exc:
                raise ConfigError(f"masking regex {text!r}: {exc}") from None
            if pattern.fullmatch(""):
                raise ConfigError(f"masking regex {text!r}: matches empty text, so it would mask between every "
                                  "character (use + rather than *)")
            patterns.append((pattern, _always))
        if self.rules.defaults:
            patterns += [(re.compile(_CARD), _card), (re.compile(_NAMED), _always)]
        self._patterns = tuple(patterns)

    @property
    def active(self) -> bool:
        """Whether any rule can mask anything."""
        return bool(self._headers or self._paths or self._patterns)

    # Text ----------------------------------------------------------------------------------

    def text(self, text: str | None) -> str | None:
        """`text` with every regex match masked (its first group when the regex has one)."""
        return None if text is None else self._sub(text)

    def _sub(self, text: str) -> str:
        for pattern, keep in self._patterns:
            text = pattern.sub(_replacer(keep), text)
        return text

    def _matches(self, text: str) -> bool:
        return any(keep(m) for pattern, keep in self._patterns for m in pattern.finditer(text))

    # Values --------------------------------------------------------------------------------

    def value(self, data: bytes | None) -> tuple[bytes | None, bool]:
        """A value as it may be shown, and whether anything in it is masked.

        JSON: the fields that JSON paths or sensitive names select, and regex matches inside its
        strings, re-serialized as valid JSON. Other UTF-8 text: regex matches. Other bytes:
        masked whole when a regex matches their Latin-1 reading. None stays None.
        """
        if data is None or not self.active:
            return data, False
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return (_MASK_BYTES, True) if self._matches(data.decode("latin-1")) else (data, False)
        try:
            doc = json.loads(text)
        except ValueError:
            shown = self._sub(text)
            return (data, False) if shown == text else (shown.encode("utf-8"), True)
        except RecursionError:  # JSON nested too deep to read: what it holds cannot be told
            return _MASK_BYTES, True
        try:
            masked_doc, changed = self._json(doc, ())
        except RecursionError:
            return _MASK_BYTES, True
        if not changed:
            return data, False
        try:
            return json.dumps(masked_doc, ensure_ascii=False).encode("utf-8"), True
        except UnicodeEncodeError:  # a lone surrogate, written \udxxx in the JSON: kept escaped
            return json.dumps(masked_doc).encode("ascii"), True

    def _json(self, node: Any, path: tuple[str | int, ...]) -> tuple[Any, bool]:
        if self._selected(path):
            return MASK, True
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            changed = False
            for k, v in node.items():
                out[k], c = self._json(v, (*path, k))
                changed |= c
            return out, changed
        if isinstance(node, list):
            items = [self._json(v, (*path, i)) for i, v in enumerate(node)]
            return [v for v, _ in items], any(c for _, c in items)
        if isinstance(node, str):
            shown = self._sub(node)
            return shown, shown != node
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            # A number is text to the regexes too (a card number written as one): masked whole.
            number = json.dumps(node)
            return (MASK, True) if self._sub(number) != number else (node, False)
        return node, False

    def _selected(self, path: tuple[str | int, ...]) -> bool:
        last = path[-1] if path else None
        if self.rules.defaults and isinstance(last, str) and sensitive_name(last):
            return True
        return any(_path_matches(steps, path) for steps in self._paths)

    # Headers -------------------------------------------------------------------------------

    def header(self, name: str, value: bytes | None) -> tuple[bytes | None, bool]:
        """A header value as it may be shown, and whether it is masked. A header without a
        value has nothing to mask."""
        if value is None or not self.active:
            return value, False
        lowered = name.lower()
        if any(fnmatch.fnmatchcase(lowered, h) for h in self._headers) or (
                self.rules.defaults and sensitive_name(name)):
            return _MASK_BYTES, True
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            return (_MASK_BYTES, True) if self._matches(value.decode("latin-1")) else (value, False)
        shown = self._sub(text)
        return (value, False) if shown == text else (shown.encode("utf-8"), True)

    # Messages ------------------------------------------------------------------------------

    def row(self, row: OutboxMessage) -> MaskedRow:
        """The message as it may be shown: value, header values and error text masked."""
        value, value_masked = self.value(row.value)
        headers: Headers = []
        masked: set[int] = set()
        for n, (name, raw) in enumerate(row.headers):
            shown, was = self.header(name, raw)
            headers.append((name, shown))
            if was:
                masked.add(n)
        error = self.text(row.last_error)
        shown_row = row._replace(value=value, headers=headers, last_error=error)
        return MaskedRow(shown_row, value_masked, frozenset(masked), error != row.last_error)

    def restore(self, stored: OutboxMessage, value: bytes | None, headers: Headers) -> Restored:
        """An edit of `stored` (its new value and headers) with every mask it shows and that came
        back unchanged replaced by the stored bytes.

        Headers are paired with the stored ones by name and occurrence (the second `a` with the
        second `a`).

        Raises:
            MaskedEdit: masked text was changed and still holds the mask, which would store it.
        """
        shown = self.row(stored)
        if shown.value_masked and value == shown.row.value:
            value = stored.value
        elif _holds_mask(value, stored.value):
            raise MaskedEdit(f"value: it still holds the mask {MASK}: leave masked text unchanged, or edit the "
                             "revealed value (an admin reveals the message)")
        changes = shown.value_masked and value != stored.value
        places = _occurrences(stored.headers)
        out: Headers = []
        for name, occurrence, new in _numbered(headers):
            at = places.get((name, occurrence))
            old = None if at is None else stored.headers[at][1]
            if at is not None and at in shown.masked_headers and new == shown.row.headers[at][1]:
                new = old
            elif _holds_mask(new, old):
                raise MaskedEdit(f"header {name!r}: it still holds the mask {MASK}: leave masked headers unchanged, "
                                 "or edit the revealed message (an admin reveals it)")
            out.append((name, new))
        kept = {(name, occurrence): new for name, occurrence, new in _numbered(out)}
        for (name, occurrence), at in places.items():
            if at in shown.masked_headers and kept.get((name, occurrence)) != stored.headers[at][1]:
                changes = True
        return Restored(value, out, changes)


def _replacer(keep: Callable[[re.Match[str]], bool]) -> Callable[[re.Match[str]], str]:
    """The replacement function of a rule: the masked match, or the match itself when `keep`
    refuses it (a digit run that fails the Luhn check)."""
    return lambda m: _masked_match(m) if keep(m) else m.group(0)


def _masked_match(m: re.Match[str]) -> str:
    if m.re.groups and m.group(1) is not None:
        start, end = m.span(1)
        whole = m.group(0)
        base = m.start(0)
        return whole[: start - base] + MASK + whole[end - base:]
    return MASK


def _holds_mask(new: bytes | None, old: bytes | None) -> bool:
    """Whether `new` shows a mask that `old`, the stored bytes, do not hold themselves."""
    return new is not None and any(m in new and (old is None or m not in old) for m in (_MASK_BYTES, _MASK_ESCAPED))


def _numbered(headers: Iterable[tuple[str, bytes | None]]) -> list[tuple[str, int, bytes | None]]:
    """Each header with its occurrence number among the headers of its name (0, 1, ...)."""
    seen: dict[str, int] = {}
    out = []
    for name, value in headers:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name, n, value))
    return out


def _occurrences(headers: Headers) -> dict[tuple[str, int], int]:
    """(name, occurrence) → position."""
    return {(name, n): at for at, (name, n, _) in enumerate(_numbered(headers))}


#: A masker that masks nothing: what an admin's reveal and `outbox dlq show --reveal` use.
NO_MASKS = Masker(MaskRules(defaults=False))
