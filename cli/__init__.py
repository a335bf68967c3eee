"""The `outbox` command line (installed as the import package `outbox_cli`).

Commands: `outbox drain`, `outbox status`, `outbox dlq list|show|purge|replay`. They only call
the SDK (`outbox.*`): the same store methods and drain code the producer uses.
"""

from __future__ import annotations
