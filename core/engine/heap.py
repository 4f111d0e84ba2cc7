"""Keeps the garbage collector's full passes off the serving path.

Start-up leaves a few hundred thousand long-lived objects (imported libraries, the model's
modules, captured graphs), and CPython's full collection walks every one of them: about 120 ms on
a CI core, and stalls of 130-185 ms between two tokens in `bench decode` on an H200 host. While
a core serves, what start-up built is frozen (`gc.freeze`), so a full pass walks only what
serving made; it is thawed when the last serving core stops, so whatever start-up left behind can
be collected again.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_serving = 0


@contextmanager
def frozen_while_serving() -> Iterator[None]:
    """Freezes the heap as it is (after a collection) for as long as any core serves."""
    global _serving
    with _lock:
        if _serving == 0:
            gc.collect()
            gc.freeze()
        _serving += 1
    try:
        yield
    finally:
        with _lock:
            _serving -= 1
            if _serving == 0:
                gc.unfreeze()
