"""Executors: walk a schedule and call the action handlers, recording when each ran.

``run_local`` plays every rank in one process, in a topological order of the
schedule's dependency graph (so a consumer always finds its data).
``run_rank`` runs one rank's list in order, as each process of a distributed
pipeline does.  Both use the same dispatch table.  Event times are raw
``time.perf_counter()`` values: on one machine that clock is shared by all
processes, so events gathered from several ranks line up on one time axis.
An event's ``wait`` is the time its handler spent blocked for a received
tensor (:meth:`StepContext.receive`); the timeline counts it as idle.
"""

from __future__ import annotations

import time

from zeropipe.core.deps import Graph
from zeropipe.core.errors import PipelineError, ZeropipeError
from zeropipe.core.ir import Action, Schedule
from zeropipe.core.simulate import Event
from zeropipe.runtime.handlers import HANDLERS, StepContext

__all__ = ["run_local", "run_rank"]


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
    for rank, step in graph.order:
        events[rank].append(_run(ctx, rank, step, schedule.actions[rank][step]))
    for evs in events:
        evs.sort(key=lambda e: e.step)
    return events


def run_rank(ctx: StepContext, schedule: Schedule, rank: int) -> list[Event]:
    """One rank's actions in order (the distributed executor)."""
    return [_run(ctx, rank, step, a) for step, a in enumerate(schedule.actions[rank])]
