"""`outbox metrics`: serve an outbox's gauges to Prometheus (a sidecar), or write them once (cron)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from typing import Any

import click

from . import format as fmt
from .common import EXIT_CODES_HELP, CliError, OutboxCommand, json_option, open_store, outbox_option


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise CliError("outbox metrics needs prometheus-client: pip install 'kafka-outbox[metrics]'") from None
    return prometheus_client


def _parse_labels(pairs: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier():
            raise click.BadParameter(f"expected NAME=VALUE with a label name like outbox=orders, got {pair!r}")
        labels[name] = value
    return labels


@click.command(
    "metrics",
    cls=OutboxCommand,
    epilog=f"""\b
Examples:
  outbox metrics --outbox sqlite:////var/lib/app/outbox.db --port 9108
  outbox metrics --host 0.0.0.0 --label outbox=orders      # scraped from other hosts
  outbox metrics --textfile /var/lib/node_exporter/outbox.prom   # from cron
  outbox metrics --once                                     # print once and exit
  outbox metrics --json                                     # print once as JSON and exit

\b
PollReport: outbox_store_up, outbox_pending_messages(_by_topic), outbox_dead_letters(_by_topic),
outbox_oldest_pending_age_seconds, outbox_leased_messages. The producer's own counters
(produced, delivered, circuit state, commit latency) come from outbox.metrics inside the
application.

{EXIT_CODES_HELP}""",
)
@outbox_option
@click.option("--port", default=9108, show_default=True, type=click.IntRange(0, 65535), help="HTTP port to serve on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--label", "labels", multiple=True, metavar="NAME=VALUE", help="Constant label on every sample.")
@click.option("--once", is_flag=True, help="Print the metrics once in Prometheus text format and exit.")
@click.option("--textfile", type=click.Path(dir_okay=False), help="Write the metrics to this file once and exit.")
@json_option
def metrics(
    outbox_url: str, port: int, host: str, labels: tuple[str, ...], once: bool, textfile: str | None, as_json: bool
) -> None:
    """Serve the outbox's gauges over HTTP for Prometheus until Ctrl-C or SIGTERM."""
    prom = _prometheus()
    from outbox.metrics import StoreCollector

    label_map = _parse_labels(labels)
    with open_store(outbox_url) as (store, url):
        registry = prom.CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(store, label_map))
        if as_json:  # once, like --once: a document is printed, not served
            click.echo(fmt.dumps(_samples(registry)))
            return
        if once:
            click.echo(prom.generate_latest(registry).decode(), nl=False)
            return
        if textfile:
            _write_atomically(textfile, prom.generate_latest(registry))
            return
        try:
            server, thread = prom.start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise CliError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        click.echo(f"serving metrics of {url.redacted()} on http://{host}:{server.server_port}/metrics", err=True)
        stop.wait()
        server.shutdown()
        thread.join(5)


def _samples(registry: Any) -> list[dict[str, Any]]:
    """Every sample of the registry: name, labels and value."""
    return [
        {"name": s.name, "labels": dict(s.labels), "value": s.value}
        for family in registry.collect()
        for s in family.samples
    ]


def _write_atomically(path: str, data: bytes) -> None:
    """Write then rename, so node_exporter's textfile collector never reads half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".outbox-metrics-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
