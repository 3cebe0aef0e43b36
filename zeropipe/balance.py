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

The flow from a model to a schedule, all here: :func:`layer_costs` profiles
each layer; :func:`balance` cuts by those times; :func:`stage_costs` sums the
layer costs into the stages' cost model; :func:`plan` does all three for
every chunk count the auto search considers and returns the best schedule
with the cut that goes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from zeropipe.costs import CostModel, StageCost
from zeropipe.errors import PipelineError, ScheduleError
from zeropipe.ir import Kind, Schedule

__all__ = [
    "Plan",
    "balance",
    "balance_by_time",
    "layer_costs",
    "plan",
    "split_layers",
    "stage_costs",
    "stage_times",
]


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


def split_layers(
    model: nn.Sequential | Sequence[nn.Module], cut: Sequence[int]
) -> list[nn.Sequential]:
    """The model's layers in consecutive ``nn.Sequential`` stages of ``cut`` layers each."""
    layers = list(model.children()) if isinstance(model, nn.Sequential) else list(model)
    if sum(cut) != len(layers) or min(cut, default=0) < 1:
        raise PipelineError(
            f"cut {list(cut)} must be positive layer counts summing to the model's {len(layers)}"
        )
    out, start = [], 0
    for count in cut:
        out.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return out


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


# -- from a model ---------------------------------------------------------------------------
def layer_costs(
    model: nn.Sequential,
    sample: Tensor | Sequence[Tensor],
    *,
    target: Tensor | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    **options: Any,
) -> CostModel:
    """Profile every layer of ``model`` as its own stage (see :func:`zeropipe.profile`)."""
    from zeropipe.profiling import profile

    return profile(list(model.children()), sample, target=target, loss_fn=loss_fn, **options)


def balance_by_time(
    model: nn.Sequential,
    sample: Tensor | Sequence[Tensor],
    parts: int,
    *,
    target: Tensor | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    memory_limit: float | None = None,
    **options: Any,
) -> list[int]:
    """Profile each layer (forward + full backward) and :func:`balance` the model into ``parts``.

    ``memory_limit`` caps each stage's activation bytes per microbatch.
    """
    costs = layer_costs(model, sample, target=target, loss_fn=loss_fn, **options)
    times = [c.F + c.time(Kind.B) for c in costs.stages]
    memory = [c.act for c in costs.stages] if memory_limit is not None else None
    return balance(times, parts, memory=memory, memory_limit=memory_limit)


@dataclass
class Plan:
    """A schedule for a model: the cut (layers per stage), its cost model, and why."""

    schedule: Schedule
    balance: list[int]
    costs: CostModel
    explanation: str


def plan(
    model: nn.Sequential,
    sample: Tensor | Sequence[Tensor],
    ranks: int,
    microbatches: int,
    *,
    target: Tensor | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    layers: CostModel | None = None,
    max_chunks: int = 2,
    **options: Any,
) -> Plan:
    """Profile ``model`` layer by layer, then search schedules, each cut balanced for its stages.

    For every chunk count ``v`` the search considers, the model is balanced
    into ``ranks * v`` stages by measured forward + backward time and the
    stages' costs are the sums of their layers'.  ``layers`` skips the
    profiling (per-layer costs measured before); ``memory_limit`` is in bytes
    of activations per rank; ``options`` go to :func:`zeropipe.profile`.
    The runtime's ``schedule="auto"`` without costs calls this.
    """
    from zeropipe.schedules.auto import search

    if layers is None:
        layers = layer_costs(model, sample, target=target, loss_fn=loss_fn, **options)
    times = [c.F + c.time(Kind.B) for c in layers.stages]
    n = len(layers.stages)
    cuts: dict[int, list[int]] = {}

    def costs(num_stages: int) -> CostModel | None:
        if num_stages > n:
            return None  # a stage needs at least one layer
        cuts[num_stages] = cut = balance(times, num_stages)
        return stage_costs(layers, cut)

    if n < ranks:
        raise PipelineError(f"the model has {n} layer(s), too few for {ranks} ranks")
    most = max(1, min(max_chunks, n // ranks))
    result = search(costs, ranks, microbatches, memory_limit, max_chunks=most)
    cut = cuts[result.schedule.num_stages]
    return Plan(result.schedule, cut, result.costs, result.explanation + f"; cut {cut}")
