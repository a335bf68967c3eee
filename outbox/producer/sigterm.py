"""SIGTERM: commit what the producers hold, then end the process as the default action would.

Kubernetes, systemd, Docker, ECS and Nomad stop a process with SIGTERM, and Python's default
action for it ends the process at once: no `atexit`, no `finally`, so no exit hook. The first
producer started in the main thread while SIGTERM has its default action (`SIG_DFL`) installs
`on_sigterm`; an application's own handler, set before or after, is never replaced, and calls
`on_sigterm` itself to get the same.

The signal lands between two bytecodes of the main thread, anywhere: in the middle of
`produce()`, with one of the producer's locks held, or inside `logging` with a handler's lock.
Closing the producers right there would wait for that lock forever. So `on_sigterm` looks at the
interrupted stack first (`_holds_locks`):

- application code only (the common case: a loop, a sleep, a request): it closes every producer
  at once (`exithook.close_all`, each within its `exit_timeout`) and ends the process;
- inside the producer, `logging` or `threading`'s own bookkeeping: it lets that call go on and
  closes when the call returns to the application, found by a profile function on the main
  thread (`sys.setprofile`), which runs on each return and costs nothing once the process ends.
  A call that has not returned within `DEFERRED_GRACE` is waiting, not holding a lock (the
  producer's waits release theirs): a thread of its own closes the producers then, and ends
  the process with status 128 + the signal (143), as a shell reports the default action.

Ending the process: the handler is set back to `SIG_DFL` and the signal raised again, so the
parent sees what it would have seen (killed by SIGTERM; a shell's `$?` is 143).
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from outbox.producer import exithook

log = logging.getLogger("outbox")

#: The packages whose frames may hold a lock that closing the producers needs.
_PACKAGE = str(Path(__file__).parent.parent) + os.sep
_LOGGING = str(Path(logging.__file__).parent) + os.sep
_THREADING = threading.__file__
#: threading's functions that hold its module locks (thread start and end, which closing the
#: producers' threads takes too); its waits (`Event.wait`, `Thread.join`) hold none.
_THREADING_LOCKED = frozenset({"start", "_bootstrap_inner", "_delete", "_stop", "_after_fork", "_shutdown",
                               "enumerate", "active_count", "__init__", "_maintain_shutdown_locks"})

#: Seconds a deferred close waits for the interrupted call to return before it closes anyway.
DEFERRED_GRACE = 1.0

_stopping = False
#: Taken by whoever closes the producers: the return of the interrupted call, or the grace's end.
_closing = _thread.allocate_lock()


def install() -> None:
    """Install `on_sigterm` if this is the main thread and SIGTERM has its default action."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_sigterm)


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Commit every open producer's accepted messages, then end the process by `signum`.

    What the producers' own SIGTERM handler does. An application with a handler of its own calls
    it last, from that handler, to get the same: ``outbox.on_sigterm(signum, frame)``. It does
    not return. A second SIGTERM while the producers close is ignored.
    """
    global _stopping
    if _stopping:
        return
    _stopping = True
    if _holds_locks(sys._getframe(1) if frame is None else frame):
        _close_on_return(signum)
        # Started with _thread: threading's own start takes a lock the interrupted call may hold.
        _thread.start_new_thread(_close_after_grace, (signum,))
        return
    _close_and_end(signum)


def _close_and_end(signum: int) -> None:
    """Close every producer, then end the process by `signum` (main thread)."""
    if not _closing.acquire(blocking=False):
        return  # the grace's thread is closing them: it ends the process
    try:
        _close_all(signum)
    finally:
        _end(signum)


def _close_after_grace(signum: int) -> None:
    """A thread of its own: the interrupted call is still waiting; close and end from here."""
    time.sleep(DEFERRED_GRACE)
    if not _closing.acquire(blocking=False):
        return  # the main thread got there first
    try:
        _close_all(signum)
    finally:
        _flush_output()
        os._exit(128 + signum)


def _close_all(signum: int) -> None:
    log.info("outbox: signal %d: committing what the producers hold, then ending the process", signum)
    exithook.close_all()


def _close_on_return(signum: int) -> None:
    """Close once the main thread has left the call the signal interrupted."""
    previous = sys.getprofile()

    def on_event(frame: FrameType, event: Any, _arg: Any) -> None:
        if event == "return" and (frame.f_back is None or not _holds_locks(frame.f_back)):
            sys.setprofile(previous)
            _close_and_end(signum)
        elif previous is not None:
            previous(frame, event, _arg)

    sys.setprofile(on_event)


def _holds_locks(frame: FrameType) -> bool:
    """Whether a frame of this stack may hold a lock that closing the producers needs."""
    f: FrameType | None = frame
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith((_PACKAGE, _LOGGING)):
            return True
        if path == _THREADING and f.f_code.co_name in _THREADING_LOCKED:
            return True
        f = f.f_back
    return False


def _end(signum: int) -> None:
    """End the process as `signum`'s default action does (what was printed is flushed first)."""
    _flush_output()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
    os._exit(128 + signum)  # not reached: the default action ended the process


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        # A closed stream, or one the signal interrupted: the process ends all the same.
        with contextlib.suppress(Exception):
            stream.flush()
