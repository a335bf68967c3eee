"""Masking on the command line: the options that set the rules (`outbox ui`, `outbox dlq list`,
`outbox dlq show`), and the audited `--reveal` of the dlq commands.

The rules are `outbox.ui.masking`'s, the same as the console's: `--mask-config FILE` (or
$OUTBOX_MASK_CONFIG, so that the console and the CLI read one file) and the options given add up;
`--no-default-masks` drops the default rules.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from outbox.records import DeadLetterFilter
from outbox.stores import Outbox
from outbox.stores.filters import describe_json
from outbox.ui.masking import Masker, MaskRules

F = TypeVar("F", bound=Callable[..., Any])

_NAMES = ("mask_header", "mask_json_path", "mask_regex", "mask_config", "no_default_masks")


def mask_options(f: F) -> F:
    """--mask-header, --mask-json-path, --mask-regex, --mask-config, --no-default-masks: the
    command receives them as one `masking: MaskRules` (checked: a rule that cannot compile is a
    usage error, exit 2)."""

    @functools.wraps(f)
    def with_rules(*args: Any, **kwargs: Any) -> Any:
        headers, paths, regexes, config, no_defaults = (kwargs.pop(n) for n in _NAMES)
        given = MaskRules(headers=tuple(headers), json_paths=tuple(paths), regexes=tuple(regexes),
                          defaults=not no_defaults)
        rules = MaskRules.load(config).extended(given) if config else given
        Masker(rules)  # ConfigError (exit 2) now, naming the rule, rather than on the first message
        return f(*args, masking=rules, **kwargs)

    options = [
        click.option("--no-default-masks", is_flag=True,
                     help="Drop the default rules (secret-like header and JSON field names, name=value secrets "
                          "in text, card numbers); only the rules given apply."),
        click.option("--mask-config", metavar="FILE", envvar="OUTBOX_MASK_CONFIG", show_envvar=True,
                     type=click.Path(dir_okay=False),
                     help="Masking rules from a JSON or TOML file (.toml): headers, json_paths, regexes (lists), "
                          "defaults (true/false); the options given add to them."),
        click.option("--mask-regex", multiple=True, metavar="REGEX",
                     help="Mask what this Python regular expression matches in text values, header values and "
                          "errors (only its first group when it has one; repeatable)."),
        click.option("--mask-json-path", multiple=True, metavar="PATH",
                     help="Mask this field of JSON values, e.g. $.card.number, $.items[*].pan, $..email "
                          "(repeatable)."),
        click.option("--mask-header", multiple=True, metavar="NAME",
                     help="Mask the value of headers so named (case-insensitive; a glob such as x-pii-* too; "
                          "repeatable)."),
    ]
    for option in options:
        with_rules = option(with_rules)
    return with_rules  # type: ignore[return-value]


def reveal_option(f: F) -> F:
    """--reveal: show the stored bytes unmasked, recorded in the store's audit log."""
    return click.option(
        "--reveal", is_flag=True,
        help="Show every byte, unmasked; each use is recorded in the outbox's audit log (who: cli:USER, what: "
             "the message ids).",
    )(f)


def record_reveal(store: Outbox, ids: Sequence[int], who: str) -> None:
    """Write the reveal of `ids` to the store's audit log, before anything is shown."""
    if ids:
        store.add_audit(who=who, action="reveal", filter=describe_json(DeadLetterFilter(ids=tuple(ids))),
                        count=len(ids), at=time.time())
