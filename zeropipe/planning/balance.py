"""Balance layers into pipeline stages: contiguous groups whose slowest one is as fast as can be.

A pipeline runs at the pace of its slowest stage, so the cut of an
``nn.Sequential`` into ``p`` stages should minimise the largest per-stage
time (torchgpipe's ``balance_by_time``), optionally with each stage's memory
under a cap.  :func:`balance` is exact: the best largest-stage time is one of
the sums of a contiguous run of layers, and for a candidate ``T`` a greedy
left-to-right fill (start a new stage when the next layer would push the time
over ``T`` or the memory over its cap) uses the fewest stages possible, so a
binary search over the sorted candidates finds the least feasible ``T``::

    layer times   1 1 1 8 1 1 1 1            p = 3
    uniform       [1 1 1][8 1 1][1 1]        slowest 10
    balanced      [1 1 1][8][1 1 1 1]        slowest 8

Everything here is arithmetic on numbers (no torch): :func:`balance` cuts by
layer times, :func:`even_cut` by layer counts, :func:`stage_costs` sums layer
costs into the stages' cost model.  Profiling the layers and searching a
schedule for each cut is the planning layer's (:mod:`zeropipe.planning.plan`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.simulate import simulate

__all__ = ["balance", "balance_schedule", "even_cut", "stage_costs", "stage_times"]


def balance(
    times: Sequence[float],
    parts: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> list[int]:
    """Layers per stage (``parts`` positive counts summing to ``len(times)``).

    Minimises the largest stage total of ``times`` (pass memory as ``times``
    to balance memory instead); with ``memory`` and ``memory_limit`` every
    stage's memory total must also stay within the limit.  Among cuts with the
    same slowest stage, layers go as early as possible.
    """
    n = len(times)
    if parts < 1:
        raise ScheduleError(f"parts must be >= 1, got {parts}")
    if n < parts:
        raise ScheduleError(
            f"cannot cut {n} layer(s) into {parts} stages: each stage needs at least one layer"
        )
    if any(t < 0 for t in times):
        raise ScheduleError("layer times must be >= 0")
    mem = list(memory) if memory is not None else [0.0] * n
    if len(mem) != n:
        raise ScheduleError(f"memory has {len(mem)} value(s) for {n} layer(s)")
    cap = float("inf") if memory_limit is None else float(memory_limit)
    if max(mem, default=0.0) > cap:
        worst = max(range(n), key=lambda k: mem[k])
        raise ScheduleError(
            f"layer {worst} alone needs {mem[worst]:g} of memory, over the limit {cap:g}"
        )
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    sums = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})
    lo = 0
    hi = len(sums) - 1
    widest = _greedy(times, mem, sums[hi], cap)
    if widest is None or len(widest) > parts:
        raise ScheduleError(
            f"no cut into {parts} stages keeps every stage's memory within {cap:g}; "
            f"use more stages or raise the limit"
        )
    while lo < hi:
        mid = (lo + hi) // 2
        cut = _greedy(times, mem, sums[mid], cap)
        if cut is not None and len(cut) <= parts:
            hi = mid
        else:
            lo = mid + 1
    cut = _greedy(times, mem, sums[lo], cap)
    assert cut is not None  # sums[lo] is feasible by the search
    return _pad(cut, parts)


def balance_schedule(
    layers: CostModel, schedule: Schedule, *, exhaustive_limit: int = 2000
) -> list[int]:
    """Layers per stage for ``schedule``: the cut whose simulated step is shortest.

    ``layers`` holds one :class:`StageCost` per layer (``zeropipe.planning.plan.layer_costs``
    measures them).  :func:`balance` evens out the stages' times, which is
    right when each rank holds one stage; when ranks hold several (interleaved,
    V-shaped), what bounds the step is each rank's total and where the
    dependencies make it wait -- a V on two ranks pairs the first and last
    stages, so an embedding and a head can share a rank with fewer blocks than
    the middle stages get.  This simulates ``schedule`` under each candidate
    cut's summed costs (:func:`stage_costs`): every cut when there are at most
    ``exhaustive_limit``, else a descent from :func:`balance`'s cut and the
    even cut, moving one or two boundaries by one layer at a time.  Ties go to
    the cut with the slowest stage fastest.
    """
    n, parts = len(layers.stages), schedule.num_stages
    times = [c.F + c.time(Kind.B) for c in layers.stages]
    seeds = [balance(times, parts), even_cut(n, parts)]

    def score(cut: Sequence[int]) -> tuple[float, float]:
        timeline = simulate(schedule, stage_costs(layers, cut))
        return (_rounded(timeline.makespan), _rounded(max(stage_times(times, cut))))

    if math.comb(n - 1, parts - 1) <= exhaustive_limit:
        candidates = [
            [b - a for a, b in zip((0, *inner), (*inner, n), strict=True)]
            for inner in itertools.combinations(range(1, n), parts - 1)
        ]
        return min(candidates, key=score)
    best, best_score = seeds[0], score(seeds[0])
    for seed in seeds:
        current, current_score = seed, score(seed)
        improved = True
        while improved:
            improved = False
            for candidate in _neighbours(current):
                s = score(candidate)
                if s < current_score:
                    current, current_score, improved = candidate, s, True
                    break
        if current_score < best_score:
            best, best_score = current, current_score
    return best


def _rounded(seconds: float) -> float:
    # Four significant digits: differences below that are measurement noise, and rounding
    # them away lets the tie-break decide.
    return float(f"{seconds:.4g}")


def _neighbours(cut: list[int]) -> list[list[int]]:
    """Valid cuts one or two boundary moves (of one layer each) away from ``cut``."""
    moves = [(b, d) for b in range(len(cut) - 1) for d in (-1, 1)]

    def moved(c: list[int], b: int, d: int) -> list[int]:
        c = list(c)
        c[b] += d  # the boundary after stage b moves by d layers
        c[b + 1] -= d
        return c

    out = [moved(cut, b, d) for b, d in moves]
    for k, (b1, d1) in enumerate(moves):
        for b2, d2 in moves[k + 1 :]:
            if b1 != b2:
                out.append(moved(moved(cut, b1, d1), b2, d2))
    return [c for c in out if min(c) >= 1]


def _greedy(
    times: Sequence[float], mem: Sequence[float], limit: float, cap: float
) -> list[int] | None:
    """Fewest stages with time <= ``limit`` and memory <= ``cap`` each, filled left to right."""
    out: list[int] = []
    t = m = 0.0
    count = 0
    eps = 1e-12 * max(1.0, limit)
    for ti, mi in zip(times, mem, strict=True):
        if ti > limit + eps:
            return None
        if count and (t + ti > limit + eps or m + mi > cap):
            out.append(count)
            t = m = 0.0
            count = 0
        t, m, count = t + ti, m + mi, count + 1
    out.append(count)
    return out


def _pad(cut: list[int], parts: int) -> list[int]:
    """Split the largest groups until there are ``parts`` (splitting never slows a stage)."""
    cut = list(cut)
    while len(cut) < parts:
        k = max(range(len(cut)), key=lambda j: cut[j])
        first = cut[k] // 2
        cut[k : k + 1] = [first, cut[k] - first]
    return cut


def stage_times(times: Sequence[float], cut: Sequence[int]) -> list[float]:
    """Per stage, the total of ``times`` over its layers."""
    out, start = [], 0
    for count in cut:
        out.append(float(sum(times[start : start + count])))
        start += count
    return out


def even_cut(layers: int, parts: int) -> list[int]:
    """Layers per stage when every layer counts the same: the first ``layers % parts`` get one more.

    ``even_cut(10, 4) == [3, 3, 2, 2]``.
    """
    if parts < 1:
        raise ScheduleError(f"parts must be >= 1, got {parts}")
    if layers < parts:
        raise ScheduleError(
            f"cannot cut {layers} layer(s) into {parts} stages: each stage needs at least one "
            f"layer; use fewer stages (ranks x chunks) or a deeper model"
        )
    base, extra = divmod(layers, parts)
    return [base + (1 if s < extra else 0) for s in range(parts)]


def stage_costs(layers: CostModel, cut: Sequence[int]) -> CostModel:
    """Per-layer costs summed into stages (times, memory; a stage's boundary is its last layer's).

    Summing ignores what fusing layers into one stage would save or cost; profile
    the cut stages themselves (:func:`zeropipe.profile`) for the exact figures.
    """
    if sum(cut) != len(layers.stages) or min(cut, default=0) < 1:
        raise ScheduleError(
            f"cut {list(cut)} must be positive layer counts summing to the {len(layers.stages)} "
            f"layers of the cost model"
        )
    stages, start = [], 0
    for count in cut:
        group = layers.stages[start : start + count]
        stages.append(StageCost.merged(group))
        start += count
    meta = {**layers.meta, "cut": list(cut)}
    return replace(layers, stages=tuple(stages), meta=meta)
