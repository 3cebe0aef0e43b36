"""A rank for test_train_signals' launcher: it stops on SIGINT as zeropipe train's ranks do,
but its save takes minutes.

Its own module, importing nothing heavy: each process the launcher spawns imports it to find
the function, and the launcher itself runs only ``zeropipe.runtime.launch``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def slow_to_stop(rank: int, world: int, folder: str) -> None:
    """Write ``ready<rank>`` in ``folder``; on SIGINT write ``saving<rank>`` (this process's
    id) and sleep for five minutes, as a save that takes that long would."""
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    Path(folder, f"ready{rank}").write_text("")
    while not got:
        time.sleep(0.01)
    Path(folder, f"saving{rank}").write_text(str(os.getpid()))
    time.sleep(300)
