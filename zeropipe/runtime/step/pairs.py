"""Overlapped pairs run at once: a forward and a backward of one rank side by side.

A schedule's overlapped pair (``Schedule.overlaps``, written ``(0F3;3B1)``) is a
forward of one stage and a backward (B or I) of another, adjacent on one rank.
With ``RuntimeOptions(overlap=True)`` the executor hands such a pair to
:func:`run_pair`: the backward runs on a worker thread while the forward runs
on the calling thread, so that what one half waits for (a received tensor, an
all-to-all) is waited for while the other half computes.  The worker is one thread per
pipeline, kept for its life (:class:`PairWorker`, a part of the pipeline), not one per
pair: what torch keeps per thread, DTensor's sharding-propagation cache above all, stays
warm::

    calling thread:  |--- F(a, j): wait for its input ... compute ---|
    worker thread:   |--- B(b, k): wait for its gradient ... compute ---|   waited for

Both halves run their ordinary handlers (the one dispatch table).  What they share
is made safe this way:

- the memory manager is reached through :class:`_Locked`, which runs each call under
  a lock (the ledger's counters are read-modify-write), the backward's release of its
  saved bytes counted after the pair (:class:`_Ledger`), and the transport through
  :class:`_PairTransport`: its posts under a lock (a transport is not written for two
  threads), its sends never blocking the thread that sends, and on the tagged
  transport (gloo's default) the two halves' receive waits at once.  The schedule's
  dependency model guarantees that neither half's input depends on the other half's
  output (a pair starts when the inputs of both are ready), so a wait always ends;
- each half gets its own copy of the :class:`StepContext` (the same stages, losses,
  memory and transport, its own blocked-time counters), whose waits are added to the
  step's once both halves are done, so each half's event counts its own wait;
- collectives inside a stage (tensor parallelism, expert parallelism's all-to-all) must
  be issued in one order on every rank of their group: a pair whose two stages both
  hold ``DTensor`` parameters (:func:`communicates_inside`) runs one half after the
  other, unless those parameters belong to modules whose forward and backward issue
  their collectives on two groups (``collectives_split_by_direction``: expert
  parallelism's all-to-alls), where each group sees one thread, in schedule order;
- per-microbatch state lives per stage and per microbatch, and the two halves touch
  different (stage, microbatch) entries; gradients are written by the backward alone,
  in the order a sequential run writes them, so they are bitwise those of the pair
  run one half after the other;
- randomness: the forward seeds the global generator per layer and draws right after
  (``runtime/step/stage.py``) on the calling thread; a backward draws nothing, unless
  its stage recomputes with ``torch.utils.checkpoint`` inside it, which restores and
  draws from the global generator.  A stage with Hugging Face's gradient
  checkpointing on is found (:func:`recomputes_in_backward`) and its backward's pairs
  run one half after the other; a stage calling ``torch.utils.checkpoint`` itself
  needs ``RuntimeOptions(overlap=False)`` when the model draws random numbers.

Errors: each half's error is the :class:`PipelineError` naming its action, as run
one after the other; the backward half is always waited for (its waits are bounded by the
transport's timeout), and when both fail, the forward's error is raised with the
backward's as a note (on Python 3.11 and later).

While a torch profiler records, the executor runs pairs one half after the other:
torch's profiler records the thread that started it, and would lose the worker's half.

On an accelerator the worker runs on the calling thread's device and current
stream.  autograd runs a backward's kernels on the streams their forwards used, so
the two halves' kernels share one stream: what overlaps there is each half's host
work and communication with the other's kernels, not two kernels at once.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from zeropipe.core.ir import Action
from zeropipe.core.simulate import Event
from zeropipe.runtime.memory.manager import MemoryManager
from zeropipe.runtime.step.handlers import StepContext
from zeropipe.runtime.transport.base import Transport
from zeropipe.runtime.transport.tagged import DistributedTransport

__all__ = ["PairWorker", "communicates_inside", "recomputes_in_backward", "run_pair"]

# What runs one action and returns its event (the executor's).
RunAction = Callable[[StepContext, int, int, Action], Event]


class _Locked:
    """Every method call of ``target`` made under ``lock``; attributes read as they are."""

    def __init__(self, target: object, lock: threading.Lock) -> None:
        self._target = target
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value
        lock = self._lock

        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return value(*args, **kwargs)

        return locked


class _PairTransport(_Locked):
    """The transport as a pair's two halves share it.

    Posts and bookkeeping run under the lock.  A send never blocks its thread: it is
    queued and posted at once if the lock is free, else by the half holding the lock as
    it lets go (a backward's early SEND_B, from inside autograd, must not stall the
    backward while the forward waits for its input).  A receive's wait runs outside the
    lock on the tagged transport, whose wait touches only its own action's entry and
    blocks in the endpoint's thread-safe pool, so that the two halves wait at once,
    and on a transport that says so (``concurrent_waits = True``, as the in-process
    one does); other transports wait under the lock (the ordered one advances one
    shared cursor of messages).
    """

    def __init__(self, target: Transport, lock: threading.Lock) -> None:
        super().__init__(target, lock)
        self._transport = target
        self._queued: deque[tuple[Action, tuple[Tensor, ...]]] = deque()
        self._free_waits = isinstance(target, DistributedTransport) or bool(
            getattr(target, "concurrent_waits", False)
        )

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if not callable(value):
            return value

        def then_flush(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            finally:
                self.flush()

        return then_flush

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        self._queued.append((action, tensors))
        self.flush()

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        if self._free_waits:
            return self._transport.wait_recv(action)
        result: tuple[Tensor, ...] = self.__getattr__("wait_recv")(action)
        return result

    def flush(self) -> None:
        """Post the queued sends in order, unless the other half holds the lock (it will)."""
        while self._queued and self._lock.acquire(blocking=False):
            try:
                while self._queued:
                    self._transport.send(*self._queued.popleft())
            finally:
                self._lock.release()


class _Ledger(_Locked):
    """The memory manager as a pair's backward half reaches it: its ``after_backward``
    calls kept and made after the pair (:meth:`replay`), so that the ledger counts the
    forward's saved bytes, then the backward's release, as a run in sequence does and
    whatever the threads' timing: the measured peaks are those of the pair in sequence."""

    def __init__(self, target: MemoryManager, lock: threading.Lock) -> None:
        super().__init__(target, lock)
        self._memory = target
        self._kept: list[tuple[Any, ...]] = []

    def after_backward(self, *args: Any) -> None:
        self._kept.append(args)

    def replay(self) -> None:
        for args in self._kept:
            self._memory.after_backward(*args)
        self._kept.clear()


class PairWorker:
    """The thread that runs the backward halves of one pipeline's overlapped pairs, one pair
    at a time, started on the first pair and kept for the life of the pipeline.

    One thread for all the pairs rather than one per pair: what torch keeps per thread
    stays warm from pair to pair.  DTensor's sharding-propagation cache is a
    ``threading.local``: on a new thread, every DTensor op of a backward (the gradients
    of experts sharded over "ep" are DTensors) computes its sharding again in Python,
    holding the GIL that the forward half's Python needs.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Queue ``job`` for the worker, run with the calling thread's intra-op thread count;
        the event is set when it has returned (``job`` catches its own errors).  The caller
        goes on at once: nothing in a pair needs its backward to have started first."""
        if self._thread is None or not self._thread.is_alive():  # first, or after a fork
            self._start()
        threads = torch.get_num_threads()
        done = threading.Event()

        def counted() -> None:
            try:
                # A new thread's OpenMP team defaults to every core: without this, its ops
                # would run on more threads than the rank was given (1 per rank: 2x slower on
                # 2 cores).
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                job()
            finally:
                done.set()

        self._jobs.put(counted)
        return done

    def _start(self) -> None:
        name = f"zeropipe pairs of {threading.current_thread().name}"
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._jobs = jobs
        self._thread = threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True)
        self._thread.start()
        # The pipeline gone, the worker ends.  Not at the interpreter's exit: woken while
        # the interpreter finalizes, a daemon thread exits mid-shutdown, its torch
        # thread-locals torn down beside the process's statics, which can abort the process
        # ("terminate called without an active exception", seen under load); left waiting,
        # it stops with the process.
        weakref.finalize(self, jobs.put, None).atexit = False


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A worker's loop: run each job in turn until ``None``.  A finished job is dropped
    before the next wait: it holds its step, and so the pipeline, which would never be
    collected (nor its worker ended) while an idle worker kept it."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job


def run_pair(
    ctx: StepContext, rank: int, step: int, forward: Action, backward: Action, run: RunAction
) -> tuple[Event, Event]:
    """Run ``forward`` (position ``step`` of ``rank``) and ``backward`` (``step + 1``) at once.

    Returns their events, each with its own start, end and wait.
    """
    shared = _PairTransport(ctx.transport, threading.Lock())
    transport = cast(Transport, shared)
    ledger_lock = threading.Lock()
    ledger: _Ledger | None = None
    memories: list[MemoryManager | None] = [None, None]
    if ctx.memory is not None:
        ledger = _Ledger(ctx.memory, ledger_lock)
        memories = [
            cast(MemoryManager, _Locked(ctx.memory, ledger_lock)),
            cast(MemoryManager, ledger),
        ]
    halves = [
        replace(ctx, transport=transport, memory=memory, waited={}, blocked=0.0)
        for memory in memories
    ]
    outcome: list[Event | BaseException] = []
    same_stream = _same_stream(ctx.device)

    def backward_half() -> None:
        try:
            with same_stream():
                outcome.append(run(halves[1], rank, step + 1, backward))
        except BaseException as exc:  # raised on the calling thread, once it is done
            outcome.append(exc)

    assert ctx.beside is not None  # the executor runs pairs at once only with a worker
    done = ctx.beside(backward_half)
    first: Event | BaseException
    try:
        first = run(halves[0], rank, step, forward)
    except BaseException as exc:
        first = exc
    finally:
        done.wait()
    for half in halves:
        for kind, seconds in half.waited.items():
            ctx.waited[kind] = ctx.waited.get(kind, 0.0) + seconds
        ctx.blocked += half.blocked
    second = outcome[0] if outcome else RuntimeError(f"{backward} ended without an outcome")
    if isinstance(first, BaseException):
        add_note = getattr(first, "add_note", None)  # Python 3.11 and later
        if isinstance(second, BaseException) and add_note is not None:
            add_note(f"the overlapped {backward} failed too: {second}")
        raise first
    if isinstance(second, BaseException):
        raise second
    shared.flush()  # a send queued as the last lock was let go
    if ledger is not None:
        ledger.replay()
    return first, second


def recomputes_in_backward(module: nn.Module) -> bool:
    """Whether ``module``'s backward recomputes with ``torch.utils.checkpoint`` as Hugging
    Face's gradient checkpointing does (one of its layers has ``gradient_checkpointing``
    set): that recompute restores the global generator's state and draws from it, which
    a forward beside it seeds per layer, so the pair it is in runs one half after the other.
    """
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def communicates_inside(module: nn.Module) -> bool:
    """Whether ``module``'s forward and backward run collectives on one group: some of its
    parameters are ``DTensor`` shards (tensor parallelism) outside modules that set
    ``collectives_split_by_direction`` (experts sharded over "ep").

    Every rank of such a group must issue its collectives in the same order; two halves
    that both communicate would interleave theirs as each thread's timing falls, so a
    pair of two such stages runs one half after the other.  A module with
    ``collectives_split_by_direction = True`` issues its forward's collectives on one
    group and its backward's on a second with the same members: a pair's forward half
    uses only the first and its backward half only the second, each in the schedule's
    order on every rank, so its parameters do not count.
    """
    for part in module.modules():
        if getattr(part, "collectives_split_by_direction", False) is True:
            continue
        if any(getattr(p, "placements", None) is not None for p in part.parameters(recurse=False)):
            return True
    return False


def _same_stream(device: torch.device) -> Callable[[], AbstractContextManager[None]]:
    """A context that puts a worker thread on this thread's device and current stream."""
    if device.type == "cpu":
        return nullcontext
    module = torch.get_device_module(device.type)
    if not all(hasattr(module, name) for name in ("current_stream", "device", "stream")):
        return nullcontext  # a device type without streams (mps): one queue anyway
    stream = module.current_stream(device)

    @contextmanager
    def on_stream() -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(module.device(device))
            stack.enter_context(module.stream(stream))
            yield

    return on_stream
