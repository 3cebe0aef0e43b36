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
    Endpoint.wait(pending, landing=address)
                             -> a receive whose data lands within 50 us (``_compat.landed``):
                                ``wait()`` on the calling thread, which returns at once

:class:`Endpoint` is one rank's end of the process group, shared by the
point-to-point transfers (:mod:`zeropipe.runtime.transport.tagged`), the
data-parallel sums (:mod:`zeropipe.runtime.replicas.data_parallel`) and what a
pipeline's ranks do together at the end of a step (below).  A pipeline's
endpoint has an :class:`Agreement`: whether its peers are in its step, with
its batch (see :mod:`zeropipe.runtime.transport.wire`).

A pool thread still blocked in a wait when the process exits is handled by
:func:`zeropipe.runtime.transport.failures.watch_at_exit`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeropipe.base import _compat
from zeropipe.base.storage import local_tensor
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.transport.failures import PeerFailures, failure_origin, watch_at_exit
from zeropipe.runtime.transport.wire import ASK_AFTER_S, DTYPES, Agreement, dtype_code

__all__ = [
    "Endpoint",
    "Heard",
    "Label",
    "Pending",
    "WaitPool",
    "all_reduce",
    "barrier",
    "connect",
    "flatten",
    "post_barrier",
    "unflatten",
]

# How often a waiting rank looks at the store for a peer's failure (seconds).
_CHECK_EVERY = 0.02
# How often the end of a step on an accelerator polls its operations for completion (seconds).
_POLL_S = 0.0002
# How long closing a pool waits for its idle threads to end: one still alive when the
# interpreter finalizes aborts the process, so a loaded host's threads get time to end.
_CLOSE_WAIT_S = 5.0

# How long a wait for a receive looks for its data landing before it hands the wait to a
# pool thread (whose wake-ups, there and back, cost more on a busy host; see
# docs/benchmarks.md, seventh session).
_LANDING_SPIN_S = 50e-6
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _landed_soon(landing: int) -> bool:
    if _compat.landed(landing):
        return True  # the common case on a stage that waits least: no clock read
    end = time.perf_counter() + _LANDING_SPIN_S
    while time.perf_counter() < end:
        _yield()
        if _compat.landed(landing):
            return True
    return False


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
        watch_at_exit(self)

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
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for thread in threads:
            if thread is not threading.current_thread():  # a finalizer may run anywhere
                thread.join(max(0.0, deadline - time.monotonic()))


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

    def _wait_all(self, catching: type[BaseException] = BaseException) -> None:
        try:
            for k, work in enumerate(self.works):
                self.at = k
                work.wait()
        except catching as exc:  # handed to the waiting thread
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

    def wait_here(self) -> None:
        """Wait on the calling thread, for works whose data has arrived (``wait()`` returns at
        once): no hand-over to a pool thread and back, two wake-ups off the critical path."""
        self._pool = None
        self._wait_all(Exception)  # Ctrl-C here is the caller's, not a peer's failure


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

    def wait(self, pending: Pending, *, landing: int | None = None) -> None:
        """Wait for ``pending``, failing on a peer's error, a lost peer, or the timeout.

        ``landing``: where a receive's arrival shows (:func:`_compat.mark_landing`).  Data
        that lands within ``_LANDING_SPIN_S`` (or already has) is waited on by this thread
        (:meth:`Pending.wait_here`); each look yields the core, so the rank's own gloo I/O
        thread, which reads the message in, runs meanwhile.
        """
        if landing is not None and _landed_soon(landing):
            pending.wait_here()
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


# -- what the ranks of a group do together -----------------------------------------------
# The collectives of a step run only after :func:`barrier` says every rank finished its
# schedule, because a collective that a failed peer never joins cannot be cancelled, while
# the barrier's point-to-point receives are waited on like any other (bounded, watching
# for failed peers):
#
#     start_step:   the barrier's receives posted (gloo; NCCL posts them in the barrier)
#     finish_step:  barrier (carries the loss to every rank, and each rank's step number
#                   and batch fingerprint, checked by every rank that hears them)
#     after it:     all_reduce of the gradients of parameters shared across ranks

Heard = list[tuple[Tensor, Any, Label]]
"""A barrier's receives, posted: per round, (buffer, work, what it is and its source rank)."""

# A barrier's token: [loss known?, loss as float64, its dtype code, step, fingerprint].
_TOKEN = 5


def post_barrier(endpoint: Endpoint, tag: Callable[[int], int], device: torch.device) -> Heard:
    """Post the receives of the next :func:`barrier` (not batched), one per round.

    Posted when the step starts, a round's message from a peer that finished
    first is already here when this rank reaches the barrier: the rank that
    ends the step last then pays no round trip for it (over gloo, a message
    whose receive is not yet posted waits for the receiver's notice).
    """
    rank, w = endpoint.rank, endpoint.world
    heard: Heard = []
    for k in range((w - 1).bit_length()):
        src = (rank - (1 << k)) % w
        what = f"the end-of-step barrier (round {k}) from rank {src}"
        buf = torch.empty(_TOKEN, dtype=torch.float64, device=device)
        heard.append((buf, endpoint.recv(buf, src, tag(k), what), (what, src)))
    return heard


def barrier(
    endpoint: Endpoint,
    loss: Tensor | None,
    tag: Callable[[int], int],
    device: torch.device,
    *,
    batched: bool = False,
    heard: Heard | None = None,
    sent: tuple[list[Any], list[Label]] = ([], []),
) -> Tensor | None:
    """Every rank finished this step's schedule (so the collectives after it will be joined).

    A dissemination barrier of point-to-point messages: in round k each rank
    tells rank r + 2^k what it knows and hears from rank r - 2^k, so after
    ceil(log2 W) rounds each has heard, through the others, from all.  What
    travels is the step's loss, known at first only to the rank that owns
    the last stage, so the loss reaches every rank with no collective of its
    own.  The receives are waited on by the pool's threads like any other:
    they wake the caller as soon as the message lands (a barrier polled
    through the store woke up to a poll interval late, on the step's
    critical path), and a peer that dies leaves only a daemon thread
    behind, where a collective could not be given up.

    Each token also carries its sender's step number and batch fingerprint
    (when ``endpoint`` has an :class:`~zeropipe.runtime.transport.wire.Agreement`):
    every rank checks those it hears against its own, at no cost of its own.
    The rank that hears a mismatch fails, and the others hear of it.

    ``tag(k)`` is the tag of round k; returns the loss (None if no rank had one).
    ``batched``: each round's send and receive are one ``batch_isend_irecv``,
    issued only after the round before completed, for backends that match
    messages in issue order and let a posted receive hold back later
    operations (NCCL); otherwise every round's receive is posted up front:
    ``heard``, if :func:`post_barrier` posted them already, or here, and
    ``sent`` (the step's sends, with their labels) awaited with the first round.
    """
    agreement = endpoint.agreement
    stamp = (0, 0) if agreement is None else (agreement.stamp.step, agreement.stamp.fingerprint)
    # The loss as float64 is exact for every floating dtype; the fingerprint has 48 bits.
    known = torch.tensor([0.0, 0.0, 0.0, *stamp], dtype=torch.float64, device=device)
    have = loss is not None
    if loss is not None:
        code = dtype_code(loss.dtype)
        assert code is not None  # the caller checked
        known[0], known[1], known[2] = (1.0, loss.detach().double().reshape(()), code)
    if batched:
        known = _batched_rounds(endpoint, known, have, tag, device)
    else:
        heard = post_barrier(endpoint, tag, device) if heard is None else heard
        known = _posted_rounds(endpoint, known, have, tag, heard, sent)
    return _shared_loss(loss, known)


def _batched_rounds(
    endpoint: Endpoint, known: Tensor, have: bool, tag: Callable[[int], int], device: torch.device
) -> Tensor:
    """The barrier's rounds one ``batch_isend_irecv`` each, a round after the one before (NCCL);
    returns what this rank knows at the end (the loss's token, if a rank had one)."""
    rank, w = endpoint.rank, endpoint.world
    for k in range((w - 1).bit_length()):
        src, dst = (rank - (1 << k)) % w, (rank + (1 << k)) % w
        buf = torch.empty(_TOKEN, dtype=torch.float64, device=device)
        ops = [
            dist.P2POp(
                dist.isend, known.clone(), endpoint.global_rank(dst), endpoint.group, tag(k)
            ),
            dist.P2POp(dist.irecv, buf, endpoint.global_rank(src), endpoint.group, tag(k)),
        ]
        what = f"the end-of-step barrier (round {k}) with ranks {dst} and {src}"
        works = endpoint.call(partial(dist.batch_isend_irecv, ops), what, src)
        endpoint.wait(endpoint.pending(works, [(what, src)] * len(works)))
        if _heard_from(endpoint, src, buf) and not have:
            known, have = buf, True
    return known


def _posted_rounds(
    endpoint: Endpoint,
    known: Tensor,
    have: bool,
    tag: Callable[[int], int],
    heard: Heard,
    sent: tuple[list[Any], list[Label]],
) -> Tensor:
    """The barrier's rounds over receives posted earlier (``heard``), one wait per round, each
    handed to a pool thread: ``sent`` (the step's sends still in flight) joins the first
    round's, this rank's tokens the last round's; returns what this rank knows at the end."""
    works, labels = list(sent[0]), list(sent[1])
    told: list[Any] = []
    told_labels: list[Label] = []
    for k, (buf, work, label) in enumerate(heard):
        dst = (endpoint.rank + (1 << k)) % endpoint.world
        what = f"the end-of-step barrier (round {k}) to rank {dst}"
        token = known.clone()  # in flight while ``known`` may still change
        told.append(endpoint.send(token, dst, tag(k), what))
        told_labels.append((what, dst))
        works.append(work)
        labels.append(label)
        if k == len(heard) - 1:
            works += told
            labels += told_labels
        endpoint.wait(endpoint.pending(works, labels))
        works, labels = [], []
        if _heard_from(endpoint, int(label[1] or 0), buf) and not have:
            known, have = buf, True
    if works:  # no rounds (one rank): only the sends
        endpoint.wait(endpoint.pending(works, labels))
    return known


def _heard_from(endpoint: Endpoint, src: int, buf: Tensor) -> bool:
    """Check the token ``src`` sent against this rank's step; whether it carries the loss."""
    words = buf.tolist()  # one copy of the token to the host
    if endpoint.agreement is not None:
        endpoint.agreement.check(src, int(words[3]), int(words[4]))
    return bool(words[0] > 0)


def _shared_loss(loss: Tensor | None, known: Tensor) -> Tensor | None:
    if loss is not None or known[0] == 0:
        return loss
    return known[1].to(DTYPES[int(known[2].item())])


def flatten(tensors: Sequence[Tensor]) -> list[tuple[list[Tensor], Tensor]]:
    """``tensors`` grouped by (dtype, device), each group with one flat copy of it.

    A DTensor (a tensor-parallel gradient) takes part as its local shard: the
    peers of a data-parallel or pipeline group hold the same shard of it.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in map(local_tensor, tensors):
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(ts, torch.cat([t.reshape(-1) for t in ts])) for ts in groups.values()]


def unflatten(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy ``flat`` back into ``tensors``, the group it was made from by :func:`flatten`."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce(
    endpoint: Endpoint,
    tensors: Sequence[Tensor],
    what: str = "the all-reduce of shared parameters' gradients",
) -> None:
    """Sum ``tensors`` over the group in place, one flat all-reduce per (dtype, device)."""
    for ts, flat in flatten(tensors):
        work = endpoint.call(
            partial(dist.all_reduce, flat, group=endpoint.group, async_op=True), what
        )
        endpoint.wait(endpoint.pending([work], [(what, None)]))
        unflatten(ts, flat)
