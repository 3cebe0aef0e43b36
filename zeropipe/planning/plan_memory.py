"""Memory plans for the cluster search: fit a schedule into a per-rank limit with
recompute and activation offload, priced from the memory accounting alone.

Memory does not depend on timing, so no plan here is simulated: peaks come from
:func:`zeropipe.core.memory.peak_memory`, or (for a share of microbatches recomputed)
from :func:`share_peaks`, which walks the schedule instead of rewriting it.  Small
schedules go to :func:`zeropipe.core.passes.fit.fit_memory`, whose greedy search finds finer
plans but simulates at every step.  No torch here: this is core.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from zeropipe.core.costs import CostModel
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.memory import initial_memory, peak_memory
from zeropipe.core.passes.fit import LimitTooLow, checkpoint, fit_memory, offload

__all__ = [
    "FIT_PAIRS",
    "GiB",
    "MemoryPlan",
    "format_memory",
    "offload_floor",
    "peaks",
    "plan_memory",
    "recompute",
    "share_peaks",
]

GiB = float(2**30)
#: recompute is chosen per rank in steps of 1/_STEPS of its (stage, microbatch) pairs
_STEPS = 8
#: schedules with at most this many (stage, microbatch) pairs go to fit_memory, whose
#: greedy search finds finer plans but costs a simulation per step (minutes at scale)
FIT_PAIRS = 16


@dataclass
class MemoryPlan:
    """What :func:`plan_memory` chose for one schedule, and whether it fits."""

    schedule: Schedule  # compute-only, with R / OFFLOAD / RELOAD as chosen
    plan: str
    fits: bool
    recomputed: list[int]  # per stage, microbatches recomputed
    offloaded: bool = False  # every pair still to be recomputed and offloaded: see final()

    def final(self) -> Schedule:
        """The schedule to run: ``schedule``, recomputed and offloaded first when
        ``offloaded`` (a rewrite of seconds at scale, left until a plan is priced)."""
        return offload(recompute(self.schedule)) if self.offloaded else self.schedule


def peaks(schedule: Schedule, costs: CostModel) -> list[float]:
    """Per rank, the highest memory ``schedule`` holds under ``costs``."""
    return [p for p, _ in peak_memory(schedule, costs)]


def _spread(k: int, m: int) -> set[int]:
    """``k / _STEPS`` of microbatches 0..m-1, evenly spread (all of them for k = _STEPS)."""
    return {i for i in range(m) if (i + 1) * k // _STEPS > i * k // _STEPS}


_PLAIN = frozenset((Kind.F, Kind.B, Kind.I, Kind.W, Kind.REDUCE_GRAD))


def recompute(schedule: Schedule, which: Callable[[int, int], bool] | None = None) -> Schedule:
    """:func:`zeropipe.core.passes.fit.checkpoint` (``ahead=0``) of the pairs ``which`` chooses
    (None: all), in one pass when ``schedule`` is plain: compute only, with no R or copy
    yet.  Each R goes right before its pair's backward (its B, or its I when split), or
    before the forward overlapped with that backward, as ``checkpoint`` puts them;
    ``checkpoint`` itself scans a rank's actions for every pair (minutes for 10^5
    actions).  Other schedules go to it."""
    if any(a.kind not in _PLAIN for acts in schedule.actions for a in acts):
        return checkpoint(schedule, which)
    paired = {second: first for first, second in schedule.overlaps}
    out = []
    for acts in schedule.actions:
        lst: list[Action] = []
        for a in acts:
            i = a.microbatch
            if (
                a.kind in (Kind.B, Kind.I)
                and i is not None
                and (which is None or which(a.stage, i))
            ):
                r = Action(Kind.R, a.stage, i)
                first = paired.get(a)
                if first is not None and lst and lst[-1] == first:
                    lst.insert(len(lst) - 1, r)
                else:
                    lst.append(r)
            lst.append(a)
        out.append(lst)
    return schedule.replace_actions(out)


def _on_route(schedule: Schedule, stage: int, microbatches: Collection[int]) -> int:
    """How many of ``microbatches`` visit ``stage`` (all of them unless routes say)."""
    if not schedule.routes:
        return len(microbatches)
    return sum(stage in schedule.route(i) for i in microbatches)


def _recompute_share(schedule: Schedule, levels: Sequence[int]) -> Schedule:
    m = schedule.microbatches
    chosen = {s: _spread(levels[r], m) for s, r in enumerate(schedule.placement)}
    if not any(chosen.values()):
        return schedule
    return recompute(schedule, lambda s, i: i in chosen[s])


def share_peaks(base: Schedule, costs: CostModel, levels: Sequence[int]) -> list[float]:
    """The peaks :func:`_recompute_share` would give, without rewriting the schedule.

    Rewriting a schedule of tens of thousands of actions costs a quarter of a second;
    the binary search needs several.  :func:`zeropipe.core.passes.fit.checkpoint` (``ahead=0``)
    puts each R right before its backward, so walking ``base`` with the checkpointed
    pairs' F keeping ``ckpt`` and an R before their first backward gives the same
    accounting (:meth:`StageCost.held_change`).  ``base`` holds compute actions only.
    """
    m = base.microbatches
    chosen = {s: _spread(levels[r], m) for s, r in enumerate(base.placement)}
    out = []
    for level, acts in zip(initial_memory(base, costs), base.actions, strict=True):
        peak = level
        recomputed: set[tuple[int, int]] = set()
        for a in acts:
            i = a.microbatch
            if i is None or a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                continue
            c = costs.stages[a.stage]
            ckpt = i in chosen[a.stage]
            if ckpt and a.kind in (Kind.B, Kind.I) and (a.stage, i) not in recomputed:
                recomputed.add((a.stage, i))
                level += c.held_change(Kind.R)
                peak = max(peak, level)
            level += c.held_change(a.kind, checkpointed=ckpt)
            peak = max(peak, level)
        out.append(peak)
    return out


def offload_floor(base: Schedule, costs: CostModel) -> list[float]:
    """Per rank, a peak that ``base`` (compute only) with every microbatch recomputed and
    offloaded cannot go below, without rewriting it: each forward's kept input, until it
    is offloaded, and from the reload before its recompute to its backward the whole
    microbatch's activations, beside what W still waits for.  The rewrite holds at most
    one reloaded input more (the reload goes one action before its recompute)."""
    out = []
    for level, acts in zip(initial_memory(base, costs), base.actions, strict=True):
        peak = level
        back: set[tuple[int, int]] = set()
        for a in acts:
            i = a.microbatch
            if i is None or a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                continue
            c = costs.stages[a.stage]
            if a.kind is Kind.F:
                peak = max(peak, level + c.ckpt)
                continue
            if a.kind in (Kind.B, Kind.I) and (a.stage, i) not in back:
                back.add((a.stage, i))
                level += c.act
                peak = max(peak, level)
            level += c.held_change(a.kind, checkpointed=True)
            peak = max(peak, level)
        out.append(peak)
    return out


def plan_memory(base: Schedule, natural: CostModel, ckpt: CostModel, limit: float) -> MemoryPlan:
    """Fit ``base`` (compute-only) into ``limit`` per rank.

    Peaks come from the memory accounting alone (no simulation: memory does not
    depend on timing).  Small schedules go to :func:`zeropipe.core.passes.fit.fit_memory`; larger
    ones get, per rank, the least share of recomputed microbatches that fits (a rank
    recomputes only what its own peak needs), then everything recomputed and
    offloaded.  ``ckpt`` prices R and what a checkpointed forward keeps.
    """
    m, n = base.microbatches, base.num_stages
    none = [0] * n
    every = [_on_route(base, s, range(m)) for s in range(n)]  # microbatches per stage
    pairs = sum(every)
    natural_peaks = peaks(base, natural)
    if max(natural_peaks) <= limit:
        return MemoryPlan(base, "none", True, none)
    weights = max(initial_memory(base, ckpt))
    if weights > limit:
        what = "weights and workspace" if any(c.workspace for c in ckpt.stages) else "weights"
        return MemoryPlan(base, f"over: {what} alone {format_memory(weights, ckpt)}", False, none)
    if pairs <= FIT_PAIRS:
        try:
            fit = fit_memory(base, limit, ckpt)
        except LimitTooLow as exc:
            need = format_memory(max(exc.smallest), ckpt)
            return MemoryPlan(base, f"over: needs {need} even recomputed+offloaded", False, none)
        counts = [0] * n
        for s, _ in fit.recompute:
            counts[s] += 1
        parts = [f"recompute {len(fit.recompute)}"] if fit.recompute else []
        parts += [f"offload {len(fit.offload)}"] if fit.offload else []
        return MemoryPlan(
            fit.schedule, " + ".join(parts) + f" of {pairs} (fit_memory)", True, counts
        )
    # Per rank, a binary search for the least recompute level that fits: a rank's peak
    # depends only on what its own stages keep, so all ranks search at once.
    ranks = base.num_ranks
    low, high = [0] * ranks, [_STEPS + 1] * ranks  # level high: known to fit (or none)
    while any(lo < hi - 1 for lo, hi in zip(low, high, strict=True)):
        mid = [(lo + hi) // 2 if lo < hi - 1 else hi for lo, hi in zip(low, high, strict=True)]
        level = [min(x, _STEPS) for x in mid]
        for r, p in enumerate(share_peaks(base, ckpt, level)):
            if low[r] < high[r] - 1:
                if mid[r] <= _STEPS and p <= limit:
                    high[r] = mid[r]
                else:
                    low[r] = mid[r]
    if max(high) <= _STEPS:
        sched = _recompute_share(base, high)
        counts = [_on_route(base, s, _spread(high[r], m)) for s, r in enumerate(sched.placement)]
        share = sum(counts) / pairs
        plan = "recompute all" if share == 1 else f"recompute {share:.0%}"
        return MemoryPlan(sched, plan, True, counts)
    # Offload moves only what a checkpointed forward keeps: if what a rank holds even so
    # is over, the (slow) rewrite cannot fit.
    hopeless = max(offload_floor(base, ckpt))
    if hopeless > limit:
        need = format_memory(hopeless, ckpt)
        return MemoryPlan(base, f"over: needs > {need} recomputed+offloaded", False, none)
    # The rewrite holds at most one reloaded input more than the floor, and one input
    # whose offload waits for the end of an overlapped pair: within that, it fits.
    if hopeless + 2 * max(c.ckpt for c in ckpt.stages) <= limit:
        return MemoryPlan(base, "recompute + offload all", True, every, offloaded=True)
    everything = offload(recompute(base))
    floor = max(peaks(everything, ckpt))
    if floor <= limit:
        return MemoryPlan(everything, "recompute + offload all", True, every)
    return MemoryPlan(
        base, f"over: needs {format_memory(floor, ckpt)} recomputed+offloaded", False, none
    )


def format_memory(value: float, costs: CostModel) -> str:
    return f"{value / GiB:.1f} GiB" if costs.unit == "bytes" else f"{value:.4g} {costs.unit}"
