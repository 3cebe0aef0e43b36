"""Overlapped pairs run at once: a forward and a backward of one rank side by side.

A schedule's overlapped pair (``Schedule.overlaps``, written ``(0F3;3B1)``) is a
forward of one stage and a backward (B or I) of another, adjacent on one rank.
With ``RuntimeOptions(overlap=True)`` the executor hands such a pair to
:func:`run_pair`: the backward runs on a worker thread while the forward runs
on the calling thread, so that what one half waits for (a received tensor, later
an all-to-all) is waited for while the other half computes::

    calling thread:  |--- F(a, j): wait for its input ... compute ---|
    worker thread:   |--- B(b, k): wait for its gradient ... compute ---|   joined

Both halves run their ordinary handlers (the one dispatch table).  What they share
is made safe this way:

- the transport and the memory manager are reached through :class:`_Locked`, which
  runs each of their calls under one lock: a transport is not written for two
  threads, and the memory ledger's counters are read-modify-write.  A receive waits
  inside that lock; the other half's compute needs no lock and goes on meanwhile.
  The schedule's dependency model guarantees that neither half's input depends on
  the other half's output (a pair starts when the inputs of both are ready), so a
  wait held under the lock always ends;
- each half gets its own copy of the :class:`StepContext` (the same stages, losses,
  memory and transport, its own blocked-time counters), whose waits are added to the
  step's once both halves are done, so each half's event counts its own wait;
- per-microbatch state lives per stage and per microbatch, and the two halves touch
  different (stage, microbatch) entries; gradients are written by the backward alone,
  in the order a sequential run writes them, so they are bitwise those of the pair
  run one half after the other;
- randomness: the forward seeds the global generator per layer and draws right after
  (``runtime/step/stage.py``) on the calling thread; a backward draws nothing, unless
  a stage recomputes with its own ``torch.utils.checkpoint`` inside its backward,
  which restores and draws from the global generator: such a stage should not run
  in an overlapped pair (``overlap=False``).

Errors: each half's error is the :class:`PipelineError` naming its action, as run
one after the other; the worker is always joined (its waits are bounded by the
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

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, cast

import torch

from zeropipe.core.ir import Action
from zeropipe.core.simulate import Event
from zeropipe.runtime.memory.manager import MemoryManager
from zeropipe.runtime.step.handlers import StepContext
from zeropipe.runtime.transport.base import Transport

__all__ = ["run_pair"]

# What runs one action and returns its event (the executor's).
RunAction = Callable[[StepContext, int, int, Action], Event]


class _Locked:
    """Every method call of ``target`` made under ``lock``; attributes read as they are."""

    def __init__(self, target: object, lock: threading.RLock) -> None:
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


def run_pair(
    ctx: StepContext, rank: int, step: int, forward: Action, backward: Action, run: RunAction
) -> tuple[Event, Event]:
    """Run ``forward`` (position ``step`` of ``rank``) and ``backward`` (``step + 1``) at once.

    Returns their events, each with its own start, end and wait.
    """
    lock = threading.RLock()
    transport = cast(Transport, _Locked(ctx.transport, lock))
    memory = None if ctx.memory is None else cast(MemoryManager, _Locked(ctx.memory, lock))
    halves = [
        replace(ctx, transport=transport, memory=memory, waited={}, blocked=0.0) for _ in "FB"
    ]
    outcome: list[Event | BaseException] = []
    same_stream = _same_stream(ctx.device)

    def backward_half() -> None:
        try:
            with same_stream():
                outcome.append(run(halves[1], rank, step + 1, backward))
        except BaseException as exc:  # raised on the calling thread, after the join
            outcome.append(exc)

    worker = threading.Thread(target=backward_half, name=f"zeropipe {backward}", daemon=True)
    worker.start()
    first: Event | BaseException
    try:
        first = run(halves[0], rank, step, forward)
    except BaseException as exc:
        first = exc
    finally:
        worker.join()
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
    return first, second


def _same_stream(device: torch.device) -> Callable[[], AbstractContextManager[None]]:
    """A context that puts a worker thread on this thread's device and current stream."""
    if device.type == "cpu":
        return nullcontext
    module = torch.get_device_module(device.type)
    stream = module.current_stream(device)

    @contextmanager
    def on_stream() -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(module.device(device))
            stack.enter_context(module.stream(stream))
            yield

    return on_stream
