"""The one parser for outbox URLs, used by the SDK, the CLI and the Spark job.

Each backend takes its own URLs (`outbox.stores.registry`: the SQLite forms in
`outbox.stores.sqlite_backend`, PostgreSQL's in `outbox.stores.postgres_backend`, and those of
any backend a package registers); a bare path means a file of the backend that takes those
(SQLite).
"""

from __future__ import annotations

from outbox.stores.location import DEFAULT_TABLE, StoreURL
from outbox.stores.registry import parse_url

__all__ = ["DEFAULT_TABLE", "StoreURL", "parse_url"]
