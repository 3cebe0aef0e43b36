"""ZB-V: the handcrafted zero-bubble V schedule (Qi et al. 2024, section 6).

V placement with two chunks per rank: stage ``s`` lives on rank ``s`` for
``s < p`` and on rank ``2p-1-s`` otherwise, so rank ``r`` holds stages
``a = r`` (chunk 0) and ``b = 2p-1-r`` (chunk 1), and rank 0 runs both the
first and the last stage.  The backward is split into I and W.  Rank ``r``::

    warm-up    (2(p-r)-1) x F(a)
               r x [F(b) F(a)]
               (p-r) x [F(b) I(b) W(b)]
    steady     [F(a) I(a) W(a) F(b) I(b) W(b)] until chunk 1 has caught up
               (no new F(a) once all microbatches have entered)
    cool-down  r x [I(a) I(b)],  (p-r) x [I(a) W(a)],  then the held-back W

p=2, m=4 (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)::

    r0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 ...
    r1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 ...

The pattern needs ``2p - 1`` microbatches to fill; for fewer, the schedule is
built for ``2p - 1`` and the missing microbatches' actions are dropped, as in
the reference implementation (sail-sg's handcrafted ZB-V, torch's
ScheduleZBVZeroBubble).  Peak activation memory per rank matches 1F1B's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from zeropipe.ir import Action, Kind, Schedule
from zeropipe.schedules.registry import register

F, I, W = Kind.F, Kind.I, Kind.W


def v_placement(ranks: int) -> tuple[int, ...]:
    """Stage -> rank of the V shape: down the ranks, then back up."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def _trim(actions: Sequence[Sequence[Action]], microbatches: int) -> list[list[Action]]:
    """Every rank's list without the actions of the padding microbatches.

    Safe for any valid padded schedule: a kept action depends only on actions
    of its own microbatch, and dropping nodes from a rank's chain adds no edge.
    """
    return [[a for a in acts if (a.microbatch or 0) < microbatches] for acts in actions]


def _rank_order(rank: int, ranks: int, fill: int) -> list[Action]:
    a, b = rank, 2 * ranks - 1 - rank
    done: Counter[tuple[Kind, int]] = Counter()
    acts: list[Action] = []

    def put(kind: Kind, stage: int) -> None:
        acts.append(Action(kind, stage, done[kind, stage]))
        done[kind, stage] += 1

    for _ in range(2 * (ranks - rank) - 1):
        put(F, a)
    for _ in range(rank):
        put(F, b)
        put(F, a)
    for _ in range(ranks - rank):
        put(F, b)
        put(I, b)
        put(W, b)
    while done[F, b] < done[F, a] or done[F, a] < fill:
        if done[F, a] < fill:
            put(F, a)
        put(I, a)
        put(W, a)
        put(F, b)
        put(I, b)
        put(W, b)
    for _ in range(rank):
        put(I, a)
        put(I, b)
    for _ in range(ranks - rank):
        put(I, a)
        put(W, a)
    while done[W, b] < done[I, b]:
        put(W, b)
    while done[W, a] < done[I, a]:
        put(W, a)
    return acts


@register(
    "zbv",
    "zero bubble V: 2 chunks per rank in a V, I/W split; 1F1B's peak memory",
    default_chunks=2,
    takes_chunks=False,
)
def zbv(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    fill = max(microbatches, 2 * ranks - 1)
    acts = _trim([_rank_order(r, ranks, fill) for r in range(ranks)], microbatches)
    return Schedule(v_placement(ranks), acts, microbatches, "zbv")
