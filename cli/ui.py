"""`outbox ui`: serve the dead-letter console (pages and JSON API) over one outbox."""

from __future__ import annotations

import contextlib
import errno
import os
import socket

import click

from outbox.logs import redact_in_logs
from outbox.ui.masking import MaskRules

from .common import (
    EXIT_USAGE,
    CliError,
    OutboxCommand,
    key_file_option,
    open_store,
    outbox_option,
    remember_secret,
    settings_option,
)
from .masks import mask_options

#: Loggers that could print a request line with `?token=` or an error naming the store.
_SERVER_LOGGERS = ("uvicorn", "uvicorn.access", "uvicorn.error", "outbox.ui")


@click.command(
    "ui",
    cls=OutboxCommand,
    epilog="""\b
Examples:
  outbox ui --outbox app.db                          # http://127.0.0.1:8080/
  OUTBOX_UI_TOKEN=$(openssl rand -hex 16) outbox ui --outbox app.db --host 0.0.0.0
  curl -H "Authorization: Bearer $OUTBOX_UI_TOKEN" http://host:8080/api/dead-letters?error=MSG_SIZE_TOO_LARGE
  outbox ui --outbox app.db --host 0.0.0.0 --viewer-token-file /run/secrets/viewer \\
      --operator-token-file /run/secrets/operator --admin-token-file /run/secrets/admin
  outbox ui --outbox app.db --mask-json-path '$.card.number' --mask-header x-customer-email

\b
Roles: a viewer reads, masked; an operator also redrives, purges and erases; an
admin also reveals a message unmasked (each reveal is in the audit log). The
single --token (OUTBOX_UI_TOKEN) is the admin's. Role tokens come from files
or from OUTBOX_UI_VIEWER_TOKEN, OUTBOX_UI_OPERATOR_TOKEN, OUTBOX_UI_ADMIN_TOKEN.

\b
Pages: / (overview), /dead-letters, /dead-letters/ID, /trace, /audit.
API: /api/... (OpenAPI schema: /api/openapi.json).""",
)
@outbox_option
@key_file_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (not loopback: needs a token, or --role-header).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option(
    "--token",
    envvar="OUTBOX_UI_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="The admin's token, required on every request (API: Authorization: Bearer TOKEN; browser: open "
    "/login?token=TOKEN once). Prefer the environment variable: process arguments are visible to other users.",
)
@click.option("--viewer-token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="A viewer's token (reads, masked), from this file; or $OUTBOX_UI_VIEWER_TOKEN.")
@click.option("--operator-token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="An operator's token (also redrives, purges, erases), from this file; or $OUTBOX_UI_OPERATOR_TOKEN.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="An admin's token (also reveals, audited), from this file; or $OUTBOX_UI_ADMIN_TOKEN.")
@click.option(
    "--role-header", metavar="NAME",
    help="Take each request's role (viewer, operator, admin) from this header, e.g. X-Outbox-Role. Only safe "
    "behind a reverse proxy that signs people in, sets it, drops it from what clients send, and is the only way "
    "to reach the console.",
)
@mask_options
@click.option(
    "--rate", default=500.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
    help="Default redrive rate, messages per second (a redrive may ask for another).",
)
@click.option(
    "--bootstrap-servers", "-b", envvar="KAFKA_BOOTSTRAP_SERVERS", show_envvar=True, metavar="HOST:PORT[,...]",
    help="Kafka, for what needs it: redriving a consumer's DLQ topic (POST /api/redrive-topic).",
)
@settings_option("A librdkafka client setting (repeatable), e.g. -X security.protocol=SSL.")
def ui(
    outbox_url: str, host: str, port: int, token: str | None, viewer_token_file: str | None,
    operator_token_file: str | None, admin_token_file: str | None, role_header: str | None, masking: MaskRules,
    rate: float, bootstrap_servers: str | None, settings: dict[str, str],
) -> None:
    """Serve the dead-letter console: list, search, redrive, purge and trace dead letters.

    Every page and answer is masked (the --mask-* options, or the defaults); an admin may
    reveal one message at a time, and the audit log records it."""
    try:
        import uvicorn

        from outbox.ui import create_app
        from outbox.ui.security import is_loopback
    except ImportError as exc:
        raise CliError(f"the console needs {exc.name}: pip install 'kafka-outbox[ui]'") from None
    loopback = is_loopback(host)
    if token is not None and len(token) < 16:
        raise CliError("--token: use at least 16 characters (e.g. openssl rand -hex 16)", EXIT_USAGE)
    tokens: dict[str, str] = {}
    for role, path in (("viewer", viewer_token_file), ("operator", operator_token_file), ("admin", admin_token_file)):
        given = _role_token(role, path)
        if given is not None and tokens.setdefault(given, role) != role:
            raise CliError(f"the {tokens[given]} and the {role} token are the same: give each role its own",
                           EXIT_USAGE)
    if not loopback and not token and not tokens and not role_header:
        raise CliError(
            f"--host {host} makes the console reachable from other machines: give a token "
            "(OUTBOX_UI_TOKEN=... or --token, or a role's: --viewer-token-file ...), or a --role-header that a "
            "reverse proxy sets, or bind 127.0.0.1",
            EXIT_USAGE,
        )
    if role_header:
        click.echo(f"outbox ui: each request's role is read from its {role_header} header: only safe when every "
                   "request comes through a proxy that sets it", err=True)
    with open_store(outbox_url) as (store, url):
        kafka = {"bootstrap.servers": bootstrap_servers, **settings} if bootstrap_servers else None
        app = create_app(store, token=token, tokens=tokens, role_header=role_header, masking=masking,
                         loopback=loopback, location=url.redacted(), default_rate=rate, kafka=kafka)
        config = uvicorn.Config(app, host=host, port=port, log_level="info")  # configures uvicorn's logging
        secrets = [token, *tokens, url.password] + [v for k, v in settings.items() if "password" in k or "secret" in k]
        for secret in secrets:
            if secret:
                redact_in_logs(secret, _SERVER_LOGGERS)
        # Bound here, before saying where the console is: a port in use is an error (exit 1), not
        # uvicorn's log line and exit code after the console was announced.
        with _listen(host, port) as sock:
            port = sock.getsockname()[1]  # --port 0: the one the system chose
            click.echo(f"outbox console for {url.redacted()} on http://{host}:{port}/", err=True)
            server = uvicorn.Server(config)
            # uvicorn shuts down cleanly on Ctrl-C, then raises it again for its caller: the
            # console stopped as asked, which is success (exit 0), as `drain --follow`.
            with contextlib.suppress(KeyboardInterrupt):
                server.run(sockets=[sock])
        if not server.started:
            raise CliError(f"the console on {host}:{port} did not start (see the lines above)")


def _role_token(role: str, path: str | None) -> str | None:
    """The token of `role`, from the file at `path` or from $OUTBOX_UI_<ROLE>_TOKEN; None for
    neither. Never echoed: errors name the file or the variable.

    Raises:
        CliError: both given, the file unreadable, the token shorter than 16 characters.
    """
    option, variable = f"--{role}-token-file", f"OUTBOX_UI_{role.upper()}_TOKEN"
    from_env = os.environ.get(variable) or None
    if path is not None and from_env is not None:
        raise CliError(f"give the {role} token once: {option} or {variable}, not both", EXIT_USAGE)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                given = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{option}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}", EXIT_USAGE) \
                from None
        where = f"{option} {path}"
    elif from_env is not None:
        given, where = from_env.strip(), variable
    else:
        return None
    remember_secret(click.get_current_context(), given)
    if len(given) < 16:
        raise CliError(f"{where}: the token has fewer than 16 characters (e.g. openssl rand -hex 16)", EXIT_USAGE)
    return given


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (uvicorn listens on it).

    Raises:
        CliError: the address cannot be bound (in use, not this machine's, not allowed).
    """
    name = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in name else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((name, port))
    except OSError as exc:
        sock.close()
        reason = "the address is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise CliError(f"cannot listen on {host}:{port}: {reason} (--port, --host)") from None
    return sock
