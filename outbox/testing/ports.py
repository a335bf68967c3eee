"""Free TCP ports for the test bed's servers, chosen where outgoing connections never land.

A port the OS hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range, the same
range it takes the source ports of outgoing connections from. Between the pick and the server's
own bind (a JVM start: seconds), a client's connection can take that port, and the broker fails
with "Address already in use". Ports below the ephemeral range are only ever taken by a bind.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral() -> int:
    """The first port of the OS's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, below the ephemeral range."""
    top = _below_ephemeral()
    for _ in range(200):
        port = random.randrange(_LOWEST, top) if top > _LOWEST + 100 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free TCP port below the ephemeral range on 127.0.0.1")
