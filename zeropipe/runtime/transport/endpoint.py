"""torch.distributed works in flight, waited on without ever hanging.

gloo's point-to-point works never report ``is_completed()``, and a timed-out
``wait(timeout)`` tears the connection down.  So each pending receive, send
or collective is waited on by a (pooled) helper thread, and the caller waits
on that thread's event in slices, looking for failed peers in between::

    Endpoint.post / call     -> a Work (a dead peer makes gloo refuse at once)
    Endpoint.pending(works)  -> Pending: a WaitPool thread calls work.wait() on each
    Endpoint.wait(pending)   -> slices of _CHECK_EVERY s; between them PeerFailures.check
                                (and, once stalled, Agreement.stalled);
                                past ``timeout`` s: PipelineError naming what and whom

:class:`Endpoint` is one rank's end of the process group, shared by the
point-to-point transfers (:mod:`zeropipe.runtime.transport.tagged`) and the
step-end collectives (:mod:`zeropipe.runtime.replicas.collectives`).  A pipeline's
endpoint has an :class:`Agreement`: whether its peers are in its step, with
its batch (see :mod:`zeropipe.runtime.transport.wire`).

A failed step leaves pool threads blocked in ``Work.wait()`` on transfers a
peer will never complete, and such a thread aborts the process ("terminate
called without an active exception", seen with torch 2.13 on Python 3.11)
if it wakes while the interpreter finalizes: on its way back from C++ it
re-takes the GIL, and a finalizing interpreter ends the thread there by
unwinding a stack that cannot be unwound.  It wakes when the peer's process
ends and its connections close.  So at exit::

    no wait blocked              -> a normal exit
    this rank failed on its own  -> flush, os._exit(1) at once: its error is printed,
                                    its peers learn of it from the store
    it relays a peer's failure   -> wait (bounded) for the failed peer's process to end,
                                    which fails the blocked waits, plus a moment, then
                                    exit normally: a supervisor polling the processes
                                    (torchrun) sees the cause end first and names it
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from zeropipe.base import _compat
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.transport.failures import PeerFailures, failure_origin
from zeropipe.runtime.transport.wire import ASK_AFTER_S, Agreement

__all__ = ["Endpoint", "Label", "Pending", "WaitPool", "connect"]

# How often a waiting rank looks at the store for a peer's failure (seconds).
_CHECK_EVERY = 0.02
# How often the end of a step on an accelerator polls its operations for completion (seconds).
_POLL_S = 0.0002
# At exit, how long a rank relaying a peer's failure waits for that peer's process to
# end (it ends its own blocked waits), and how long it then stays: longer than
# torchrun's default 0.1 s poll, so that torchrun sees the cause end alone.
_EXIT_WAIT_S = 5.0
_EXIT_AFTER_PEER_S = 1.0

Label = tuple[str, int | None]
"""What a work is (for messages) and the peer rank it involves (None: a collective)."""


class WaitPool:
    """Daemon threads that block in ``Work.wait()`` for the polling thread, reused.

    A job goes to an idle thread or, when none is idle, to a new one, so a wait
    that completes late never delays another.  Reusing threads matters: starting
    one per operation costs milliseconds of latency per transfer on a busy host.
    Daemon threads, because one may stay blocked on a transfer that a failed
    peer never completes.  Idle threads end after a while, and all of them on
    :meth:`close` (the transport's finalizer, also run at interpreter exit): a
    thread that has waited on a c10d work and is still alive when the process
    exits makes it abort (torch 2.13).

    Invariant: jobs queued + ``_idle`` == threads blocked in ``get``.

    Args:
        failures: whether this rank failed on its own or relays a peer's
            failure, which decides how the process exits with waits still
            blocked (see the module's docstring).
    """

    _IDLE_EXIT_S = 10.0

    def __init__(self, failures: PeerFailures | None = None) -> None:
        self.failures = failures
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._busy = 0  # jobs submitted and not finished: waits possibly blocked in c10d
        self._threads: set[threading.Thread] = set()
        self._running: set[threading.Thread] = set()  # threads inside a job: a wait
        _POOLS.add(self)

    @property
    def busy(self) -> int:
        """Waits submitted and not finished yet."""
        with self._lock:
            return self._busy

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._busy += 1
            if self._idle:
                self._idle -= 1  # a thread blocked in get() takes this job
                self._jobs.put(job)
                return
            thread = threading.Thread(
                target=self._work, args=(job,), name="zeropipe-wait", daemon=True
            )
            self._threads.add(thread)
        thread.start()

    def _work(self, job: Callable[[], None] | None) -> None:
        try:
            me = threading.current_thread()
            while job is not None:
                with self._lock:
                    self._running.add(me)
                try:
                    job()
                finally:
                    # Drop the finished job (and the works it holds) before idling.
                    job = None
                    with self._lock:
                        self._running.discard(me)
                        self._busy -= 1
                        self._idle += 1
                while job is None:
                    try:
                        job = self._jobs.get(timeout=self._IDLE_EXIT_S)
                        break  # a job, or None from close()
                    except queue.Empty:
                        with self._lock:
                            if self._idle:  # nothing is queued for this thread
                                self._idle -= 1
                                return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """End the idle threads now (busy ones end once their wait returns: joining one
        blocked on a failed peer's transfer would only wait out the time limit)."""
        with self._lock:
            count, self._idle = self._idle, 0
            threads = list(self._threads - self._running)
        for _ in range(count):
            self._jobs.put(None)
        deadline = time.monotonic() + 1.0
        for thread in threads:
            if thread is not threading.current_thread():  # a finalizer may run anywhere
                thread.join(max(0.0, deadline - time.monotonic()))


# Every pool alive, for the exit below; a pool lives as long as one of its threads.
_POOLS: weakref.WeakSet[WaitPool] = weakref.WeakSet()


def _exit_with_blocked_waits() -> None:
    """At interpreter exit: make sure no pool thread wakes from a c10d wait during finalization."""
    blocked = [pool for pool in list(_POOLS) if pool.busy]
    if not blocked:
        return
    if all(pool.failures is not None and pool.failures.peer_failed for pool in blocked):
        deadline = time.monotonic() + _EXIT_WAIT_S
        while any(pool.busy for pool in blocked) and time.monotonic() < deadline:
            time.sleep(_CHECK_EVERY)
        if not any(pool.busy for pool in blocked):
            time.sleep(_EXIT_AFTER_PEER_S)
            return
    # The error is already printed (an uncaught exception is, before atexit runs); the
    # status cannot be read here, and waits left blocked mean a step failed: 1.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # none, closed, broken
            stream.flush()
    os._exit(1)


atexit.register(_exit_with_blocked_waits)


class Pending:
    """Works in flight, waited on without blocking the caller past a slice.

    From the first :meth:`finished` on, a pool thread calls ``wait()`` on each
    work in turn (gloo point-to-point works never report completion otherwise,
    and for collectives it wakes the caller sooner than polling
    ``is_completed()`` with backoff) and releases a lock the caller waits on in
    slices (a bare lock, the cheapest hand-over, on the critical path of every
    transfer).  Not before: a thread blocked from the post on would wake when
    the data lands, whatever this rank is computing then, and take the GIL
    from it.  ``labels`` say, per work, what it is and which peer it involves.
    """

    def __init__(self, works: list[Any], labels: list[Label], pool: WaitPool) -> None:
        self.works, self.labels = works, labels
        self.error: BaseException | None = None
        self.at = 0  # index of the work being waited on
        self._done = threading.Lock()  # held until every work is done
        self._finished = not works
        self._pool: WaitPool | None = None
        if works:
            self._done.acquire()
            self._pool = pool  # handed to a pool thread when first waited on

    def _wait_all(self) -> None:
        try:
            for k, work in enumerate(self.works):
                self.at = k
                work.wait()
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self._done.release()

    def finished(self, slice_s: float) -> bool:
        """Wait at most ``slice_s`` seconds; True once every work is done (or one failed)."""
        if self._pool is not None:
            self._pool.submit(self._wait_all)
            self._pool = None
        if not self._finished:
            got = self._done.acquire(timeout=slice_s) if slice_s > 0 else self._done.acquire(False)
            self._finished = got
        return self._finished

    def label(self) -> Label:
        return self.labels[min(self.at, len(self.labels) - 1)]


class Endpoint:
    """One rank's end of a process group: posts operations and waits on them, bounded.

    Args:
        rank: this process's rank in ``group``.
        group: the process group (None: the world).
        failures: where peers' failures are looked up while waiting.
        timeout: seconds any single wait may last before the step fails
            (an attribute: it may be changed between steps).
    """

    def __init__(
        self, rank: int, group: Any | None, failures: PeerFailures, timeout: float
    ) -> None:
        self.rank, self.group, self.failures, self.timeout = rank, group, failures, timeout
        # Asked by waits that stall whether the peers are in this rank's step (a pipeline's
        # transport has one; the data-parallel group's endpoint has none).
        self.agreement: Agreement | None = None
        self.world = dist.get_world_size(group)
        self._group = group if group is not None else dist.group.WORLD  # what posts go through
        self._global = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.world)
        ]
        self.pool = WaitPool(failures)  # gloo p2p works only complete through wait()

    def usable(self) -> None:
        """Raise if a failure already broke this pipeline's transport (every transfer asks)."""
        if self.failures.broken is not None:
            raise PipelineError(
                f"this pipeline's distributed transport failed earlier "
                f"({self.failures.broken}); its ranks are out of step: build a new Pipeline"
            )

    def global_rank(self, peer: int) -> int:
        """The world rank of ``peer``, a rank of this endpoint's group."""
        return self._global[peer]

    def send(self, tensor: Tensor, peer: int, tag: int, what: str) -> Any:
        """Post a send of ``tensor`` (contiguous) to ``peer`` (a group rank); its work."""
        group = self._group
        return self.call(lambda: _compat.p2p_send(group, tensor, peer, tag), what, peer)

    def recv(self, tensor: Tensor, peer: int, tag: int, what: str) -> Any:
        """Post a receive into ``tensor`` (contiguous) from ``peer`` (a group rank); its work."""
        group = self._group
        return self.call(lambda: _compat.p2p_recv(group, tensor, peer, tag), what, peer)

    def call(self, fn: Callable[[], Any], what: str, peer: int | None = None) -> Any:
        """Post an operation; a dead peer makes gloo refuse at once: say who and why."""
        try:
            return fn()
        except PipelineError:
            raise
        except Exception as exc:
            raise self._peer_error(exc, what, peer) from exc

    def _peer_error(self, exc: BaseException, what: str, peer: int | None) -> PipelineError:
        """The error for ``exc`` from torch.distributed; a lost peer's says which step it left."""
        err = self.failures.error(exc, what, peer)
        if self.agreement is not None and peer is not None and failure_origin(err) == peer:
            # The same error object: the failure record made for it stays this one's.
            err.args = (f"{err}{self.agreement.lost_note(peer)}",)
        return err

    def pending(self, works: list[Any], labels: list[Label]) -> Pending:
        """Start waiting on ``works`` in the pool (``labels``: one per work)."""
        return Pending(works, labels, self.pool)

    def wait(self, pending: Pending) -> None:
        """Wait for ``pending``, failing on a peer's error, a lost peer, or the timeout."""
        start = time.monotonic()
        deadline = start + self.timeout
        next_check = start + _CHECK_EVERY
        while not pending.finished(min(_CHECK_EVERY, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= next_check:
                self.failures.check()
                if self.agreement is not None and now - start >= ASK_AFTER_S:
                    self.agreement.stalled(pending.label()[1])
                next_check = now + _CHECK_EVERY
            if now >= deadline:
                self.failures.check()
                what, peer = pending.label()
                source = f" from rank {peer}" if peer is not None and " from " not in what else ""
                raise PipelineError(
                    f"rank {self.rank} waited {self.timeout:g} s for {what}{source} (timeout); "
                    f"a peer is stuck or slow, or the ranks run different schedules"
                )
        if pending.error is not None:
            what, peer = pending.label()
            raise self._peer_error(pending.error, what, peer)

    def wait_polled(self, works: list[Any], labels: list[Label]) -> None:
        """Wait for ``works`` by polling ``is_completed()`` (NCCL: no thread blocks in them).

        On a peer's failure or past the timeout the group's communicator is
        aborted first: an NCCL operation whose peer is gone never completes,
        and a process cannot exit while one is pending.
        """
        start = time.monotonic()
        deadline = start + self.timeout
        next_check = start + _CHECK_EVERY
        for work, (what, peer) in zip(works, labels, strict=True):
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_check:  # the store is asked at its own pace, not every poll
                    next_check = now + _CHECK_EVERY
                    try:
                        self.failures.check()
                        if self.agreement is not None and now - start >= ASK_AFTER_S:
                            self.agreement.stalled(peer)
                    except PipelineError:
                        _compat.abort_group(self.group)
                        raise
                if now >= deadline:
                    _compat.abort_group(self.group)
                    source = (
                        f" from rank {peer}" if peer is not None and " from " not in what else ""
                    )
                    raise PipelineError(
                        f"rank {self.rank} waited {self.timeout:g} s for {what}{source} "
                        f"(timeout); a peer is stuck or slow, or the ranks run different "
                        f"schedules; the communicator was aborted"
                    )
                time.sleep(_POLL_S)


def connect(rank: int, group: Any | None, timeout: float, *, agree: bool = False) -> Endpoint:
    """This rank's :class:`Endpoint` for a new pipeline on ``group`` (numbered in the store).

    ``agree``: give it an :class:`Agreement` (a pipeline's transport, whose ranks share steps).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PipelineError("a distributed transport needs torch.distributed initialised")
    if timeout <= 0:
        raise PipelineError(f"timeout must be positive, got {timeout}")
    name = str(getattr(group, "group_name", "world")) if group is not None else "world"
    store = _compat.rendezvous_store()
    failures = PeerFailures(rank, store, name, world_rank=dist.get_rank())
    endpoint = Endpoint(rank, group, failures, float(timeout))
    if agree:
        key = f"zeropipe/{name}/pipeline{failures.number}/agreement"
        endpoint.agreement = Agreement(rank, store, key, failures)
    weakref.finalize(endpoint, endpoint.pool.close)
    return endpoint
