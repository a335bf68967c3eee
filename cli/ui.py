"""`outbox ui`: serve the dead-letter console (pages and JSON API) over one outbox."""

from __future__ import annotations

import errno
import socket

import click

from outbox.logs import redact_in_logs

from .common import EXIT_USAGE, CliError, OutboxCommand, open_store, outbox_option, settings_option

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

\b
Pages: / (overview), /dead-letters, /dead-letters/ID, /trace, /audit.
API: /api/... (OpenAPI schema: /api/openapi.json).""",
)
@outbox_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (not loopback: needs --token).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option(
    "--token",
    envvar="OUTBOX_UI_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="Required on every request (API: Authorization: Bearer TOKEN; browser: open /login?token=TOKEN once). "
    "Prefer the environment variable: process arguments are visible to other users.",
)
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
    outbox_url: str, host: str, port: int, token: str | None, rate: float, bootstrap_servers: str | None,
    settings: dict[str, str],
) -> None:
    """Serve the dead-letter console: list, search, redrive, purge and trace dead letters."""
    try:
        import uvicorn

        from outbox.ui import create_app
        from outbox.ui.security import is_loopback
    except ImportError as exc:
        raise CliError(f"the console needs {exc.name}: pip install 'kafka-outbox[ui]'") from None
    loopback = is_loopback(host)
    if not loopback and not token:
        raise CliError(
            f"--host {host} makes the console reachable from other machines: give a token "
            "(OUTBOX_UI_TOKEN=... or --token), or bind 127.0.0.1",
            EXIT_USAGE,
        )
    if token is not None and len(token) < 16:
        raise CliError("--token: use at least 16 characters (e.g. openssl rand -hex 16)", EXIT_USAGE)
    with open_store(outbox_url) as (store, url):
        kafka = {"bootstrap.servers": bootstrap_servers, **settings} if bootstrap_servers else None
        app = create_app(store, token=token, loopback=loopback, location=url.redacted(), default_rate=rate,
                         kafka=kafka)
        config = uvicorn.Config(app, host=host, port=port, log_level="info")  # configures uvicorn's logging
        secrets = [token, url.password] + [v for k, v in settings.items() if "password" in k or "secret" in k]
        for secret in secrets:
            if secret:
                redact_in_logs(secret, _SERVER_LOGGERS)
        # Bound here, before saying where the console is: a port in use is an error (exit 1), not
        # uvicorn's log line and exit code after the console was announced.
        with _listen(host, port) as sock:
            port = sock.getsockname()[1]  # --port 0: the one the system chose
            click.echo(f"outbox console for {url.redacted()} on http://{host}:{port}/", err=True)
            server = uvicorn.Server(config)
            server.run(sockets=[sock])
        if not server.started:
            raise CliError(f"the console on {host}:{port} did not start (see the lines above)")


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
