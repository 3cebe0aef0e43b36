"""DeepSeek's DualPipe family: DualPipeV (``dualpipev``) and DualPipe (``dualpipe``).

DualPipeV
---------
The V-shaped, one-direction form of DualPipe.  V placement as ZB-V (rank ``r`` holds stage ``a = r`` and stage
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

DualPipe
--------
``PP`` ranks (even), the model cut into ``PP`` stages.  Half the microbatches
flow *down*, rank 0 -> PP-1; the other half flow *up*, rank PP-1 -> 0, through a
second copy of the model, so every rank holds two model stages (parameters 2x)::

    IR stage        0 .. PP-1            PP .. 2PP-1
    route of        microbatches 0..m/2-1   m/2..m-1
    model stage     s                    s - PP   (copies: {PP+k: k})
    rank            s                    2PP-1-s  (the V placement)

Every route is consecutive stages (``Schedule.routes``), and stage ``PP+k`` is a
copy of stage ``k`` (``Schedule.copies``): the runtime runs model stage ``k``'s
module for it, and sums the two copies' gradients before the optimizer.

Order.  DualPipeV is DualPipe cut in half (Sea AI Lab's "cut-in-half"), and this
generator uses that identity backwards: rank ``r`` of DualPipe, with
``h = min(r, PP-1-r)``, runs rank ``h`` of ``dualpipev(PP/2, m/2)`` action for
action, overlapped pairs included, with that rank's first chunk read as the
direction that reaches rank ``r`` first (down for ``r < PP/2``, up otherwise) and
its second chunk as the other.  DeepSeek's DualPipe ``step`` runs the same eight
phases with ``half_rank = h`` and ``num_half_ranks = PP/2``.  Each direction's
data then crosses the ranks exactly as DualPipeV's V does: down microbatch ``j``
runs where DualPipeV's microbatch ``j`` runs, the up ones mirror them.

Bubble, as DeepSeek's table counts it: a rank's idle time within the step,
communication free, every stage alike (forward ``F``, full backward ``B = I + W``,
weight part ``W``, an overlapped pair ``F&B``; ``CostModel(overlap=)`` sets
``F&B = F + B - overlap * min(F, B)``).  Measured as the largest
``makespan - busy(rank)`` of :func:`zeropipe.core.simulate.simulate` (the
middle ranks ``PP/2-1`` and ``PP/2``; ``busy`` counts a pair once, as ``F&B``)::

    1F1B      (PP-1)(F+B)              ZB1P (zb-h1)  (PP-1)(F+B-2W)
    DualPipe  (PP/2-1)(F&B+B-3W)       when I = F (below)

The table's DualPipe row holds exactly when the input-gradient part of a
backward takes as long as a forward (``I = B - W = F``, as its figure draws
them).  Otherwise it does not: with ``F=1, I=1.5, W=1`` and no overlap the
largest idle is 2.5, 5 and 8 at PP = 4, 6, 8 against the table's 3, 6 and 9;
with overlap 0.5, 2, 4 and 6.5 against 2.5, 5 and 7.5.
Parameters: two stages per rank (2x); activations: at most ``PP+1``
microbatches of one stage in flight on a rank (``m >= 2PP``).
``tests/core/schedules/test_dualpipe.py`` checks these at PP = 4, 6, 8.  Requires ``PP`` even, ``m`` even and ``m >= 2PP - 2`` (DualPipeV's
``m/2 >= 2(PP/2) - 1``; DeepSeek asks ``m >= 2PP``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Overlap, Schedule
from zeropipe.core.schedules.registry import register
from zeropipe.core.schedules.zbv import v_placement

__all__ = ["dualpipe", "dualpipe_layout", "dualpipev"]

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


def dualpipe_layout(
    ranks: int, microbatches: int
) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """The routes (one per microbatch) and copies (copy, original) of a ``dualpipe`` schedule."""
    down, up = tuple(range(ranks)), tuple(range(ranks, 2 * ranks))
    routes = [down if j < microbatches // 2 else up for j in range(microbatches)]
    return routes, [(ranks + k, k) for k in range(ranks)]


def _check(ranks: int, microbatches: int) -> None:
    """One-line refusals of what DualPipe cannot run."""
    if ranks % 2:
        raise ScheduleError(
            f"dualpipe needs an even number of ranks (its two directions meet in the middle), "
            f"got {ranks}; use {ranks + 1}, or dualpipev",
            rule="unsupported",
        )
    least = max(2 * ranks - 2, 2)
    if microbatches % 2 or microbatches < least:
        raise ScheduleError(
            f"dualpipe needs an even number of microbatches >= 2 x ranks - 2 = {least} "
            f"(half enter at each end), got {microbatches} for {ranks} ranks",
            rule="unsupported",
        )


@register(
    "dualpipe",
    "DeepSeek DualPipe: two directions, each rank two model stages, F/B overlap pairs; "
    "p even, m even >= 2p-2",
    # The model is cut into ``ranks`` stages; the second stage on each rank is a copy.
    default_chunks=1,
    takes_chunks=False,
)
def dualpipe(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    _check(ranks, microbatches)
    half, half_mb = ranks // 2, microbatches // 2
    cut = dualpipev(half, half_mb, 2)
    acts: list[list[Action]] = []
    pairs: list[Overlap] = []
    for r in range(ranks):
        h = min(r, ranks - 1 - r)
        moved = _renamer(r, ranks, microbatches)
        acts.append([moved(a) for a in cut.actions[h]])
        pairs.extend((moved(f), moved(b)) for f, b in cut.overlaps if cut.placement[f.stage] == h)
    routes, copies = dualpipe_layout(ranks, microbatches)
    return Schedule(v_placement(ranks), acts, microbatches, "dualpipe", pairs, routes, copies)


def _renamer(rank: int, ranks: int, microbatches: int) -> Callable[[Action], Action]:
    """DualPipeV's (PP/2 ranks, m/2) action of rank ``h`` as DualPipe's rank ``rank`` runs it.

    DualPipeV's rank ``h`` holds stage ``h`` (its first chunk) and ``PP-1-h`` (its
    second); here the first is the direction that reaches ``rank`` first.
    """
    half, h = ranks // 2, min(rank, ranks - 1 - rank)
    down = (rank, 0)  # (stage, first microbatch of its direction)
    up = (2 * ranks - 1 - rank, microbatches // 2)
    first, second = (down, up) if rank < half else (up, down)
    table = {h: first, 2 * half - 1 - h: second}

    def moved(a: Action) -> Action:
        stage, offset = table[a.stage]
        return Action(a.kind, stage, None if a.microbatch is None else a.microbatch + offset)

    return moved
