"""A step time no schedule on a placement can beat, from its cost model alone.

The cluster search (:mod:`zeropipe.planning.cluster`) prices configurations in the
order of this bound and drops those whose bound cannot enter its top: most of a
cluster-sized grid is never built or simulated.  No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeropipe.core.costs import CostModel
from zeropipe.core.ir import Kind

__all__ = ["lower_bound"]


def lower_bound(
    costs: CostModel,
    placement: Sequence[int],
    microbatches: int,
    *,
    split: bool,
    recomputed: Sequence[int] | None = None,
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
    """
    n = len(placement)
    over = costs.overhead
    c = costs.stages
    # Backward as the cheapest the schedule may run it: whole, or as I then W (fused).
    back = [min(s.time(Kind.B), s.I + min(s.W, s.fused_w)) for s in c]
    hop = [costs.boundary_time(s, s + 1) if placement[s] != placement[s + 1] else 0.0
           for s in range(n - 1)]  # fmt: skip
    fwd_before = [0.0] * n  # forward chain to reach stage s
    bwd_below = [0.0] * n  # whole backwards from stage s down to stage 0
    for s in range(1, n):
        fwd_before[s] = fwd_before[s - 1] + c[s - 1].F + over + hop[s - 1]
        bwd_below[s] = bwd_below[s - 1] + back[s - 1] + over + hop[s - 1]
    best = 0.0
    for r in range(max(placement) + 1):
        mine = [s for s in range(n) if placement[s] == r]
        if not mine:
            continue
        busy = 0.0
        for s in mine:
            busy += microbatches * (c[s].F + back[s] + 2 * over)
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
            first_done = min(microbatches * (c[s].F + back[s] + 2 * over) for s in mine)
            best = max(best, head + first_done + sum(reduce))
    return best
