"""Build hook: pure Python by default; ``OUTBOX_COMPILE=1`` also compiles produce()'s hot path.

Everything else about the package is in pyproject.toml. The compiled build runs the same
modules through mypyc (C extensions, as mypy and black ship themselves): it needs mypy
(which brings mypyc) and a C compiler, and is built without build isolation, e.g.
``OUTBOX_COMPILE=1 python setup.py build --build-lib build/compiled`` (what `make bench` does).
A compiled module is found before its ``.py`` beside it, which stays the fallback.
"""

import os

from setuptools import setup

#: The modules on fallback mode's produce() happy path, compiled together (one place).
COMPILED_MODULES = [
    "outbox/producer/resilient.py",
    "outbox/producer/admission.py",
    "outbox/producer/firstsend.py",
    "outbox/message.py",
]

if os.environ.get("OUTBOX_COMPILE") == "1":
    from mypyc.build import mypycify

    setup(ext_modules=mypycify(COMPILED_MODULES, opt_level="3"))
else:
    setup()
