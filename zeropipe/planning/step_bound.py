"""A step time no schedule on a placement can beat, from its cost model alone.

The cluster search (:mod:`zeropipe.planning.cluster`) prices configurations in the
order of this bound and drops those whose bound cannot enter its top: most of a
cluster-sized grid is never built or simulated.  No torch here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.schedules import generate

__all__ = ["Shape", "lower_bound"]


@dataclass(frozen=True)
class Shape:
    """What the bound reads of a generator's schedules on one pipeline depth, from a small
    one (``sample``): the placement, whether backward is split, the routes and copies."""

    placement: tuple[int, ...]
    split: bool
    sample: Schedule

    @classmethod
    def probe(cls, name: str, ranks: int, chunks: int, microbatches: int) -> Shape:
        """The shape of generator ``name`` on ``ranks`` ranks, from the smallest instance
        it takes among 1, 2 x ranks - 1, 2 x ranks and ``microbatches`` microbatches;
        raises its refusal of the last (a one-line ScheduleError) when it takes none."""
        refusal = ScheduleError(f"{name} takes no microbatch count on {ranks} ranks")
        for small in dict.fromkeys((1, 2 * ranks - 1, 2 * ranks, microbatches)):
            try:
                s = generate(name, ranks, small, chunks)
            except ScheduleError as exc:
                refusal = exc
                continue
            split = any(a.kind in (Kind.I, Kind.W) for acts in s.actions for a in acts)
            return cls(tuple(s.placement), split, s)
        raise refusal

    def routes(self, microbatches: int) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Each route with how many of ``microbatches`` take it (none: every stage)."""
        taken = Counter(tuple(r) for r in self.sample.routes)
        small = self.sample.microbatches
        return tuple((r, n * microbatches // small) for r, n in taken.items())

    def bound(
        self,
        costs: CostModel,
        microbatches: int,
        *,
        split: bool | None = None,
        recomputed: Sequence[int] | None = None,
    ) -> float:
        """:func:`lower_bound` on this shape under ``costs`` (of every stage, copies
        included); ``split``: as the generator splits backward unless given."""
        return lower_bound(
            costs,
            self.placement,
            microbatches,
            split=self.split if split is None else split,
            recomputed=recomputed,
            routes=self.routes(microbatches),
            overlap=costs.overlap if self.sample.overlaps else 0.0,
        )


def lower_bound(
    costs: CostModel,
    placement: Sequence[int],
    microbatches: int,
    *,
    split: bool,
    recomputed: Sequence[int] | None = None,
    routes: Sequence[tuple[Sequence[int], int]] = (),
    overlap: float = 0.0,
) -> float:
    """A step time no schedule on ``placement`` can beat under ``costs``.

    For each rank: the forward chain that must run before its first action (the
    cheapest of its stages to reach), plus every compute action it must run
    (``recomputed[s]`` microbatches of stage ``s`` also recompute), plus what must
    follow its last action: the all-reduce of a stage (with dp > 1) and, when the
    schedule does not split backward (``split=False``: its last action is a whole B),
    the backward chain down to stage 0.  With several stages on a rank, their
    all-reduces run one after another on its link, the first after one stage's last
    backward.  The step is at least the largest of these.

    ``routes``: (stages in order, how many microbatches take them) when microbatches
    visit only some stages (dualpipe: half down stages 0..PP-1, half up PP..2PP-1);
    none: every microbatch visits every stage.  Chains then run along a route.

    ``overlap``: the share of an overlapped pair's shorter half that runs hidden
    (``CostModel.overlap``; 0 when the schedule has no overlapped pairs).  A pair holds
    one forward, so a rank saves at most that share of its forwards, and a paired
    backward takes at least ``1 - overlap`` of its time.
    """
    n = len(placement)
    over = costs.overhead
    c = costs.stages
    # Backward as the cheapest the schedule may run it: whole, or as I then W (fused).
    back = [min(s.time(Kind.B), s.I + min(s.W, s.fused_w)) for s in c]
    chained = [b * (1 - overlap) for b in back]  # a paired backward's least
    visits, fwd_before, bwd_below = _chains(
        costs, placement, chained, routes or ((range(n), microbatches),)
    )
    # What a stage's actions take at least, its forwards partly hidden in pairs.
    work = [visits[s] * (c[s].F + back[s] + 2 * over - overlap * (c[s].F + over)) for s in range(n)]
    best = 0.0
    for r in range(max(placement) + 1):
        mine = [s for s in range(n) if placement[s] == r and visits[s]]
        if not mine:
            continue
        busy = 0.0
        for s in mine:
            busy += work[s]
            if recomputed is not None:
                busy += recomputed[s] * (c[s].time(Kind.R) + over)
        head = min(fwd_before[s] for s in mine)
        reduce = [costs.reduce_time(s) + over if costs.dp > 1 else 0.0 for s in mine]
        if split:
            tail = min(reduce)
        else:
            tail = min(max(r_s, bwd_below[s]) for s, r_s in zip(mine, reduce, strict=True))
        best = max(best, head + busy + tail)
        if costs.dp > 1 and len(mine) > 1:
            # The rank's all-reduces share one link, and none starts before some stage of
            # the rank has run all its own forwards and backwards.
            first_done = min(work[s] for s in mine)
            best = max(best, head + first_done + sum(reduce))
    return best


def _chains(
    costs: CostModel,
    placement: Sequence[int],
    back: Sequence[float],
    routes: Sequence[tuple[Sequence[int], int]],
) -> tuple[list[int], list[float], list[float]]:
    """Per stage: how many microbatches visit it, the shortest forward chain to reach it
    and the shortest chain of whole backwards from it down to its route's first stage."""
    n, over, c = len(placement), costs.overhead, costs.stages
    visits = [0] * n
    fwd_before, bwd_below = [math.inf] * n, [math.inf] * n
    for stages, count in routes:
        if count <= 0:
            continue
        fwd = bwd = 0.0
        prev = None
        for s in stages:
            if prev is not None:
                hop = costs.boundary_time(prev, s) if placement[prev] != placement[s] else 0.0
                fwd = fwd + c[prev].F + over + hop
                bwd = bwd + back[prev] + over + hop
            visits[s] += count
            fwd_before[s], bwd_below[s] = min(fwd_before[s], fwd), min(bwd_below[s], bwd)
            prev = s
    return visits, fwd_before, bwd_below
