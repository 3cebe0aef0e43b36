"""One rank's process as :func:`~zeropipe.runtime.launch.launch` starts it, seen from inside.

How it starts (:func:`start_method`): forked from multiprocessing's fork server,
a process of its own that imported torch and the runtime once (and the heavy libraries
the launcher itself had loaded: transformers, DTensor), started at the first
launch; ``spawn`` where there is no fork server (Windows), or where the server
cannot be started with the signal dispositions it needs (a first launch from a
thread other than the main one).  A fresh interpreter per rank would import torch
again, about 1.5 s of CPU per rank of every launch.

The server must outlive what a stop does to the launcher's process group: it
starts with SIGINT and SIGTERM ignored, since the ranks' exit codes reach the
launcher through it, and a server ended by a group's SIGTERM would report every
rank as lost.  A forked rank inherits the server's state, not the launcher's, so
:func:`run_rank` sets what the launcher's would have given it: its environment
variables as they are at this launch, and SIGINT and SIGTERM as the launcher has
them (heard, unless the launcher ignores them).

Then (:func:`run_rank`) it watches the launcher (the rendezvous store dies with
it: the rank ends at once, silently), joins the process group, runs ``fn`` and
sends back its result or its error.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeropipe.base import _compat
from zeropipe.core.errors import ZeropipeError
from zeropipe.runtime.transport.failures import failure_origin

__all__ = ["STOP_KEY", "RankStart", "run_rank", "start_method"]

# Set in the rendezvous store when the launcher passes a stop on: a rank that was still
# starting, deaf to SIGINT, reads it once it listens again.
STOP_KEY = "zeropipe/stop"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>: the signal a process gets when its parent ends
# What the fork server imports before it forks any rank: torch and the runtime always, and
# the heavy libraries a launcher that already imported them is likely to hand its ranks
# (Hugging Face models, DTensor plans), each about a second of CPU per rank otherwise.
_PRELOAD = ("torch", "zeropipe.runtime.pipeline")
_PRELOAD_IF_LOADED = ("torch.distributed.tensor", "transformers")


def _preload() -> list[str]:
    """The modules the fork server imports: :data:`_PRELOAD`, and those of
    :data:`_PRELOAD_IF_LOADED` and transformers' model classes the launcher has loaded."""
    loaded = [m for m in _PRELOAD_IF_LOADED if m in sys.modules]
    models = [m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m]
    return [*_PRELOAD, *loaded, *sorted(models)]


def start_method() -> Any:
    """The multiprocessing context a launch starts its ranks with (see the module's docstring)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())
    if threading.current_thread() is not threading.main_thread():
        # Dispositions are the main thread's to set: a server already running will do.
        return ctx if _server_running() else mp.get_context("spawn")
    if not hasattr(signal, "pthread_sigmask"):
        return mp.get_context("spawn")
    with _ignoring(signal.SIGINT, signal.SIGTERM):
        multiprocessing.forkserver.ensure_running()  # started, or restarted if it ended
    return ctx


def _server_running() -> bool:
    """Whether this process's fork server runs (multiprocessing keeps its pid, no public call)."""
    pid = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return False
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


@contextlib.contextmanager
def _ignoring(*signals: signal.Signals) -> Iterator[None]:
    """Ignore ``signals`` meanwhile, so that a process started then inherits them ignored.

    Blocked in this thread too, so that one that comes meanwhile is delivered after,
    not lost (a process started then inherits the block as well: :func:`run_rank`
    lifts it).
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@dataclass(frozen=True)
class RankStart:
    """What one rank is told about itself and its launcher.

    ``deaf``: it starts ignoring SIGINT (the launcher's ``_deaf_to_sigint``); it hears it
    again first thing, and a stop that came meanwhile ends it, quietly, before ``fn``
    runs.  ``hears_sigint`` / ``hears_sigterm``: False where the launcher ignores that
    signal, which the rank then does too.  ``environ``: the launcher's environment
    variables at this launch.
    """

    rank: int
    world: int
    port: int
    backend: str
    timeout: float
    threads: int
    parent: int
    deaf: bool
    hears_sigint: bool
    hears_sigterm: bool
    environ: dict[str, str]


def run_rank(
    start: RankStart,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    lifeline: Connection,
) -> None:
    """One rank: ``fn(rank, world, *args)``; its result or error goes back through ``conn``."""
    code = 0
    try:
        _set_signals(start)
        _end_with_parent(start.parent, lifeline)
        _set_environment(start)
        torch.set_num_threads(start.threads)
        if start.backend == "nccl":
            _compat.bind_device(start.rank)
        timeout = timedelta(seconds=start.timeout)
        store = dist.TCPStore("127.0.0.1", start.port, start.world, False, timeout)
        if start.deaf and store.check([STOP_KEY]):  # written before the stop was passed on
            raise KeyboardInterrupt
        dist.init_process_group(
            start.backend, store=store, rank=start.rank, world_size=start.world, timeout=timeout
        )
        result = fn(start.rank, start.world, *args)
        # Plain pickle: torch's multiprocessing pickler would share tensors through
        # this process, which exits right after sending.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:
        code = 1
        with contextlib.suppress(Exception):  # the parent is gone: nobody to tell
            conn.send_bytes(pickle.dumps(("error", _report(start.rank, exc))))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Every rank ends here, its result or error already sent.  Skip interpreter
        # teardown: a collective a dead peer never joined would block the process
        # group's destructor until its timeout, and a transport's waiter thread still
        # blocked on a c10d work makes a normal exit abort.
        os._exit(code)


def _set_signals(start: RankStart) -> None:
    """SIGINT and SIGTERM as a rank spawned by the launcher would have them."""
    signal.signal(
        signal.SIGINT, signal.default_int_handler if start.hears_sigint else signal.SIG_IGN
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL if start.hears_sigterm else signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked while the fork server started
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _set_environment(start: RankStart) -> None:
    os.environ.clear()  # the launcher's environment at this launch, not the fork server's
    os.environ.update(start.environ)
    os.environ.update(
        RANK=str(start.rank),
        WORLD_SIZE=str(start.world),
        LOCAL_RANK=str(start.rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(start.port),
    )


def _report(rank: int, exc: BaseException) -> dict[str, Any]:
    """What the launcher is told of a rank's error."""
    origin = failure_origin(exc)
    # zeropipe's own errors say what they are; anything else is named by its type.
    text = str(exc) if isinstance(exc, ZeropipeError) else f"{type(exc).__name__}: {exc}"
    return {
        "message": text,
        "traceback": "".join(traceback.format_exception(exc)),
        "origin": rank if origin is None else origin,
        "died": False,
        "interrupted": isinstance(exc, KeyboardInterrupt),
        # Raised on purpose with the whole story (a bad setting, a corrupt file), as
        # opposed to a failed run or a bug, whose traceback helps.
        "user": isinstance(exc, ZeropipeError) and not isinstance(exc, RuntimeError),
    }


def _end_with_parent(parent: int, lifeline: Connection) -> None:
    """End this process as soon as the launcher (pid ``parent``) is gone.

    The launcher hosts the rendezvous store: without it this rank can only
    fail, and it would do so at its next store access, through C++ warnings
    with stack traces, or train on until then.  Ended silently: nobody is
    left to report to, and the launcher's own end is what the user saw.

    A rank forked by the fork server is the server's child, and the server
    lives as long as any process it forked: there only the lifeline tells.
    """
    if os.getppid() == parent and _kill_with_parent():
        if os.getppid() != parent:  # it died before the request was made
            os._exit(1)
        lifeline.close()  # the kernel watches instead
        return
    threading.Thread(
        target=wait_for_eof, args=(lifeline,), name="zeropipe-launcher-watch", daemon=True
    ).start()


def _kill_with_parent() -> bool:
    """Linux: ask the kernel to SIGKILL this process when its parent ends; False elsewhere.

    A signal from the kernel ends the process even while it is blocked in C++
    (a collective, a store call) and before a store call that the parent's
    end fails has printed anything.  It follows the parent *thread* that
    started the process: the one running ``launch``, alive until the ranks
    have finished.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # no libc symbol table to read, or no prctl in it
        return False


def wait_for_eof(lifeline: Connection) -> None:
    """The launcher never writes to ``lifeline``; EOF means it ended: end this process."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(1)
