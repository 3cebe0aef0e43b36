"""Executors: walk a schedule and call the action handlers, recording when each ran.

``run_local`` plays every rank in one process, in a topological order of the
schedule's dependency graph (so a consumer always finds its data).
``run_rank`` runs one rank's list in order, as each process of a distributed
pipeline does.  Both use the same dispatch table.
"""

from __future__ import annotations

import time

from zeropipe.deps import Graph
from zeropipe.errors import PipelineError, ZeropipeError
from zeropipe.ir import Action, Schedule
from zeropipe.runtime.handlers import HANDLERS, StepContext
from zeropipe.simulate import Event

__all__ = ["run_local", "run_rank"]


def _run(ctx: StepContext, rank: int, step: int, action: Action, t0: float) -> Event:
    handler = HANDLERS.get(action.kind)
    if handler is None:
        raise PipelineError(f"no handler for action kind {action.kind.value} ({action})")
    start = time.perf_counter()
    try:
        handler(ctx, action)
    except ZeropipeError:
        raise
    except Exception as exc:
        raise PipelineError(
            f"rank {rank} failed at step {step} ({action}): {type(exc).__name__}: {exc}"
        ) from exc
    return Event(rank, step, action, start - t0, time.perf_counter() - t0)


def run_local(ctx: StepContext, graph: Graph) -> list[list[Event]]:
    """Every rank in this process; returns the measured events per rank."""
    schedule = graph.schedule
    events: list[list[Event]] = [[] for _ in schedule.actions]
    t0 = time.perf_counter()
    for rank, step in graph.order:
        events[rank].append(_run(ctx, rank, step, schedule.actions[rank][step], t0))
    for evs in events:
        evs.sort(key=lambda e: e.step)
    return events


def run_rank(ctx: StepContext, schedule: Schedule, rank: int) -> list[Event]:
    """One rank's actions in order (the distributed executor)."""
    t0 = time.perf_counter()
    return [_run(ctx, rank, step, a, t0) for step, a in enumerate(schedule.actions[rank])]
