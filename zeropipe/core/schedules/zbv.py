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

from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.schedules.registry import register

F, I, W = Kind.F, Kind.I, Kind.W


def v_placement(ranks: int) -> tuple[int, ...]:
    """Stage -> rank of the V shape: down the ranks, then back up."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def _rank_order(rank: int, ranks: int, fill: int, keep: int) -> list[Action]:
    """Rank ``rank``'s list built for ``fill`` microbatches, holding only the first ``keep``.

    The padding microbatches (``keep`` and up) are counted but never built, and
    rounds of the pattern that hold none of the kept ones are skipped in one
    step: a rank's list then costs O(``keep``) rather than O(``fill``) = O(ranks),
    which made the whole schedule quadratic in ranks.  Dropping the padding is
    safe for a valid padded schedule: a kept action depends only on actions of
    its own microbatch, and dropping nodes from a rank's chain adds no edge.
    """
    a, b = rank, 2 * ranks - 1 - rank
    done: Counter[tuple[Kind, int]] = Counter()
    acts: list[Action] = []

    def put(kind: Kind, stage: int, times: int = 1) -> None:
        first = done[kind, stage]
        for i in range(first, min(first + times, keep)):  # a loop: cheaper than a generator
            acts.append(Action(kind, stage, i))
        done[kind, stage] = first + times

    def rounds(times: int, *pattern: tuple[Kind, int]) -> None:
        for n in range(times):
            if all(done[p] >= keep for p in pattern):  # only padding from here on
                for p in pattern:
                    done[p] += times - n
                return
            for kind, stage in pattern:
                put(kind, stage)

    put(F, a, 2 * (ranks - rank) - 1)
    rounds(rank, (F, b), (F, a))
    rounds(ranks - rank, (F, b), (I, b), (W, b))
    steady = ((F, a), (I, a), (W, a), (F, b), (I, b), (W, b))
    while done[F, b] < done[F, a] or done[F, a] < fill:
        if all(done[p] >= keep for p in steady):
            # The rounds left, in closed form: F(a) stops at fill, the rest go on
            # until F(b) has caught up with F(a).
            fa, fb = done[F, a], done[F, b]
            left = max(0, fill - fa)
            n = max(left, fa + left - fb)
            done[F, a] += left
            for p in steady[1:]:
                done[p] += n
            break
        if done[F, a] < fill:
            put(F, a)
        put(I, a)
        put(W, a)
        put(F, b)
        put(I, b)
        put(W, b)
    rounds(rank, (I, a), (I, b))
    rounds(ranks - rank, (I, a), (W, a))
    put(W, b, max(0, done[I, b] - done[W, b]))
    put(W, a, max(0, done[I, a] - done[W, a]))
    return acts


@register(
    "zbv",
    "zero bubble V: 2 chunks per rank in a V, I/W split; 1F1B's peak memory",
    default_chunks=2,
    takes_chunks=False,
)
def zbv(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    fill = max(microbatches, 2 * ranks - 1)
    acts = [_rank_order(r, ranks, fill, microbatches) for r in range(ranks)]
    return Schedule(v_placement(ranks), acts, microbatches, "zbv")
