"""The docs cover what a user can call: every `outbox` command with each of its options in the
command line page's cheat sheet, and every public name of `outbox.testing` (its exports, the
KafkaCluster methods, the pytest fixtures, the consume helpers, `python -m outbox.testing`'s
commands) on the testing page. A new option or name without its line there fails here."""

from __future__ import annotations

import argparse
import inspect
import re

import click
import pytest
from outbox_cli.main import cli

import outbox.testing
import outbox.testing.consume
import outbox.testing.plugin
from outbox.testing import KafkaCluster
from outbox.testing.__main__ import build_parser
from tests.docs.examples import ROOT

CLI_PAGE = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
TESTING_PAGE = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
#: Options every command has, said once in prose on the command line page, not per command.
EVERYWHERE = {"--help", "-h", "--json", "--outbox"}


def commands(group: click.Group = cli, prefix: str = "") -> dict[str, click.Command]:
    out: dict[str, click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(commands(cmd, f"{prefix}{name} "))
        else:
            out[f"{prefix}{name}"] = cmd
    return out


def cheat_sheet() -> dict[str, str]:
    """The cheat sheet's entry of each command: its `outbox ...` line and the lines under it."""
    block = CLI_PAGE.split("## Cheat sheet", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    known = sorted(commands(), key=len, reverse=True)
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("outbox "):
            rest = line[len("outbox "):]
            current = next((c for c in known if rest == c or rest.startswith(c + " ")), None)
            assert current is not None, f"the cheat sheet names no known command: {line!r}"
            entries[current] = ""
        assert current is not None
        entries[current] += line + "\n"
    return entries


def test_every_command_is_in_the_cheat_sheet() -> None:
    assert sorted(cheat_sheet()) == sorted(commands())


@pytest.mark.parametrize("path", sorted(commands()))
def test_every_option_is_in_its_commands_cheat_sheet_entry(path: str) -> None:
    entry = cheat_sheet().get(path, "")
    wanted = set()
    for param in commands()[path].params:
        if isinstance(param, click.Option):
            names = [o for o in param.opts + param.secondary_opts if o not in EVERYWHERE]
            longs = [o for o in names if o.startswith("--")]
            wanted.update(longs or names)  # the long name when there is one
    missing = sorted(o for o in wanted if not re.search(rf"(?<!\w){re.escape(o)}(?![\w-])", entry))
    assert not missing, f"outbox {path}: not in docs/cli.md's cheat sheet: {missing}"


def public_testing_names() -> list[str]:
    fixtures = [n for n, o in vars(outbox.testing.plugin).items()
                if type(o).__name__ == "FixtureFunctionDefinition" or hasattr(o, "_pytestfixturefunction")]
    cluster = [n for n, _ in inspect.getmembers(KafkaCluster) if not n.startswith("_")]
    helpers = [n for n, o in vars(outbox.testing.consume).items()
               if inspect.isfunction(o) and not n.startswith("_") and o.__module__ == outbox.testing.consume.__name__]
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = list(sub.choices)
    return sorted({*outbox.testing.__all__, *fixtures, *cluster, *helpers, *(f"python -m outbox.testing {c}"
                                                                            for c in actions)})


def test_the_walk_finds_the_testing_names() -> None:
    names = public_testing_names()
    assert {"KafkaCluster", "stop_broker", "make_topic", "consume", "python -m outbox.testing fetch"} <= set(names)


@pytest.mark.parametrize("name", public_testing_names())
def test_every_public_name_of_outbox_testing_is_on_the_testing_page(name: str) -> None:
    """In code (between backticks or in a code block), so that a word of prose does not count."""
    code = re.findall(r"`[^`\n]+`", TESTING_PAGE) + re.findall(r"```.*?```", TESTING_PAGE, re.S)
    assert any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", c) for c in code), (
        f"{name} is not in docs/testing.md")
