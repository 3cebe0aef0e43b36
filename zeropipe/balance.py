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
schedule for each cut is the planning layer's (:mod:`zeropipe.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from zeropipe.costs import CostModel, StageCost
from zeropipe.errors import ScheduleError

__all__ = ["balance", "even_cut", "stage_costs", "stage_times"]


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
