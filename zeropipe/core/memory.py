"""What a schedule holds in memory under a cost model: each action's change, each rank's peak.

Memory is in the cost model's unit (:mod:`zeropipe.core.costs`): a forward holds its
stage's ``act`` until its backward (or less, checkpointed, until R), OFFLOAD and RELOAD move
a microbatch's held activations away and back, and weight OFFLOAD/RELOAD a stage's weights;
a ``microbatch_scale`` scales what each microbatch holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, offloaded_at_start
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import KINDS, Kind, Schedule

__all__ = ["initial_memory", "memory_deltas", "peak_memory", "per_rank"]

_NO = {k: n for n, k in enumerate(KINDS)}
_HELD_FIXED = frozenset(_NO[k] for k in (Kind.B, Kind.I, Kind.W, Kind.R))


def memory_deltas(
    schedule: Schedule, costs: CostModel, deps: Dependencies | None = None
) -> list[list[float]]:
    """Per rank, the change in held memory caused by each action, in program order."""
    deps = deps or Dependencies(schedule)
    costs.for_stages(schedule.num_stages, schedule.microbatches)
    stages, scale = costs.stages, costs.microbatch_scale
    f, offload, reload = _NO[Kind.F], _NO[Kind.OFFLOAD], _NO[Kind.RELOAD]
    # B, I, W and R of a stage change memory by the same amount every time.
    fixed: dict[int, float] = {}  # stage << 4 | kind_no -> change
    out: list[list[float]] = []
    for acts in schedule.actions:
        held: dict[int, float] = {}  # what each (s,i) holds on this rank now, by mb << 32 | s
        deltas: list[float] = []
        for a in acts:
            kind, s, i = a.kind_no, a.stage, a.microbatch
            d = 0.0
            if i is None:
                if a.kind is not Kind.REDUCE_GRAD:  # the gradients are held, reduced or not
                    d = -stages[s].weights if kind == offload else stages[s].weights
            elif kind == f:
                d = stages[s].held_change(Kind.F, checkpointed=deps.checkpointed(s, i))
                d = held[(i << 32) | s] = d * scale[i] if scale else d
            elif kind in _HELD_FIXED:
                key = (s << 4) | kind
                got = fixed.get(key)
                d = fixed[key] = stages[s].held_change(a.kind) if got is None else got
                d = d * scale[i] if scale else d
            elif kind == offload:
                d = -held.get((i << 32) | s, 0.0)
            elif kind == reload:
                d = held.get((i << 32) | s, 0.0)
            deltas.append(d)
        out.append(deltas)
    return out


def initial_memory(schedule: Schedule, costs: CostModel) -> list[float]:
    """Memory each rank holds before its first action: the weights that start resident, and
    the largest ``workspace`` of its stages (a backward's, reserved for the whole step; for
    the largest microbatch where microbatches have sizes of their own).

    A stage whose first weight action is a RELOAD starts offloaded.
    """
    largest = max(costs.microbatch_scale, default=1.0)
    out = []
    for rank in range(schedule.num_ranks):
        away = offloaded_at_start(schedule, rank)
        mine = schedule.stages_of(rank)
        weights = sum(costs.stages[s].weights for s in mine if s not in away)
        workspace = max((costs.stages[s].workspace for s in mine), default=0.0)
        out.append(weights + largest * workspace)
    return out


def peak_memory(
    schedule: Schedule, costs: CostModel, deps: Dependencies | None = None
) -> list[tuple[float, int]]:
    """Per rank ``(peak, step)``: the highest memory held and the step that reached it."""
    peaks = []
    for start, deltas in zip(
        initial_memory(schedule, costs), memory_deltas(schedule, costs, deps), strict=True
    ):
        level, best, at = start, start, -1
        for step, d in enumerate(deltas):
            level += d
            if level > best + 1e-12:
                best, at = level, step
        peaks.append((best, at))
    return peaks


def per_rank(limit: float | Sequence[float], ranks: int, what: str = "memory_limit") -> list[float]:
    """A limit for every rank: one number for all, or one number per rank."""
    if isinstance(limit, (int, float)):
        return [float(limit)] * ranks
    values = [float(v) for v in limit]
    if len(values) != ranks:
        raise ScheduleError(
            f"{what} has {len(values)} value(s) for {ranks} rank(s); give one or {ranks}"
        )
    return values
