"""GPipe and 1F1B: one stage per rank, the two schedules everything else is measured against.

GPipe (p=2, m=3)::            1F1B (p=2, m=3)::

    r0: F0 F1 F2 B0 B1 B2         r0: F0 F1 B0 F2 B1 B2
    r1: F0 F1 F2 B0 B1 B2         r1: F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.schedules.registry import register

F, B = Kind.F, Kind.B


@register("gpipe", "all forwards, then all backwards; holds m microbatches of activations")
def gpipe(ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    acts = [
        [Action(F, r, i) for i in range(microbatches)]
        + [Action(B, r, i) for i in range(microbatches)]
        for r in range(ranks)
    ]
    return Schedule(tuple(range(ranks)), acts, microbatches, "gpipe")


@register("1f1b", "one forward, one backward in the steady state; holds at most p microbatches")
def one_f_one_b(ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    acts = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        rank = [Action(F, r, i) for i in range(warmup)]
        for i in range(microbatches):
            if warmup + i < microbatches:
                rank.append(Action(F, r, warmup + i))
            rank.append(Action(B, r, i))
        acts.append(rank)
    return Schedule(tuple(range(ranks)), acts, microbatches, "1f1b")
