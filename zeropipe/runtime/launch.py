"""Start a distributed pipeline: start one process per rank, or join one started by torchrun.

    def train(rank, world, steps):
        pipe = Pipeline(model(), "zbv", microbatches=8, loss_fn=F.mse_loss)
        ...
        return losses                       # picklable: comes back to the caller

    losses_per_rank = launch(train, 4, 100)  # 4 processes, gloo on CPU

The ranks are forked from a server process that imported torch and zeropipe once
(``multiprocessing``'s fork server; ``spawn`` where there is none): a launch
after the first starts its ranks in milliseconds, not a torch import each.  A
rank shares nothing with the launcher but what is pickled to it: ``fn``, its
arguments and the launcher's environment variables
(:mod:`zeropipe.runtime.rank_process`: a rank's side of all this).

The parent hosts the rendezvous store (a TCPStore on a free port of
127.0.0.1) and watches its children::

    child raises      -> its formatted error is sent back; the rest get `grace`
                         seconds to finish or fail in turn, then are terminated
    child dies        -> same, with "rank r was killed by ..." as its error
    either way        -> the error goes to the store too, so that peers still
                         waiting for the failed rank fail at once
    overall timeout   -> everything is killed, and the error says so

and raises one :class:`PipelineError` naming the rank where the failure
started, with the other ranks' errors beneath (a :class:`ZeropipeError` that
every rank raised alike, such as a bad setting, is reported once, as its own
line).  Stopping it::

    SIGINT / SIGTERM  -> passed on to every rank still running (a terminal's
                         Ctrl-C reaches them anyway: it signals the whole
                         process group); the launcher waits up to `stop_wait`
                         seconds for them.  Ranks that handle it (finish their
                         step, save, return) have their results returned as
                         usual; ranks that it ends make the launch raise
                         KeyboardInterrupt
    a second signal   -> every rank is killed at once; KeyboardInterrupt
    while ranks start -> they start deaf to SIGINT (their imports would end in
                         tracebacks) and, once listening, end quietly, before
                         `fn` runs, on a stop that came meanwhile

A SIGINT that the launcher ignores (a background job of a non-interactive
shell, under POSIX) stays ignored, here and, inherited, in the ranks.  The
children watch the
parent in turn: when the launcher dies (killed, or ended by a job
scheduler) the rendezvous store dies with it, so they end at once, silently,
instead of training on until the lost store fails them with C++ stack traces
(a thread sees the launcher's end of a pipe close; a rank that is the
launcher's own child, under ``spawn`` on Linux, is killed by the kernel with it,
``PR_SET_PDEATHSIG``).

Under torchrun, call :func:`init_from_env` instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from zeropipe.base import _compat
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.rank_process import STOP_KEY, RankStart, run_rank, start_method
from zeropipe.runtime.transport.failures import FAILED_KEY

__all__ = ["SAME_STOP_S", "init_from_env", "launch"]

# A second SIGINT/SIGTERM within this many seconds of the first is the same stop: `timeout`
# or a shell relaying a signal to the group delivers it twice at once, and reading that as
# "send it again to end them at once" would kill the ranks before they save.
SAME_STOP_S = 0.3


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads: int = 1,
    grace: float = 5.0,
    stop_wait: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` fresh processes; return the results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); each
    process has torch.distributed initialised (``backend``, store on a free
    local port, ``timeout`` for its collectives) and ``threads`` intra-op
    threads.  ``timeout`` also bounds the whole launch.  Raises
    :class:`PipelineError` if any rank raises or dies.  SIGINT or SIGTERM
    while it runs is passed on to the ranks, which get ``stop_wait`` seconds
    to return (see the module's docstring); a second one ends them at once.
    """
    if nprocs < 1:
        raise PipelineError(f"nprocs must be >= 1, got {nprocs}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise PipelineError(f"launch: timeout must be positive (seconds, > 0), got {timeout}")
    for name, value in (("grace", grace), ("stop_wait", stop_wait)):
        if not (value >= 0 and math.isfinite(value)):
            raise PipelineError(f"launch: {name} must be a number of seconds >= 0, got {value}")
    # Port 0: the OS picks a free port; the store keeps it bound, so no race.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    ctx = start_method()
    procs: list[Any] = []
    conns: list[Connection] = []
    lifelines: list[Connection] = []
    stop = _StopSignals(procs, stop_wait, store)
    try:
        where = (nprocs, store.port, backend, timeout, threads, os.getpid())
        base = RankStart(0, *where, deaf=False, **_dispositions(), environ={})
        # A rank forked by the fork server starts deaf to SIGINT (the server ignores it),
        # so this process keeps hearing it while they start; spawned ranks need it ignored here.
        forked = ctx.get_start_method() == "forkserver"
        deafness = contextlib.nullcontext(base.hears_sigint) if forked else _deaf_to_sigint()
        with deafness as deaf:
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                # Never written to: the child's end reads EOF once this process has ended.
                watched, lifeline = ctx.Pipe(duplex=False)
                start = replace(base, rank=rank, deaf=deaf, environ=dict(os.environ))
                proc = ctx.Process(
                    target=run_rank,
                    args=(start, fn, args, writer, watched),
                    name=f"zeropipe-rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()
                watched.close()
                procs.append(proc)
                conns.append(reader)
                lifelines.append(lifeline)
        return _watch(procs, conns, store, timeout, grace, stop)
    finally:
        stop.restore()
        # Killed, not terminated: a rank that stops cleanly on SIGTERM would take a
        # step and a save to end, and the launch is over.
        _kill_all(procs)
        for conn in (*conns, *lifelines):
            conn.close()
        stop.close()


def _dispositions() -> dict[str, Any]:
    """What a rank does on SIGINT and SIGTERM, set in the rank: one forked by the fork
    server inherits the server's dispositions, not this process's."""
    return {
        "hears_sigint": signal.getsignal(signal.SIGINT) is not signal.SIG_IGN,
        "hears_sigterm": signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN,
    }


def init_from_env(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; return ``(rank, world)``.

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK.  The
    default backend is gloo on CPU, NCCL when this process has a GPU (the one
    numbered LOCAL_RANK is made current).  Already initialised: returns the
    existing rank and world size.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise PipelineError(
            f"init_from_env needs {', '.join(missing)} in the environment: start the script "
            f"with torchrun (python -m torch.distributed.run --nproc-per-node N script.py), "
            f"or use zeropipe.launch"
        )
    try:
        rank, world, local = (int(os.environ[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as exc:
        raise PipelineError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {exc}") from None
    device = _compat.bind_device(local)
    dist.init_process_group(
        backend or _compat.default_backend(device),
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    return rank, world


# -- the parent side ---------------------------------------------------------------
def _watch(
    procs: list[Any],
    conns: list[Connection],
    store: Any,
    timeout: float,
    grace: float,
    stop: _StopSignals,
) -> list[Any]:
    n = len(procs)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, dict[str, Any]] = {}  # rank -> report, in order of arrival
    reported: set[int] = set()
    first_failure: float | None = None
    told = False  # the cause is in the store
    live_conns = dict(enumerate(conns))
    live_procs = dict(enumerate(procs))
    while len(reported) < n:
        now = time.monotonic()
        if now >= deadline:
            running = sorted(set(range(n)) - reported)
            _kill_all(procs)
            raise PipelineError(
                f"launch timed out after {timeout:g} s; rank(s) {running} still running were "
                f"killed" + _beneath(failures)
            )
        if stop.at is not None and now >= stop.at + stop.wait_s:
            running = sorted(set(range(n)) - reported)
            _kill_all(procs)
            raise PipelineError(
                f"rank(s) {running} had not stopped {stop.wait_s:g} s after {stop.name} and "
                f"were killed; whatever they had not saved is lost" + _beneath(failures)
            )
        if first_failure is not None and now >= first_failure + grace:
            break
        limit = deadline if first_failure is None else min(deadline, first_failure + grace)
        if stop.at is not None:
            limit = min(limit, stop.at + stop.wait_s)
        ready = wait(
            [*live_conns.values(), *(p.sentinel for p in live_procs.values()), stop.wakeup],
            limit - now,
        )
        if stop.wakeup in ready:
            stop.drain()
        for rank, conn in list(live_conns.items()):
            if conn in ready or conn.poll():
                _receive(rank, conn, results, failures, reported)
                del live_conns[rank]
        for rank, proc in list(live_procs.items()):
            if proc.sentinel not in ready and proc.is_alive():
                continue
            del live_procs[rank]
            unread = live_conns.pop(rank) if rank in live_conns else None
            if unread is not None and unread.poll():
                _receive(rank, unread, results, failures, reported)
            if rank not in reported:
                proc.join(1)
                failures[rank] = _died(rank, proc.exitcode, stop.signum)
                reported.add(rank)
        if failures and first_failure is None:
            first_failure = time.monotonic()
        if failures and not told:
            told = _tell_store(store, failures)
    if failures:
        _kill_all(procs)
        if stop.signum is not None and failures[_cause(failures)]["interrupted"]:
            raise KeyboardInterrupt  # the ranks did not handle the stop: it ended them
        unfinished = sorted(set(range(n)) - reported)
        raise _launch_error(failures, unfinished, grace, n)
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))  # they exit right after reporting
    return [results[r] for r in range(n)]


def _receive(
    rank: int,
    conn: Connection,
    results: dict[int, Any],
    failures: dict[int, dict[str, Any]],
    reported: set[int],
) -> None:
    try:
        status, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # closed without a report: the process died; its sentinel says how
    reported.add(rank)
    if status == "ok":
        results[rank] = payload
    else:
        failures[rank] = payload


def _died(rank: int, code: int | None, stop: int | None) -> dict[str, Any]:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    message = f"rank {rank} {how}"
    interrupted = stop is not None and code == -stop  # the signal passed on ended it
    return {
        "message": message,
        "traceback": "",
        "origin": rank,
        "died": True,
        "interrupted": interrupted,
        "user": False,
    }


def _tell_store(store: Any, failures: dict[int, dict[str, Any]]) -> bool:
    """Let the other ranks' waits fail now rather than at their timeout or the grace's end."""
    rank = _cause(failures)
    report = failures[rank]
    if report["origin"] != rank:
        return False  # only relays so far: the ranks learnt it from each other
    suffix = " (the launcher saw it die)" if report["died"] else ""
    record = {"rank": rank, "message": report["message"] + suffix, "lost": report["died"]}
    # The ranks passed a client of this very store to init_process_group, which
    # uses it as the rendezvous store their transports poll.
    with contextlib.suppress(Exception):  # best effort: peers also see dropped connections
        store.set(FAILED_KEY, json.dumps(record))
    return True


def _cause(failures: dict[int, dict[str, Any]]) -> int:
    """The rank that failed on its own (not relaying a peer's failure), earliest first."""
    order = list(failures)
    return next((r for r in order if failures[r]["origin"] in (None, r)), order[0])


def _launch_error(
    failures: dict[int, dict[str, Any]], unfinished: list[int], grace: float, world: int
) -> PipelineError:
    cause = _cause(failures)
    report = failures[cause]
    if report["user"]:
        # An error raised on purpose says all there is to say: its traceback would
        # only bury it, and ranks that raised it too, or relay it, would repeat it.
        others = {
            r: f
            for r, f in failures.items()
            if r != cause and f["origin"] != cause and f["message"] != report["message"]
        }
        if not others and not unfinished and len(failures) == world:
            return PipelineError(report["message"])  # every rank alike: a setting, say
        text = f"rank {cause} failed: {report['message']}"
    else:
        text = f"rank {cause} failed: {report['message']}"
        if report["traceback"]:
            text += f"\n\n--- rank {cause} traceback ---\n{report['traceback'].rstrip()}"
        others = {r: f for r, f in failures.items() if r != cause}
    text += _beneath(others)
    if unfinished:
        text += (
            f"\nrank(s) {unfinished} had not finished {grace:g} s after the failure and were "
            f"terminated"
        )
    return PipelineError(text)


def _beneath(failures: dict[int, dict[str, Any]]) -> str:
    if not failures:
        return ""
    lines = [f"  rank {r}: {f['message']}" for r, f in sorted(failures.items())]
    return "\n--- other ranks ---\n" + "\n".join(lines)


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(2)


class _StopSignals:
    """SIGINT and SIGTERM while the ranks run: passed on to them once; a second one aborts.

    Installed only from the main thread (Python's rule for signal handlers),
    and not for a SIGINT this process ignores.  The handler writes to a pipe
    that :func:`_watch` waits on, so the stop's deadline starts counting at
    once rather than when the next rank reports.
    """

    def __init__(self, procs: list[Any], wait_s: float, store: Any = None) -> None:
        self.procs = procs  # filled as they start: a signal reaches those started
        self.wait_s = wait_s
        self.store = store  # told of the stop, for ranks still starting (_deaf_to_sigint)
        self.signum: int | None = None
        self.name = ""
        self.at: float | None = None
        self.wakeup, self._poke = os.pipe()
        os.set_blocking(self._poke, False)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            if self.at is not None and time.monotonic() - self.at < SAME_STOP_S:
                return  # the same stop twice: a wrapper (timeout, a shell) relayed it too
            raise KeyboardInterrupt  # again: end every rank now (launch's finally kills them)
        self.signum, self.at = signum, time.monotonic()
        self.name = signal.Signals(signum).name
        if self.store is not None:  # before the ranks are signalled: see _deaf_to_sigint
            with contextlib.suppress(Exception):
                self.store.set(STOP_KEY, self.name)
        for proc in self.procs:
            # A terminal's Ctrl-C has reached the ranks already; a second one is harmless
            # to a rank that stops on it, and a SIGTERM sent to the launcher alone is not.
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signum)
        with contextlib.suppress(OSError, ValueError):  # no stderr left to tell
            print(
                f"zeropipe: {self.name}: waiting up to {self.wait_s:g} s for the ranks to stop; "
                f"send it again (or Ctrl-C) to end them at once",
                file=sys.stderr,
                flush=True,
            )
        with contextlib.suppress(OSError):
            os.write(self._poke, b"!")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self.wakeup, 64)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def close(self) -> None:
        for fd in (self.wakeup, self._poke):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def _deaf_to_sigint() -> Iterator[bool]:
    """Start spawned ranks deaf to SIGINT; yields whether they are (each then hears it again).

    A spawned rank's first seconds (its interpreter, the main module, torch) run before
    :func:`~zeropipe.runtime.rank_process.run_rank` can catch anything, and a Ctrl-C
    there would end each rank with a traceback of the import it interrupted.  A rank
    inherits an ignored SIGINT, so SIGINT is ignored here while the ranks start,
    milliseconds, and blocked in this thread meanwhile, so that a Ctrl-C that this
    thread takes waits (Linux keeps a blocked signal pending even while ignored); one
    that another thread of this process takes then is lost.  Each rank hears it again
    first thing and then reads :data:`STOP_KEY`, which :class:`_StopSignals` writes
    before passing a stop on: a stop it missed while deaf ends it there, quietly.  Not
    from another thread (signal handlers are the main thread's), nor where SIGINT is
    ignored already (it stays so, in the ranks too).  Ranks forked by the fork server
    start deaf without it: the server ignores SIGINT.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield False
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):  # ignored, or a handler Python did not install
        yield False
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
