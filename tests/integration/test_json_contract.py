"""Every JSON document the project prints is the one docs/schemas/ publishes: each `outbox`
command's `--json` output (and its error object), the Spark job's `--report`, and the console's
JSON routes, from real runs over a real outbox, Kafka cluster and Spark job.

The schemas forbid fields they do not name (`additionalProperties: false`), so a field added to
an output without its schema turns this test red. Every schema file is used by some run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
from click.testing import CliRunner
from fastapi.testclient import TestClient
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox
from outbox.ui.app import create_app

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "docs" / "schemas"
used: set[str] = set()


def check(name: str, doc: Any) -> None:
    """`doc` against docs/schemas/<name>.json (the schema itself checked first)."""
    schema = json.loads((SCHEMAS / f"{name}.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(doc)
    used.add(name)


def cli_json(*args: str, code: int = 0) -> Any:
    """Run an `outbox` command with --json: one document, on one line of stdout, nothing on stderr."""
    env = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": "", "OUTBOX_ENCRYPTION_KEYS": ""}
    done = CliRunner().invoke(cli, [*args, "--json"], env=env, catch_exceptions=False)
    assert (done.exit_code, done.stderr) == (code, ""), done.output
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def filled(path: Path, topic: str) -> str:
    store = SQLiteOutbox(str(path))
    now = time.time()
    store.add_dead([NewMessage(topic, b'{"price": 1}', b"k", headers=[("trace", b"t-1")], msg_id=f"d{i}")
                    for i in range(3)], failed_at=now)
    store.enqueue([NewMessage(topic, b"v%d" % i, b"k%d" % (i % 2), msg_id=f"p{i}") for i in range(4)])
    store.close()
    return str(path)


def test_every_cli_json_output_is_its_published_schema(
    kafka_bootstrap: str, topic: str, tmp_path: Path, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    db = filled(tmp_path / "o.db", topic)
    check("status", cli_json("status", "--outbox", db))
    listed = cli_json("dlq", "list", "--outbox", db)
    assert len(listed) == 3
    check("dlq-list", listed)
    check("dlq-show", cli_json("dlq", "show", str(listed[0]["id"]), "--outbox", db))
    check("dlq-replay", cli_json("dlq", "replay", "--outbox", db, "--id", str(listed[0]["id"])))
    check("dlq-purge", cli_json("dlq", "purge", "--outbox", db, "--id", str(listed[1]["id"]), "--yes"))
    check("erase", cli_json("erase", "--outbox", db, "--key", "k0", "--dry-run"))
    drained = cli_json("drain", "--outbox", db, "-b", kafka_bootstrap)
    assert drained["delivered"] == 5 and drained["remaining"] == 0
    check("drain", drained)
    assert len(consume_all(topic, 5)) == 5  # the drain's report is of real deliveries
    check("status", cli_json("status", "--outbox", db))
    check("audit", cli_json("audit", "--outbox", db))
    check("metrics", cli_json("metrics", "--outbox", db, "--once"))
    key = tmp_path / "k.key"
    key.write_bytes(bytes(range(32)))
    check("keys-rotate", cli_json("keys", "rotate", "--outbox", db, "--key-file", str(key)))
    dlq = make_topic(name=f"{topic}.g.dlq")
    check("dlq-replay-topic", cli_json("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, "--timeout", "5"))
    for args, code in ((["status", "--outbox", str(tmp_path / "none.db")], 1), (["status", "--bogus"], 2),
                       (["dlq", "show", "999", "--outbox", db], 1)):
        error = cli_json(*args, code=code)
        check("cli-error", error)
        assert error["error"]["exit_code"] == code


def test_the_console_json_routes_are_their_published_schemas(
    tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    db = filled(tmp_path / "o.db", "orders")
    store = SQLiteOutbox(db)
    try:
        c = TestClient(create_app(store, kafka={"bootstrap.servers": kafka_bootstrap}), base_url="http://localhost")
        check("console-stats", c.get("/api/stats").json())
        page = c.get("/api/dead-letters").json()
        check("console-dead-letters", page)
        first = page["items"][0]
        check("console-dead-letter", c.get(f"/api/dead-letters/{first['id']}").json())
        check("console-dead-letter", c.post(f"/api/dead-letters/{first['id']}/reveal", json={}).json())
        check("console-trace", c.get(f"/api/trace/{first['msg_id']}").json())
        ids = [item["id"] for item in page["items"]]
        check("console-dead-letter", c.post(f"/api/dead-letters/{ids[0]}/redrive", json={"value": "fixed"}).json())
        check("console-count", c.post("/api/redrive", json={"ids": ids[1:2], "dry_run": True}).json())
        started = c.post("/api/redrive", json={"ids": ids[1:2]})
        assert started.status_code == 202
        check("console-redrive", started.json())
        job_url = started.json()["url"]
        while c.get(job_url).json()["state"] == "running":
            time.sleep(0.05)
        job = c.get(job_url).json()
        assert (job["state"], job["done"]) == ("done", 1)
        check("console-job", job)
        check("console-count", c.post("/api/purge", json={"ids": ids[2:], "dry_run": True}).json())
        purged = c.post("/api/purge", json={"ids": ids[2:], "confirm": True}).json()
        assert purged["removed"] == 1
        check("console-purge", purged)
        check("console-erase", c.post("/api/erase", json={"key": "k0", "dry_run": True}).json())
        dlq = make_topic(name="orders.g.dlq")
        check("console-redrive-topic", c.post("/api/redrive-topic", json={"dlq_topic": dlq}).json())
        check("console-audit", c.get("/api/audit").json())
        missing = c.get("/api/dead-letters/999999")
        assert missing.status_code == 404
        check("console-error", missing.json())
    finally:
        store.close()


def test_the_spark_report_is_its_published_schema(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    db = filled(tmp_path / "o.db", topic)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--master", "local[1]", "--outbox", db, "-b", kafka_bootstrap,
         "--partitions", "1", "--report", str(report)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OUTBOX_ENCRYPTION_KEYS": ""}, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(report.read_text(encoding="utf-8"))
    assert doc["total"]["delivered"] == 4
    check("spark-report", doc)


def test_every_published_schema_is_checked() -> None:
    """Runs last in this module: a schema no run validates would promise nothing."""
    assert used == {p.stem for p in SCHEMAS.glob("*.json")}
