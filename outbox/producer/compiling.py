"""What the modules of the optional compiled build need to keep Python's behaviour, and speed.

The optional compiled build (`setup.py`, ``OUTBOX_COMPILE=1``) turns the modules on
`produce()`'s happy path into C extensions with mypyc, and mypyc makes a compiled module's
classes fixed C types: no weak references, no attributes beyond those declared, no subclasses
written in Python. This module is never compiled, so its classes stay Python ones.

- `PythonObject`: a plain Python base class. A compiled class with a Python class among its
  bases keeps all three (a ``__dict__`` and ``__weakref__`` come with it) while its methods and
  declared attributes stay compiled. `ResilientProducer` needs them: the exit hook holds
  producers by weak reference (`outbox.producer.exithook`), and applications subclass it and set
  attributes on it.
- `mypyc_attr`: mypy_extensions' class options for mypyc, seen by mypy and mypyc only; at run
  time it changes nothing (a compiled class never runs its decorators, and mypy_extensions
  need not be installed).

In the pure-Python build both cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:

    def mypyc_attr(*attrs: str, **options: object) -> Callable[[Any], Any]:
        return lambda cls: cls


class PythonObject:
    """A plain Python base class (module doc)."""
