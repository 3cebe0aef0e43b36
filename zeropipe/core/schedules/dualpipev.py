"""DualPipeV: the V-shaped, one-direction form of DeepSeek's DualPipe.

V placement as ZB-V (rank ``r`` holds stage ``a = r`` and stage
``b = 2p-1-r``).  DualPipe's steady state runs a forward of one chunk and a
backward of the other as one *overlapped* step so that the MoE all-to-all of
each hides behind the compute of the other.  A schedule here is a list of
single actions, so an overlapped step is emitted as its two actions side by
side, forward first; fusing them is the runtime's business.  Full backwards
(B) are used everywhere except where DualPipeV defers weight gradients (I
now, W later to fill a bubble).  Rank ``r`` of ``p`` with ``m`` microbatches::

    1  2(p-r-1) x F(a)
    2  (r+1)    x F(a) F(b)
    3  (p-r-1)  x I(b) W(b) F(b)                       (split: W right after)
    4  (m-2p+r+1) x [F(a) B(b)] [F(b) B(a)]            (each [..] one overlapped step)
    5  (p-r-1)  x B(b) [F(b) B(a)]
    6  (r+1)    x B(b) B(a), switching to I from the middle pair on
                  (odd r: from that pair's b; even r: from its a)
    7  (p-r-1)  x W I(a)                               (W: oldest deferred one)
    8  the remaining deferred W

Each [..] is recorded as an overlapped pair (``Schedule.overlaps``), except,
as in DualPipeV, the first [F(a) B(b)] of step 4 on the last rank (it is on
the critical path).  The pairs are torch's ScheduleDualPipeV's, action for action.

Step 4 runs ``m - 2p + r + 1`` times.  DeepSeek's code and torch's
ScheduleDualPipeV ask for ``m >= 2p``; the same steps are complete and valid
down to ``m = 2p - 1`` (step 4 is then empty on rank 0 only), so that is the
bound here.  Below it the warm-up alone would run more forwards than exist.
"""

from __future__ import annotations

from collections import Counter, deque

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Overlap, Schedule
from zeropipe.core.schedules.registry import register
from zeropipe.core.schedules.zbv import v_placement

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W


def _rank_order(rank: int, ranks: int, microbatches: int, pairs: list[Overlap]) -> list[Action]:
    a, b = rank, 2 * ranks - 1 - rank
    fwd: Counter[int] = Counter()
    bwd: Counter[int] = Counter()
    deferred: deque[Action] = deque()
    acts: list[Action] = []

    def forward(stage: int) -> None:
        acts.append(Action(F, stage, fwd[stage]))
        fwd[stage] += 1

    def backward(stage: int, split: bool = False) -> None:
        acts.append(Action(I if split else B, stage, bwd[stage]))
        if split:
            deferred.append(Action(W, stage, bwd[stage]))
        bwd[stage] += 1

    def weight() -> None:
        if deferred:
            acts.append(deferred.popleft())

    def overlapped(f: int, bw: int) -> None:
        forward(f)
        backward(bw)
        pairs.append((acts[-2], acts[-1]))

    later = ranks - rank - 1  # how many ranks lie beyond this one
    for _ in range(2 * later):
        forward(a)
    for _ in range(rank + 1):
        forward(a)
        forward(b)
    for _ in range(later):
        backward(b, split=True)
        weight()
        forward(b)
    for n in range(microbatches - 2 * ranks + rank + 1):
        if n == 0 and later == 0:  # the last rank's first one is not overlapped
            forward(a)
            backward(b)
        else:
            overlapped(a, b)
        overlapped(b, a)
    for _ in range(later):
        backward(b)
        overlapped(b, a)
    split = False
    middle = (rank + 1) // 2
    for i in range(rank + 1):
        if i == middle and rank % 2 == 1:
            split = True
        backward(b, split)
        if i == middle and rank % 2 == 0:
            split = True
        backward(a, split)
    for _ in range(later):
        weight()
        backward(a, split=True)
    while deferred:
        weight()
    return acts


@register(
    "dualpipev",
    "DeepSeek DualPipeV: V placement, F/B overlap pairs, W deferred at the end; m >= 2p-1",
    default_chunks=2,
    takes_chunks=False,
)
def dualpipev(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    least = 2 * ranks - 1
    if microbatches < least:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2 x ranks - 1 = {least} (its warm-up alone "
            f"runs {least} forwards on rank 0), got {microbatches} for {ranks} ranks; "
            f"use microbatches >= {least}, or zbv, which takes any count",
            rule="unsupported",
        )
    pairs: list[Overlap] = []
    acts = [_rank_order(r, ranks, microbatches, pairs) for r in range(ranks)]
    return Schedule(v_placement(ranks), acts, microbatches, "dualpipev", pairs)
