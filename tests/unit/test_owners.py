"""Lease owner names and the liveness rule (outbox.stores.owners), against real processes of this host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

from outbox.stores.owners import Liveness, OwnerId, describe_owner, local_liveness, new_owner, parse_owner


def test_new_owner_names_this_process_and_parses_back() -> None:
    text = new_owner("drain")
    owner = parse_owner(text)
    assert owner is not None
    assert str(owner) == text
    assert owner.role == "drain" and owner.pid == os.getpid() and owner.start > 0
    assert describe_owner(text) == f"drain@{owner.host} pid {os.getpid()}"
    assert new_owner("drain") != text  # the random part: two owners of one process differ


def test_this_process_is_alive() -> None:
    assert local_liveness(new_owner("producer")) is Liveness.ALIVE


def test_a_reused_pid_is_gone() -> None:
    owner = parse_owner(new_owner("producer"))
    assert owner is not None
    # Our pid, but the start time of an earlier process that had it.
    assert local_liveness(str(replace(owner, start=owner.start - 1))) is Liveness.GONE


def test_an_exited_process_is_gone_and_a_zombie_too() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from outbox.stores.owners import new_owner; print(new_owner('drain'), flush=True); input()",
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    name = child.stdout.readline().strip()
    assert local_liveness(name) is Liveness.ALIVE
    os.kill(child.pid, signal.SIGKILL)
    # Not reaped yet: a zombie still has its pid, and is gone all the same.
    deadline = time.monotonic() + 10
    while local_liveness(name) is not Liveness.GONE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert local_liveness(name) is Liveness.GONE
    child.wait(10)
    assert local_liveness(name) is Liveness.GONE


def test_other_hosts_containers_and_foreign_names_are_unknown_a_reboot_is_gone() -> None:
    owner = parse_owner(new_owner("drain"))
    assert owner is not None
    assert local_liveness(str(replace(owner, host="elsewhere"))) is Liveness.UNKNOWN
    assert local_liveness(str(replace(owner, pidns=owner.pidns + 1))) is Liveness.UNKNOWN
    assert local_liveness(str(replace(owner, boot="00000000" if owner.boot != "00000000" else "1"))) is Liveness.GONE
    for foreign in ("producer:9f3a2b", "web-1:4242:abc", "", "x@y", "a@h:1:2:3:z"):
        assert local_liveness(foreign) is Liveness.UNKNOWN
        assert describe_owner(foreign) == foreign


def test_parse_owner_rejects_malformed_names() -> None:
    assert parse_owner("drain@h:1:2:b:3:n") == OwnerId("drain", "h", 1, 2, "b", 3, "n")
    assert parse_owner("drain@h:x:2:b:3:n") is None
    assert parse_owner("drain@h:1:2:b:3") is None
