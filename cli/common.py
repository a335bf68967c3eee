"""What every `outbox` command shares: exit codes, error handling, options, store opening, TIME.

Errors: every command runs inside `OutboxCommand.invoke`, which turns the library's exceptions
(`OutboxError` and its subclasses, confluent_kafka's `KafkaException`, `OSError`) into a
one-line `click.ClickException` with the documented exit code, with any secret scrubbed. Bugs
(anything else) still show a traceback, so they get reported instead of hidden.
"""

from __future__ import annotations

import getpass
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from confluent_kafka import KafkaError, KafkaException

from outbox import exitcodes
from outbox.errors import ConfigError, KafkaUnavailableError, MissingDependencyError, OutboxError
from outbox.stores import Outbox, open_outbox
from outbox.stores.encryption import KEYS_ENV, KeyRing, given_keys
from outbox.stores.filters import parse_duration, parse_time
from outbox.stores.registry import backend
from outbox.stores.urls import StoreURL, parse_url

from .format import dumps

EXIT_OK = exitcodes.OK
EXIT_ERROR = exitcodes.ERROR  # the command could not do its work
EXIT_USAGE = exitcodes.USAGE  # the command line is wrong
EXIT_PENDING = exitcodes.PENDING  # drain: messages are still pending
EXIT_KAFKA_UNAVAILABLE = exitcodes.KAFKA_UNAVAILABLE  # no broker answered
EXIT_INTERRUPTED = exitcodes.INTERRUPTED  # drain --until-empty stopped by Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = exitcodes.BROKEN_PIPE  # stdout's reader went away (128 + SIGPIPE)

EXIT_CODES_HELP = exitcodes.help_text()

TIME_HELP = """\b
TIME is ISO-8601 (2024-05-01, 2024-05-01T12:00, 2024-05-01T12:00:00+02:00;
without a zone it is UTC) or an age: 90s, 30m, 2h, 1d, 2w (that long ago).
Times are printed in UTC."""

F = TypeVar("F", bound=Callable[..., Any])

_SECRETS_KEY = "outbox.secrets"
_KEY_FILES = "outbox.key_files"


class CliError(click.ClickException):
    """A one-line error with an exit code (`click.ClickException` prints `Error: <message>`)."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        # One line, always: a multi-line library message would look like a traceback.
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a ClassVar; per instance here


def remember_secret(ctx: click.Context, secret: str | None) -> None:
    """Register a password so that no error message of this command can print it."""
    if secret:
        ctx.find_root().meta.setdefault(_SECRETS_KEY, set()).add(secret)


def scrub(ctx: click.Context | None, text: str) -> str:
    """`text` with every registered secret replaced by ***."""
    if ctx is None:
        return text
    for secret in sorted(ctx.find_root().meta.get(_SECRETS_KEY, ()), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def kafka_error_text(exc: KafkaException) -> str:
    """confluent_kafka's exception as one sentence: the KafkaError's own text when there is one."""
    arg = exc.args[0] if exc.args else exc
    return arg.str() if isinstance(arg, KafkaError) else str(arg)


@contextmanager
def _quiet_broken_pipe() -> Iterator[None]:
    """A BrokenPipeError on stdout becomes a quiet exit 141 (click's own would be exit 1)."""
    try:
        yield
    except BrokenPipeError:
        stdout_gone()
        raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None


class OutboxCommand(click.Command):
    """A click command whose library errors become one line on stderr and an exit code."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _quiet_broken_pipe():  # --help is printed here
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        _check_text(ctx)
        try:
            return super().invoke(ctx)
        except CliError as exc:
            clean = scrub(ctx, exc.message)
            if clean == exc.message:
                raise
            raise CliError(clean, exc.exit_code) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            stdout_gone()
            raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None
        except MissingDependencyError as exc:  # an extra to install, not a wrong command line
            raise CliError(scrub(ctx, str(exc)), EXIT_ERROR) from exc
        except ConfigError as exc:
            raise CliError(scrub(ctx, str(exc)), EXIT_USAGE) from exc
        except KafkaUnavailableError as exc:
            raise CliError(scrub(ctx, str(exc)), EXIT_KAFKA_UNAVAILABLE) from exc
        except OutboxError as exc:
            raise CliError(scrub(ctx, str(exc)), EXIT_ERROR) from exc
        except KafkaException as exc:
            raise CliError(scrub(ctx, "Kafka: " + kafka_error_text(exc)), EXIT_ERROR) from exc
        except OSError as exc:
            raise CliError(scrub(ctx, str(exc)), EXIT_ERROR) from exc


def stdout_gone() -> None:
    """Stdout's reader went away (`outbox status | head -1`): point stdout at /dev/null, so that
    neither an error message nor Python's flush at exit writes to the closed pipe again. The
    caller then exits 141, as a tool that SIGPIPE ended, with nothing printed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _check_text(ctx: click.Context) -> None:
    """Refuse arguments that are not UTF-8 text, naming the option.

    Bytes of the command line that are not UTF-8 reach Python as lone surrogates; a store,
    librdkafka or the terminal would each fail on them later with a traceback.
    """
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(v, str):
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                name = param.opts[0] if param.opts else (param.name or "argument")
                raise CliError(f"{name}: {v!r} is not valid UTF-8 text", EXIT_USAGE) from None


class OutboxGroup(click.Group):
    """A click group whose commands (and sub-groups) all handle errors like `OutboxCommand`.

    With `--json` on the command line, an error is a JSON document on stdout too (see
    `json_error`), whether the command line or the command failed, so a script reading stdout
    always gets one document; the exit code is the same as without `--json`.
    """

    command_class = OutboxCommand
    group_class = type  # sub-groups are OutboxGroups too

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _quiet_broken_pipe():  # --help and --version are printed here
            return super().make_context(*args, **kwargs)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or not _wants_json(argv):
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            click.echo(json_error(exc.format_message(), exc.exit_code))
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo(json_error("aborted", EXIT_ERROR))
            sys.exit(EXIT_ERROR)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def _wants_json(argv: list[str]) -> bool:
    """Whether `--json` is among the options (not after `--`, where it would be an argument)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options


def json_error(message: str, exit_code: int) -> str:
    """The `--json` form of an error: ``{"error": {"type", "message", "exit_code"}}``.

    `type` is the exit code's name in `outbox.exitcodes` (usage, error, pending, ...).
    """
    return dumps({"error": {"type": exitcodes.name(exit_code), "message": message, "exit_code": exit_code}})


# -- options ---------------------------------------------------------------------------------


def outbox_option(f: F) -> F:
    """`--outbox URL` (or $OUTBOX_URL)."""
    return click.option(
        "--outbox",
        "outbox_url",
        envvar="OUTBOX_URL",
        show_envvar=True,
        required=True,
        metavar="URL",
        help="The outbox: sqlite:///path.db, a plain file path, postgresql://user@host/db or mysql://user@host/db.",
    )(f)


def key_file_option(f: F) -> F:
    """`--key-file PATH` (repeatable, newest first), else $OUTBOX_ENCRYPTION_KEYS: the keys of an
    encrypted outbox, which `open_store` gives the store."""
    return click.option(
        "--key-file",
        "key_files",
        multiple=True,
        metavar="PATH",
        expose_value=False,
        callback=_remember_key_files,
        help=f"A key of an encrypted outbox (32 bytes, or hex or base64 text); repeatable, the newest "
        f"first. Default: the keys in ${KEYS_ENV} (hex or base64, comma-separated, newest first).",
    )(f)


def _remember_key_files(ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> None:
    ctx.meta[_KEY_FILES] = value


def key_ring(ctx: click.Context) -> KeyRing | None:
    """The keys `--key-file` or $OUTBOX_ENCRYPTION_KEYS give (None: none; or the command takes no keys)."""
    if _KEY_FILES not in ctx.meta:
        return None
    try:
        files = ctx.meta[_KEY_FILES]
        return given_keys(files)
    except ConfigError as exc:  # a MissingDependencyError too: the extra to install
        raise CliError(str(exc), EXIT_ERROR if isinstance(exc, MissingDependencyError) else EXIT_USAGE) from None


def bootstrap_option(help: str) -> Callable[[F], F]:
    """`--bootstrap-servers / -b HOST:PORT[,...]` (or $KAFKA_BOOTSTRAP_SERVERS)."""
    return click.option(
        "--bootstrap-servers",
        "-b",
        envvar="KAFKA_BOOTSTRAP_SERVERS",
        show_envvar=True,
        required=True,
        metavar="HOST:PORT[,...]",
        help=help,
    )


def settings_option(help: str) -> Callable[[F], F]:
    """`-X key=value` (repeatable): librdkafka settings, passed to confluent_kafka untouched."""
    return click.option("-X", "settings", multiple=True, metavar="KEY=VALUE", callback=parse_settings, help=help)


def json_option(f: F) -> F:
    """`--json`: one JSON document on stdout instead of text."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")(f)


# -- the store -------------------------------------------------------------------------------


def parse_store_url(ctx: click.Context, url: str) -> StoreURL:
    """Parse `--outbox`; remembers its password so no message can show it."""
    parsed = parse_url(url)
    remember_secret(ctx, parsed.password)
    return parsed


@contextmanager
def open_store(url: str) -> Iterator[tuple[Outbox, StoreURL]]:
    """Open an EXISTING outbox (never creates one: a mistyped path is an error) and close it after."""
    ctx = click.get_current_context()
    parsed = parse_store_url(ctx, url)
    ring = key_ring(ctx)
    try:
        store = open_outbox(parsed, create=False, encryption=ring)
    except MissingDependencyError as exc:
        raise CliError(scrub(ctx, str(exc))) from exc
    except ImportError as exc:
        extra = backend(parsed.kind).extra
        raise CliError(
            f"cannot open {parsed.redacted()}: {exc.name or 'a driver'} is not installed"
            + (f" (pip install '{extra}')" if extra else "")
        ) from exc
    try:
        yield store, parsed
    finally:
        store.close()


# -- TIME ------------------------------------------------------------------------------------

class _ParsedParam(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A click type read by `parse`; a bad value is one line naming the option, exit code 2."""

    what = ""  # "time", "duration": how the error names the value
    hint = ""  # what a good value looks like

    @staticmethod
    def parse(text: str) -> float:
        raise NotImplementedError

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return self.parse(str(value))
        except ValueError:
            opt = param.opts[0] if param is not None and param.opts else self.name
            raise CliError(f"{opt}: cannot read the {self.what} {value!r}: {self.hint}", EXIT_USAGE) from None


class TimeParam(_ParsedParam):
    """Click type for TIME."""

    name, what = "TIME", "time"
    hint = "use ISO-8601 (2024-05-01T12:00, UTC when no zone is given) or an age such as 30m, 2h, 1d"
    parse = staticmethod(parse_time)


TIME = TimeParam()


class DurationParam(_ParsedParam):
    """Click type for DURATION (seconds)."""

    name, what = "DURATION", "duration"
    hint = "use a number above 0 and a unit, s, m, h, d or w (90s, 30m, 12h, 7d, 2w)"
    parse = staticmethod(parse_duration)


DURATION = DurationParam()


def who() -> str:
    """How the audit log names what this command did: `cli:` and the operating-system user (the
    console names `local` or its token's digest, the producer's retention `retention`)."""
    try:
        return f"cli:{getpass.getuser()}"
    except (OSError, KeyError):  # no user name in the environment nor in the password database
        return "cli"


def stdout_is_terminal() -> bool:
    """Whether stdout is an interactive terminal (progress bars only then)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


# Settings whose values are credentials: never echoed, scrubbed from any error text.
_SECRET_WORDS = ("password", "secret", "token", "credentials")


def parse_settings(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    """`-X key=value` options as a dict (passed to confluent_kafka untouched)."""
    out: dict[str, str] = {}
    for n, item in enumerate(values, 1):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            # The text is not echoed: a stray word here is often a password typed without its key.
            raise CliError(
                f"malformed -X #{n}: expected key=value, e.g. -X acks=all (not echoed: it may hold a secret)",
                EXIT_USAGE,
            )
        if any(word in key.lower() for word in _SECRET_WORDS):
            remember_secret(ctx, value)
        out[key] = value
    return out
