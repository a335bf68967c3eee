"""The producer's drain in a process of its own: `ResilientProducer(drain_in="process")`.

Why: after an outage nearly every message of a busy keyed producer goes through the outbox
(spilled by the application's process, re-sent by the drain). In one process the application,
the delivery thread, the writer and the drain workers share one interpreter lock; a drain in a
child process has its own, so spill and drain run on both cores.

How: the parent starts `child_main` in a new ``python`` (a fresh interpreter: no fork of a process
that runs librdkafka threads, and, unlike multiprocessing's spawn, no re-import of the
application's ``__main__``). Two pipes, passed as extra file descriptors, carry pickles:

* parent to child: the settings once (store URL, producer config, retry policy, ...), then
  ``"wake"`` when rows were stored and ``"stop"`` at close. End of file means the parent is gone:
  the child stops as on ``"stop"``, so it never outlives the application.
* child to parent: ``"ready"`` or ``"failed"`` after start-up, then one event per settled batch
  (the delivered rows' ids, keys and headers, the running counts), one per batch with rows to
  retry (when any), each dead letter, each store
  error it survived, its WARNING-and-above log lines, its counts of worker restarts and of
  client callbacks that raised (``"health"``, when they change), and ``"stopped"``.

The parent's `outbox-drain-events` thread tells those events (`delivered`, `retried`, `dead`) to
the producer's listeners (`outbox.events`), as the drain threads would. A child
that dies is logged at ERROR, counted in `restarts`, and started again after a pause; the rows
it had leased come back at once (its lease owner is gone, `outbox.stores.owners`).

Secrets travel in the settings pipe, never on a command line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from outbox.drain.callbacks import CallbackErrors
from outbox.drain.sendloop import check_resend_config
from outbox.drain.workers import Drainer, DrainHandback, DrainHealth, DrainResult, hand_back_logged
from outbox.errors import ConfigError, StoreError
from outbox.events import Drained, Events, Listener, drained_fields
from outbox.lockorder import new_lock
from outbox.records import DeadLetter, OutboxMessage
from outbox.retry import RetryPolicy
from outbox.stores import open_outbox
from outbox.stores.encryption import KeyRing
from outbox.stores.urls import StoreURL

log = logging.getLogger("outbox.drain.process")

# The child's program (not `-m outbox.drain.process`: this module, imported by the package first,
# would run twice).
_CHILD = (
    "import sys; from outbox.drain.process import child_main; "
    "sys.exit(child_main(int(sys.argv[1]), int(sys.argv[2])))"
)
_START_TIMEOUT = 60.0  # seconds for the child to import, open the store and say "ready"
_RESTART_PAUSE = 1.0  # seconds before a dead child is started again


@dataclass(frozen=True)
class DrainSettings:
    """The settings of a drain process's `Drainer`, each as `Drainer`'s argument of that name.

    Pickled for the child: a retry policy's callables must be importable module-level functions
    (not lambdas, not defined in ``__main__``).
    """

    retry: RetryPolicy
    workers: int
    batch_size: int
    lease_seconds: float
    poll_interval: float


class DrainProcess:
    """A `Drainer` with its workers in a child process; the same callbacks, run in this one.

    Args:
        outbox: the outbox URL (the child opens the store itself).
        producer_config: as `Drainer`'s; pickled for the child, as `settings` is.
        settings: the child's `Drainer`'s other settings.
        events: as `Drainer`'s, told on the `outbox-drain-events` thread, after `start`'s
            `hand_back` took the rows back.
        on_store_error: as `Drainer`, called on that thread.
        encryption: the key ring of an encrypted outbox, pickled for the child over its pipe.
    """

    def __init__(
        self,
        outbox: str | StoreURL,
        producer_config: Mapping[str, Any],
        settings: DrainSettings,
        *,
        events: Events,
        on_store_error: Callable[[StoreError], None] | None = None,
        encryption: KeyRing | None = None,
    ) -> None:
        self.events = events
        self.on_store_error = on_store_error
        self.lease_seconds = settings.lease_seconds
        self.result = DrainResult()
        self.health = DrainHealth()
        self.restarts = 0  # children that died and were started again, and their workers' restarts
        self.callback_errors = CallbackErrors()  # client callbacks that raised in the children
        self._child_health = (0, 0)  # the running child's (worker restarts, callback errors)
        self._producer_config = dict(producer_config)
        self._settings = _pickled({
            "outbox": outbox,
            "config": dict(producer_config),
            "retry": settings.retry,
            "workers": settings.workers,
            "batch_size": settings.batch_size,
            "lease_seconds": settings.lease_seconds,
            "poll_interval": settings.poll_interval,
            "encryption": encryption,
        })
        self._send_lock = new_lock("drain process")
        self._stopping = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._commands: Connection | None = None
        self._events: Connection | None = None
        self._base = (0, 0, 0, 0)  # counts of children that died: a new child counts from zero
        self._reader: threading.Thread | None = None
        self._hand_back: DrainHandback | None = None
        #: The SASL credentials `set_sasl_credentials` gave last: a child started later gets them too.
        self._sasl: tuple[str, str, str] | None = None

    @property
    def pid(self) -> int | None:
        """The drain process's pid while one runs (for operators; it is restarted if it dies)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, hand_back: DrainHandback | None = None) -> None:
        """Start the child and wait until it drains; ConfigError if it cannot start. What the
        child settles is handed back to `hand_back` (as `Drainer.start`'s), on the
        `outbox-drain-events` thread, as `Drained` rows."""
        check_resend_config(self._producer_config)
        self._hand_back = hand_back
        first = self._spawn()
        if first[0] != "ready":
            self._reap()
            raise ConfigError(f"the drain process could not start: {first[1]}")
        self._reader = threading.Thread(target=self._read_events, name="outbox-drain-events", daemon=True)
        self._reader.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the child: its batch in flight is settled, unsent leases released (as `Drainer.stop`)."""
        self._stopping.set()
        self._command("stop")
        if self._reader is not None:
            self._reader.join(timeout)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(5 if timeout is None else max(timeout, 1.0))
            except subprocess.TimeoutExpired:
                log.error("outbox: the drain process did not stop in time; killed (its leases expire)")
                proc.kill()
                proc.wait()
        self._reap()

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials for the child's producers, from their next authentication on
        (sent over the child's own command pipe; never logged), and for any child started later."""
        self._sasl = ("sasl", username, password)
        self._command(self._sasl)

    def wake(self) -> None:
        """Rows were stored: the child looks for due rows now."""
        # Not once stopping: a stopping child reads no more commands, and a full pipe would
        # block the caller (the writer thread).
        if not self._stopping.is_set():
            self._command("wake")

    # -- the parent's side -------------------------------------------------------------------

    def _spawn(self) -> tuple[str, Any]:
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(cmd_r), str(evt_w)],
                pass_fds=(cmd_r, evt_w),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        finally:
            os.close(cmd_r)
            os.close(evt_w)
        self._commands = Connection(cmd_w, readable=False)
        self._events = Connection(evt_r, writable=False)
        self._command(self._settings, raw=True)
        if self._sasl is not None:  # a restarted child authenticates as the parent does now
            self._command(self._sasl)
        if not self._events.poll(_START_TIMEOUT):
            return ("failed", f"no answer within {_START_TIMEOUT:g}s")
        try:
            event: tuple[str, Any] = self._events.recv()
        except EOFError:
            return ("failed", f"it exited with code {self._proc.wait()}")
        return event

    def _command(self, cmd: Any, *, raw: bool = False) -> None:
        with self._send_lock:
            conn = self._commands
            if conn is None:
                return
            try:
                if raw:
                    conn.send_bytes(cmd)
                else:
                    conn.send(cmd)
            except OSError:  # the child is gone; the events thread restarts it
                pass

    def _reap(self) -> None:
        with self._send_lock:
            for conn in (self._commands, self._events):
                if conn is not None:
                    conn.close()
            self._commands = self._events = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _read_events(self) -> None:
        """The `outbox-drain-events` thread: runs callbacks; restarts a child that died."""
        while True:
            events = self._events
            try:
                if events is None:
                    raise EOFError
                event = events.recv()
            except (EOFError, OSError):
                if self._stopping.is_set():
                    return
                if not self._restart():
                    return
                continue
            try:
                if event[0] == "stopped":
                    self._count(event[1])
                    return
                self._dispatch(event)
            except Exception:  # never die silently: the next event is handled again
                log.exception("outbox: a drain process callback failed")

    def _dispatch(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "delivered":
            new = tuple.__new__  # each Drained built as the tuple it is, without _make's checks
            rows: list[Drained] = [new(Drained, t) for t in event[1]]
            self._count(event[2])
            if self._hand_back is not None:
                hand_back_logged(self._hand_back.delivered, rows)
            self.events.delivered(rows)
        elif kind == "retried":
            self.events.retried([tuple.__new__(Drained, t) for t in event[1]])
        elif kind == "dead":
            self._count(event[2])
            if self._hand_back is not None:
                hand_back_logged(self._hand_back.dead, event[1])
            self.events.dead(event[1])
        elif kind == "store_error":
            self.health.store_errors += 1
            self.health.failing_since = self.health.failing_since or time.time()
            self.health.last_error = event[1]
            if self.on_store_error is not None:
                self.on_store_error(StoreError(event[1]))
        elif kind == "store_ok":
            self.health.failing_since = None
        elif kind == "health":
            restarts, errors = event[1:]
            seen_restarts, seen_errors = self._child_health
            self._child_health = (restarts, errors)
            self.restarts += restarts - seen_restarts
            self.callback_errors.add(errors - seen_errors)
        elif kind == "log":
            level, name, text = event[1:]
            logging.getLogger(name).log(level, "[drain process] %s", text)

    def _count(self, counts: tuple[int, int, int, int]) -> None:
        """The child's running (delivered, retried, dead, released) on top of earlier children's."""
        r = self.result
        r.delivered, r.retried, r.dead, r.released = (a + b for a, b in zip(self._base, counts, strict=True))

    def _restart(self) -> bool:
        code = self._proc.wait() if self._proc is not None else None
        self.restarts += 1
        self._child_health = (0, 0)
        self._base = (self.result.delivered, self.result.retried, self.result.dead, self.result.released)
        log.error("outbox: the drain process exited with code %s; starting a new one in %gs", code, _RESTART_PAUSE)
        self._reap()
        while not self._stopping.wait(_RESTART_PAUSE):
            try:
                event = self._spawn()
            except OSError as exc:
                event = ("failed", str(exc))
            if event[0] == "ready":
                if self._stopping.is_set():  # stop() came while this child started: tell it too
                    self._command("stop")
                return True
            log.error("outbox: the drain process could not start again (%s); retrying", event[1])
            self._reap()
        return False


def _child_env() -> dict[str, str]:
    """This process's environment, with its import path: the child must import what the parent
    did (this package, and the modules of the retry policy's callables)."""
    path = [p for p in sys.path if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _pickled(settings: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps(settings)
    except Exception as exc:
        bad = [k for k, v in {**settings["config"], "retry": settings["retry"]}.items() if not _picklable(v)]
        raise ConfigError(
            f"drain_in='process' sends its settings to the drain process, and these cannot be pickled: "
            f"{', '.join(bad) or exc} (use module-level functions, or drain_in='threads')"
        ) from exc


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


# -- the child's side --------------------------------------------------------------------------


class _Pipe:
    """The child's end of the events pipe, shared by its drain threads. It is the child's
    drainer's hand-back: delivered rows and dead letters cross to the parent, which hands them
    to its producer and tells its observers."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = new_lock("drain process reports")
        self.drainer: Drainer | None = None

    def send(self, *event: Any) -> None:
        with self._lock:
            self._conn.send(event)

    def counts(self) -> tuple[int, int, int, int]:
        r = self.drainer.result if self.drainer is not None else DrainResult()
        return (r.delivered, r.retried, r.dead, r.released)

    def delivered(self, rows: Sequence[OutboxMessage] | Sequence[Drained]) -> None:
        self.send("delivered", drained_fields(cast(list[OutboxMessage], rows)), self.counts())

    def dead(self, letter: DeadLetter) -> None:
        self.send("dead", letter, self.counts())

    def store_error(self, exc: StoreError) -> None:
        self.send("store_error", str(exc))

    def cluster_known_down(self) -> bool:
        return False  # the parent's circuit is not seen here; the worker's own sends tell


class _RetriedToParent(Listener):
    """The child's `retried` observer: the parent's observers hear it too."""

    def __init__(self, pipe: _Pipe) -> None:
        self._pipe = pipe

    def retried(self, rows: Sequence[Drained]) -> None:
        self._pipe.send("retried", [tuple(r) for r in rows])


class _ForwardLogs(logging.Handler):
    """The child's WARNING-and-above log lines, re-logged by the parent under the same names."""

    def __init__(self, events: _Pipe) -> None:
        super().__init__(logging.WARNING)
        self._events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self._events.send("log", record.levelno, record.name, text)
        except OSError:
            pass  # the parent is gone (the pipe is closed): nobody is left to tell, and the child stops
        except Exception:
            self.handleError(record)


def child_main(cmd_fd: int, evt_fd: int) -> int:
    """The drain process: read the settings, drain until told to stop or the parent is gone."""
    # Ctrl-C reaches the whole process group; the parent decides when the drain stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    commands = Connection(cmd_fd, writable=False)
    events = _Pipe(Connection(evt_fd, readable=False))
    outbox_log = logging.getLogger("outbox")
    outbox_log.addHandler(_ForwardLogs(events))
    outbox_log.setLevel(logging.WARNING)
    outbox_log.propagate = False
    try:
        s = pickle.loads(commands.recv_bytes())
        store = open_outbox(s["outbox"], encryption=s["encryption"])
        drainer = Drainer(
            store,
            s["config"],
            retry=s["retry"],
            workers=s["workers"],
            batch_size=s["batch_size"],
            lease_seconds=s["lease_seconds"],
            poll_interval=s["poll_interval"],
            on_store_error=events.store_error,
        )
        drainer.events.subscribe(_RetriedToParent(events), internal=True)  # a failure there is the library's
    except BaseException as exc:
        events.send("failed", f"{type(exc).__name__}: {exc}")
        return 1
    events.drainer = drainer
    # This process only drains: what start-up made (modules, the store, the settings) lives as
    # long as it does, so the collector need not walk it again on every full collection (the
    # "delivered" events need every claim decoded whole, and those rows set off collections).
    gc.freeze()
    events.send("ready", os.getpid())
    drainer.start(events)
    failing = False
    health = (0, 0)
    while True:
        if (drainer.restarts, drainer.callback_errors.count) != health:
            health = (drainer.restarts, drainer.callback_errors.count)
            events.send("health", *health)
        if commands.poll(1.0):
            try:
                cmd = commands.recv()
            except EOFError:  # the parent is gone
                break
            if cmd == "stop":
                break
            if isinstance(cmd, tuple) and cmd[0] == "sasl":
                drainer.set_sasl_credentials(cmd[1], cmd[2])
                continue
            drainer.wake()
        if failing != (drainer.health.failing_since is not None):  # a spell of store errors ended
            failing = not failing
            if not failing:
                events.send("store_ok")
    drainer.stop()
    store.close()
    with contextlib.suppress(OSError):
        events.send("stopped", events.counts())
    return 0

