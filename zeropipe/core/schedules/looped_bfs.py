"""Breadth-first looped schedule (Lamy-Poirier 2022; torch's ScheduleLoopedBFS).

Looped placement (stage ``s`` on rank ``s % p``), ``v`` chunks per rank.  A
rank runs *every* microbatch through one local chunk before it moves to the
next chunk, then runs the backwards chunk by chunk in reverse.  Within a
chunk the backwards go newest microbatch first, as torch does: the last
stage can then start on the microbatch whose forward it just finished.
p=2, v=2, m=2::

    r0: 0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0
    r1: 1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0

Like GPipe it holds every microbatch's activations at the peak (``m``
microbatches of all ``v`` chunks), in exchange for few, large, regular steps.
"""

from __future__ import annotations

from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.schedules.registry import register

F, B = Kind.F, Kind.B


@register(
    "looped-bfs",
    "breadth-first looped: all microbatches through one local chunk before the next",
    default_chunks=2,
    takes_chunks=True,
)
def looped_bfs(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    acts = []
    for r in range(ranks):
        stages = [c * ranks + r for c in range(chunks)]
        rank = [Action(F, s, i) for s in stages for i in range(microbatches)]
        rank += [Action(B, s, i) for s in reversed(stages) for i in reversed(range(microbatches))]
        acts.append(rank)
    placement = tuple(s % ranks for s in range(ranks * chunks))
    return Schedule(placement, acts, microbatches, "looped-bfs")
