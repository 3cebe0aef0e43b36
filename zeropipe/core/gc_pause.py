"""``paused_gc()``: Python's cyclic garbage collector held off around bulk work.

Validating, simulating or generating a big schedule allocates ~10^6 small lists
and tuples that live until the work ends.  The collector, triggered by the
allocation count, would scan all of them again and again (a third of the time
at 10^6 actions) and find nothing to free: these structures hold no cycles.
Pausing it for the duration keeps the work linear.  Nested pauses are fine, and
a collector the caller had disabled stays disabled.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector inside the ``with`` block, as it was after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
