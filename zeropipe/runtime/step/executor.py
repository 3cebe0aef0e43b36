"""Executors: walk a schedule and call the action handlers, recording when each ran.

``run_local`` plays every rank in one process, in a topological order of the
schedule's dependency graph (so a consumer always finds its data).
:class:`LocalTransport` is its transport: a send drops the tensors in the
matching receive's mailbox.  ``run_rank`` runs one rank's list in order, as each process of a distributed
pipeline does.  Both use the same dispatch table.  Event times are raw
``time.perf_counter()`` values: on one machine that clock is shared by all
processes, so events gathered from several ranks line up on one time axis.
An event's ``wait`` is the time its handler spent blocked for a received
tensor (:meth:`StepContext.receive`); the timeline counts it as idle.

Profiler names.  While a torch profiler records, every action runs inside
``torch.profiler.record_function("PP:" + str(action))``, the names
torch.distributed.pipelining gives its actions: ``PP:1F3`` (stage 1, forward of
microbatch 3), ``PP:0I5``, ``PP:2W0``, ``PP:1R2``, ``PP:0SEND_B3``,
``PP:1RELOAD4``, ``PP:1OFFLOAD`` (a stage's weights), ``PP:0REDUCE_GRAD``.  An
overlapped pair is also one span around its two, ``PP:(0F3;3B1)OVERLAP_F_B``, as
torch writes it.

Overlapped pairs.  With ``ctx.overlap`` (``RuntimeOptions(overlap=True)``, the
default) a pair whose two actions come one after the other in the walk runs both at
once (:func:`zeropipe.runtime.step.pairs.run_pair`): the forward on this thread, the
backward on a worker; their events are two spans that overlap in time.  Without it,
the two run one after the other, and so they do while a torch profiler records (torch's
profiler records the thread that started it, and would lose the worker's half) and when
the backward's stage recomputes inside its backward with Hugging Face's gradient
checkpointing (:func:`~zeropipe.runtime.step.pairs.recomputes_in_backward`), or both
stages run collectives of their own (:func:`~zeropipe.runtime.step.pairs.communicates_inside`).  With no profiler recording the
names are skipped (:func:`~zeropipe.base._compat.profiler_active`, asked once per
step): an idle ``record_function`` costs microseconds per action.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext

from torch import Tensor
from torch.profiler import record_function

from zeropipe.base._compat import profiler_active
from zeropipe.core.deps import Graph
from zeropipe.core.errors import PipelineError, ZeropipeError
from zeropipe.core.ir import Action, Schedule
from zeropipe.core.message_order import receiver_of
from zeropipe.core.simulate import Event
from zeropipe.runtime.step.handlers import HANDLERS, StepContext
from zeropipe.runtime.step.pairs import communicates_inside, recomputes_in_backward, run_pair

__all__ = ["LocalTransport", "run_local", "run_rank"]


def _run(ctx: StepContext, rank: int, step: int, action: Action) -> Event:
    handler = HANDLERS.get(action.kind)
    if handler is None:
        raise PipelineError(f"no handler for action kind {action.kind.value} ({action})")
    waited = ctx.blocked
    start = time.perf_counter()
    try:
        handler(ctx, action)
    except ZeropipeError:
        raise
    except Exception as exc:
        raise PipelineError(
            f"{_who(rank)} failed in {_which_step(ctx)} at action {action} (position {step} of "
            f"its schedule): {type(exc).__name__}: {exc}"
        ) from exc
    end = time.perf_counter()
    # The handler's time blocked for received data is the event's wait, not its work.
    return Event(rank, step, action, start, end, wait=min(ctx.blocked - waited, end - start))


def _who(rank: int) -> str:
    """``rank 0``, and the process's own rank where that differs (a mesh with "dp" or "tp":
    pipeline rank 0 of tensor-parallel rank 1 is process 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != rank:
        return f"rank {rank} (process {dist.get_rank()})"
    return f"rank {rank}"


def _which_step(ctx: StepContext) -> str:
    """The pipeline's step, named apart from the action's position in the schedule.

    Both count from 0: the step as the pipeline numbers it (its seeds use the
    same number), the position as the schedule's text and timelines do.
    """
    if ctx.training:
        return f"training step {ctx.step}"
    return f"an evaluation step (after {ctx.step} training steps)"


def run_local(ctx: StepContext, graph: Graph) -> list[list[Event]]:
    """Every rank in this process; returns the measured events per rank."""
    schedule = graph.schedule
    events: list[list[Event]] = [[] for _ in schedule.actions]
    for event in _walk(ctx, schedule, graph.order):
        events[event.rank].append(event)
    for evs in events:
        evs.sort(key=lambda e: e.step)
    return events


def run_rank(ctx: StepContext, schedule: Schedule, rank: int) -> list[Event]:
    """One rank's actions in order (the distributed executor)."""
    return _walk(ctx, schedule, [(rank, step) for step in range(len(schedule.actions[rank]))])


def _walk(ctx: StepContext, schedule: Schedule, order: Sequence[tuple[int, int]]) -> list[Event]:
    """Run the ``(rank, step)`` actions of ``order`` one after another, an overlapped pair's
    two at once when ``ctx.beside`` runs them: the one loop both executors share, and the one place
    actions get their profiler names."""
    profiling = profiler_active()
    run = _named if profiling else _run
    at_once = ctx.beside is not None
    if not schedule.overlaps or not (profiling or at_once):
        return [run(ctx, rank, step, schedule.actions[rank][step]) for rank, step in order]
    starts = {r: schedule.overlapped(r) for r in range(schedule.num_ranks)}
    together = _at_once(ctx) if at_once and not profiling else None
    events: list[Event] = []
    k = 0
    while k < len(order):
        rank, step = order[k]
        acts = schedule.actions[rank]
        # A pair's members are adjacent in a rank's list; a local run's order may part them.
        if step in starts[rank] and k + 1 < len(order) and order[k + 1] == (rank, step + 1):
            first, second = acts[step], acts[step + 1]
            with (
                record_function(f"PP:({first};{second})OVERLAP_F_B") if profiling else nullcontext()
            ):
                if together is not None and together(first, second):
                    events.extend(run_pair(ctx, rank, step, first, second, _run))
                else:
                    events.append(run(ctx, rank, step, first))
                    events.append(run(ctx, rank, step + 1, second))
            k += 2
        else:
            events.append(run(ctx, rank, step, acts[step]))
            k += 1
    return events


def _at_once(ctx: StepContext) -> Callable[[Action, Action], bool]:
    """Which of this step's pairs run their halves at once: not those whose backward
    restores the global generator (a recompute inside it), nor those whose two stages both
    issue collectives of their own (every rank must issue them in one order)."""
    # Asked of the stages in pairs only, once each per step (each question walks a module).
    recomputing = functools.cache(lambda s: recomputes_in_backward(ctx.stages[s].module))
    talking = functools.cache(lambda s: communicates_inside(ctx.stages[s].module))
    return lambda f, b: not recomputing(b.stage) and not (talking(f.stage) and talking(b.stage))


def _named(ctx: StepContext, rank: int, step: int, action: Action) -> Event:
    # torch.distributed.pipelining's name for an action, so traces of both read alike.
    with record_function(f"PP:{action}"):
        return _run(ctx, rank, step, action)


class LocalTransport:
    """Every rank in one process: sends are hand-offs into a mailbox, nothing is copied."""

    # A wait touches only its own action's mailbox entry and never blocks: an overlapped
    # pair's two halves may wait at once (zeropipe.runtime.step.pairs).
    concurrent_waits = True

    def __init__(self) -> None:
        self._mailbox: dict[Action, tuple[Tensor, ...]] = {}
        self._posted: set[Action] = set()

    def start_step(self, schedule: Schedule, signature: Hashable, step: int | None = None) -> None:
        return None  # tensors are handed over as they are: nothing to learn or to agree on

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        self._mailbox[receiver_of(action)] = tensors

    def post_recv(self, action: Action) -> None:
        self._posted.add(action)

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        if action not in self._posted:
            raise PipelineError(f"{action} was waited on before it was posted")
        try:
            data = self._mailbox.pop(action)
        except KeyError:
            raise PipelineError(
                f"{action}: nothing was sent to it (its SEND has not run)"
            ) from None
        self._posted.discard(action)
        return data

    def finish_step(self, loss: Tensor | None = None) -> Tensor | None:
        if self._mailbox or self._posted:
            left = sorted(str(a) for a in (*self._mailbox, *self._posted))
            self._mailbox.clear()
            self._posted.clear()
            raise PipelineError(f"step ended with transfers never consumed: {', '.join(left[:6])}")
        return loss  # one process: the loss is already everywhere

    def reset(self) -> None:
        return None  # nothing is learnt: tensors are handed over as they are

    def reduce_shared(self, grads: Sequence[Tensor]) -> None:
        return None  # one process: shared parameters are one tensor already

    def fail(self, error: BaseException) -> None:
        return None  # one process: nobody else is waiting

    def culprit(self, error: BaseException) -> BaseException | None:
        return None  # one process: no other process to fail
