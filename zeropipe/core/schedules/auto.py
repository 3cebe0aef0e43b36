"""``auto``: search for the schedule with the shortest simulated step under a cost model.

Named schedules assume equal stages and F = I = W; real models do not.  The
search takes the model as it is -- per-stage F, I, W, B, activation memory,
the wire -- and a per-rank memory limit, and times candidates of three kinds with the
list scheduler (:mod:`zeropipe.core.schedules.list_scheduler`: the simulator's
dependency and cost models, in an event loop fast enough to run hundreds of times)::

    list-scheduled   placements: looped with 1..v chunks per rank, V / zig-zag with an
                     even number; whenever a rank is free it picks among what is ready:
                       I (or B)  as soon as its gradient is there: critical path, frees memory
                       F         while the memory limit allows, keeping room for the deeper
                                 local stages' F (one at least, or the V starves; more with
                                 ``reserve``: their round trip over the rank's cycle)
                       W         into gaps the rank would otherwise idle through (a gap of
                                 at least ``gap`` x W), or when an F waits for W's memory
    re-timed named   each named schedule's F / I order, with its W placed anew as above
    named            each named schedule as it is, if it fits: auto is never worse
    grouped          the verified ones again with each stage's W in groups of 2 and 4, when
                     the costs say W run together are cheaper (``W_fused``, zeropipe.core.passes.fuse)

The best few by that timing are then validated (:func:`zeropipe.core.validate.validate`
with the memory limit) and simulated (:func:`zeropipe.core.simulate.simulate`): those
two are the ground truth; the winner has the shortest makespan, then the lowest
steady bubble.  Recompute and offload come in through
:func:`zeropipe.core.passes.fit.fit_memory` applied to the best schedule found without a
limit: when nothing fits without them, or on request (``recompute=True``).

Only those few matter, which keeps the search fast without changing its answer: a
list run is given up once it cannot end before the best few found so far (ties
included), the most promising runs go first so that this happens early, and policies
that differ only where a run never asks share that run
(:mod:`zeropipe.core.schedules.auto_timing`).

Costs: a :class:`~zeropipe.core.costs.CostModel` with ``p`` stages is read as "one
rank's worth of layers per stage" and is split evenly for ``v`` chunks per
rank (and one with ``p*v`` stages is merged for fewer chunks); pass a callable
``num_stages -> CostModel | None`` to give each cut its own (e.g. balanced)
costs, as :func:`zeropipe.planning.balance.plan` does.  A schedule whose stages copy
others (dualpipe: ``ranks`` model stages, each run again by the other direction) is priced
on the cut into its model stages, each copy costing what its original costs, its
weights held twice (:func:`costs_for_schedule`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.memory import peak_memory, per_rank
from zeropipe.core.passes.fuse import group_weights
from zeropipe.core.schedules.auto_timing import Run, time_runs
from zeropipe.core.schedules.list_scheduler import (
    ListPlan,
    Policy,
    Step,
    compute_order,
    placement_of,
)
from zeropipe.core.schedules.registry import GENERATORS, register
from zeropipe.core.simulate import Timeline, simulate
from zeropipe.core.validate import validate

__all__ = [
    "AutoResult",
    "Candidate",
    "Policy",
    "auto_schedule",
    "costs_for",
    "costs_for_schedule",
    "default_policies",
    "search",
]

CostsLike = CostModel | Callable[[int], CostModel | None]
_EPS = 1e-9


# -- costs for a given number of stages -------------------------------------------------
def costs_for(costs: CostsLike, num_stages: int) -> CostModel | None:
    """``costs`` for a model cut into ``num_stages`` stages, or ``None`` if they do not say.

    A callable is asked (and may answer ``None``: no such cut).
    A model with ``n`` stages is split evenly (each stage into ``num_stages/n``
    equal parts: times and memory divided, boundary size kept) or merged
    (consecutive groups summed) when one count divides the other.
    """
    if not isinstance(costs, CostModel):
        made = costs(num_stages)
        return None if made is None else made.for_stages(num_stages)
    n = len(costs.stages)
    if n == num_stages:
        return costs
    if num_stages % n == 0:
        k = num_stages // n
        stages = tuple(s.scaled(1.0 / k) for s in costs.stages for _ in range(k))
        how = f"each of {n} stage(s) split into {k}"
    elif n % num_stages == 0:
        k = n // num_stages
        stages = tuple(
            StageCost.merged(costs.stages[g * k : (g + 1) * k]) for g in range(num_stages)
        )
        how = f"{n} stages merged in groups of {k}"
    else:
        return None
    return replace(costs, stages=stages, meta={**costs.meta, "derived": how})


def costs_for_schedule(costs: CostsLike, schedule: Schedule) -> CostModel | None:
    """``costs`` for the stages ``schedule`` runs, or ``None`` if they do not say.

    The model is cut into the schedule's original stages (:func:`costs_for`); a stage
    that copies another (``Schedule.copies``, dualpipe's second direction) costs what its
    original costs, weights included (:meth:`CostModel.with_copies`).
    """
    cut = costs_for(costs, schedule.num_stages - len(schedule.copies))
    return None if cut is None else cut.with_copies(schedule)


# -- the search -----------------------------------------------------------------------------
@dataclass
class Candidate:
    """One schedule the search timed: ``source`` is ``"list"`` (list-scheduled) or ``"named"``.

    ``makespan`` and ``steady`` (steady bubble rate) come from the list
    scheduler until the candidate is verified, then from the simulator, whose
    ``timeline`` is kept.
    """

    name: str
    source: str
    costs: CostModel
    makespan: float
    steady: float
    timeline: Timeline | None = None
    _shape: Schedule | None = field(default=None, repr=False)  # placement, microbatches
    _steps: list[list[Step]] | None = field(default=None, repr=False)

    @property
    def schedule(self) -> Schedule:
        """Built on first use: most candidates are only ever compared by their times."""
        assert self._shape is not None  # always set by search()
        if self._steps is not None:
            acts = [[Action(*step) for step in rank] for rank in self._steps]
            self._shape = Schedule(self._shape.placement, acts, self._shape.microbatches, "auto")
            self._steps = None
        return self._shape


@dataclass
class AutoResult:
    """What :func:`search` chose, with the cost model of its stages, and why."""

    schedule: Schedule
    costs: CostModel
    timeline: Timeline
    explanation: str
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0


def default_policies(ranks: int, max_chunks: int, split_options: Sequence[bool]) -> list[Policy]:
    """The default grid of list-scheduler points, most promising first."""
    shapes = [("v", v) for v in range(2, max_chunks + 1, 2)]
    shapes += [("looped", v) for v in range(1, max_chunks + 1)]
    out = []
    for kind, v in shapes:
        if ranks == 1 and (kind == "v" or v > 1):
            continue
        for split in split_options:
            for reserve in (2.0, 1.0, 0.0) if kind == "v" or v > 1 else (0.0,):
                for gap in (0.0, 0.5, 1.0) if split else (0.0,):
                    for first in ("I", "F"):
                        out.append(Policy(kind, v, split, gap, first, True, reserve))
    return out


Limit = float | Sequence[float] | str | None


def _limits(memory_limit: Limit, ranks: int, m: int, costs: CostsLike) -> list[float]:
    if memory_limit is None:
        return [math.inf] * ranks
    if isinstance(memory_limit, str):
        return [_reference_peak(memory_limit, ranks, m, costs)] * ranks
    return per_rank(memory_limit, ranks)


def _reference_peak(name: str, ranks: int, m: int, costs: CostsLike) -> float:
    """The highest per-rank peak of the named schedule ``name`` under ``costs``."""
    gen = GENERATORS.get(name)
    if gen is None or name == "auto":
        known = ", ".join(sorted(set(GENERATORS) - {"auto"}))
        raise ScheduleError(
            f"memory_limit={name!r}: expected a number or a named schedule whose peak to "
            f"match ({known})",
            rule="unsupported",
        )
    sched = gen.build(ranks, m, gen.default_chunks)
    c = costs_for_schedule(costs, sched)
    if c is None:
        raise ScheduleError(
            f"memory_limit={name!r}: the cost model has no figures for {name}'s "
            f"{sched.num_stages} stages",
            rule="unsupported",
        )
    return max(p for p, _ in peak_memory(sched, c))


def _named_schedules(
    ranks: int, m: int, costs: CostsLike, max_chunks: int
) -> list[tuple[str, Schedule, CostModel]]:
    """Every registered generator's schedules with at most ``max_chunks`` chunks per rank."""
    out = []
    for name, gen in sorted(GENERATORS.items()):
        if name == "auto":
            continue
        options = range(1, max_chunks + 1) if gen.takes_chunks else [gen.default_chunks]
        for v in (v for v in options if v <= max_chunks):
            try:
                sched = gen.build(ranks, m, v)
            except ScheduleError:
                continue  # this (ranks, m, chunks) is outside what the generator makes
            c = costs_for_schedule(costs, sched)
            if c is not None:
                out.append((name if not gen.takes_chunks else f"{name} v={v}", sched, c))
    return out


def search(
    costs: CostsLike,
    ranks: int,
    microbatches: int,
    memory_limit: Limit = None,
    *,
    max_chunks: int = 2,
    policies: Sequence[Policy] | None = None,
    named: bool = True,
    verify: int = 3,
    time_budget: float = 40.0,
    recompute: bool | None = None,
) -> AutoResult:
    """Search for the schedule with the shortest simulated makespan that fits ``memory_limit``.

    Args:
        costs: a cost model (``ranks`` stages = one rank's worth each, or
            ``ranks * v`` stages) or a callable ``num_stages -> CostModel``.
        memory_limit: per rank (one number or one per rank), in the cost
            model's memory unit, weights included; the name of a schedule
            (``"1f1b"``): no more than its peak; ``None``: no limit.
        max_chunks: the most chunks (stages) per rank to consider.
        policies: list-scheduler points to try (default: a small grid).
        named: also consider every registered named generator: as it is if it
            fits, and as a template (its F / I order, with the W placed anew).
        verify: how many of the best list-scheduled candidates to validate and
            simulate for real (the named ones always are).
        time_budget: seconds after which no further list-scheduler run starts.
        recompute: also fit the best schedule found without a limit into the
            limit with recompute and offload (:func:`zeropipe.core.passes.fit.fit_memory`,
            slow beyond a few hundred actions); ``None``: only when nothing
            fits without them.
    """
    if ranks < 1 or microbatches < 1 or max_chunks < 1:
        raise ScheduleError(
            f"ranks, microbatches and max_chunks must be >= 1, got {ranks}, {microbatches}, "
            f"{max_chunks}",
            rule="unsupported",
        )
    start = time.perf_counter()
    costs = _remembered(costs)
    limits = _limits(memory_limit, ranks, microbatches, costs)
    runs = _runs(costs, ranks, microbatches, max_chunks, policies, named)
    plans, cut = time_runs(runs, microbatches, limits, max(verify, 0), start + time_budget)
    listed = _listed(runs, plans)
    listed.sort(key=_rank)
    tried, best_named = _to_verify(listed, verify)
    scored = _verified(tried, limits)
    scored += _grouped(scored, limits)
    finite = any(math.isfinite(x) for x in limits)
    if finite and (recompute or (recompute is None and not scored)):
        try:
            scored.append(
                _fit(costs, ranks, microbatches, limits, max_chunks, policies, named, verify)
            )
        except ScheduleError:
            if not scored:
                raise  # fit_memory's error names the smallest limit that fits
    if not scored:
        raise _nothing_fits(costs, ranks, limits)
    scored.sort(key=_rank)
    best = scored[0]
    seconds = time.perf_counter() - start
    counts = f"{len(listed)} candidates fit, {cut} cut short, {len(scored)} verified"
    explanation = _explain(best, best_named, limits, counts, seconds)
    sched = best.schedule if best.source == "list" else _renamed(best.schedule, "auto")
    assert best.timeline is not None  # set for every scored candidate
    return AutoResult(sched, best.costs, best.timeline, explanation, listed, seconds)


def _runs(
    costs: CostsLike,
    ranks: int,
    m: int,
    max_chunks: int,
    policies: Sequence[Policy] | None,
    named: bool,
) -> list[Run]:
    """Every candidate to time: the named schedules as they are, their F / I orders with
    the W placed anew, then the list-scheduler ``policies`` (default: a small grid)."""
    base = costs_for(costs, ranks)
    split_options = [True]
    if base is None or any(c.time(Kind.B) < c.I + c.W - _EPS for c in base.stages):
        split_options.append(False)  # a fused backward is cheaper: try it too
    named_runs = _named_schedules(ranks, m, costs, max_chunks) if named else []
    runs: list[Run] = []
    for label, sched, c in named_runs:
        chunks = sched.num_stages // ranks
        # Exact replay: its makespan as simulated, and whether it fits.
        runs.append((label, "named", Policy("named", chunks), sched, c, None))
    for label, sched, c in named_runs:
        if sched.routes:
            continue  # the list scheduler sends every microbatch through every stage
        # Its F / I order with the W placed by the list scheduler for these costs.
        template = compute_order(sched, keep_w=False)
        for gap in (0.0, 0.5, 1.0):
            policy = Policy("order", sched.num_stages // ranks, True, gap)
            runs.append((f"{label}'s F/I order, W placed anew", "list", policy, sched, c, template))
    for policy in (
        policies if policies is not None else default_policies(ranks, max_chunks, split_options)
    ):
        place = placement_of(policy.placement, ranks, policy.chunks)
        derived = costs_for(costs, len(place))
        if derived is not None:
            shape = Schedule(place, [[] for _ in range(ranks)], m, "auto")
            runs.append((policy.describe(), "list", policy, shape, derived, None))
    return runs


def _listed(runs: Sequence[Run], plans: Sequence[ListPlan | None]) -> list[Candidate]:
    """The runs that fit as candidates, in the order of ``runs``, timed by their plans."""
    listed = []
    for (label, source, _, sched, c, _), plan in zip(runs, plans, strict=True):
        if plan is not None:
            steps = plan.steps if source == "list" else None
            listed.append(
                Candidate(label, source, c, plan.makespan, plan.steady, None, sched, steps)
            )
    return listed


def _to_verify(
    listed: Sequence[Candidate], verify: int
) -> tuple[list[Candidate], Candidate | None]:
    """The candidates to verify: the best ``verify`` of ``listed`` (sorted) and the best
    named one, as auto is never worse than a named schedule that fits; and that named one."""
    tried = list(listed[:verify])
    best_named = next((c for c in listed if c.source == "named"), None)
    if best_named is not None and all(c is not best_named for c in tried):
        tried.append(best_named)
    return tried, best_named


def _rank(cand: Candidate) -> tuple[float, float, bool]:
    """How candidates sort: shortest makespan, then lowest steady bubble, then named first
    (both rounded, so that float noise does not decide)."""
    return round(cand.makespan, 9), round(cand.steady, 9), cand.source != "named"


def _nothing_fits(costs: CostsLike, ranks: int, limits: Sequence[float]) -> ScheduleError:
    return ScheduleError(
        f"no schedule without recompute or offload fits a memory limit of "
        f"{_fmt_limits(limits)} per rank on {ranks} rank(s): each rank needs at least its "
        f"weights plus one microbatch's activations of all its stages "
        f"({_least_memory(costs, ranks):g} here); raise the limit or allow recompute",
        rule="memory",
    )


def _explain(
    best: Candidate,
    best_named: Candidate | None,
    limits: Sequence[float],
    counts: str,
    seconds: float,
) -> str:
    """The one-line explanation of the winner ``best``: how it was made, its figures, how
    it compares with the best named schedule, and ``counts`` of the candidates."""
    if best_named is None:
        versus = "no named schedule fits"
    elif best.source == "named":
        versus = "no list-scheduled candidate beat it"
    else:
        gain = 1 - best.makespan / best_named.makespan
        versus = f"best named {best_named.name}: {best_named.makespan:.5g}, -{gain:.1%}"
    how = best.name if best.source != "named" else f"the named schedule {best.name}"
    tl = best.timeline
    assert tl is not None  # set for every verified candidate
    return (
        f"auto: {how}; makespan {tl.makespan:.5g} ({versus}); steady bubble "
        f"{tl.steady_bubble_rate:.4f}; peak {max(tl.peak_memory):.4g} of limit "
        f"{_fmt_limits(limits)} {best.costs.unit}; {counts}, {seconds:.2g} s"
    )


def _verified(tried: Sequence[Candidate], limits: list[float]) -> list[Candidate]:
    """``tried`` validated and simulated (the ground truth); those that fail are dropped.

    Candidates that share one list-scheduled plan share its schedule and its check.
    """
    done: dict[int, tuple[Schedule, Timeline | None]] = {}
    scored = []
    for cand in tried:
        key = id(cand._steps) if cand._steps is not None else None
        if key is not None and key in done:
            cand._shape, cand._steps = done[key][0], None
            tl = done[key][1]
        else:
            sched = cand.schedule
            try:
                graph = validate(sched, memory_limit=limits, costs=cand.costs)
            except ScheduleError:
                graph = None  # a list-scheduler bug must not win; the ground truth decides
            tl = None if graph is None else simulate(sched, cand.costs, graph=graph)
            if key is not None:
                done[key] = (sched, tl)
        if tl is None:
            continue
        cand.timeline = tl
        cand.makespan = tl.makespan
        cand.steady = tl.steady_bubble_rate
        scored.append(cand)
    return scored


def _grouped(scored: Sequence[Candidate], limits: list[float]) -> list[Candidate]:
    """The verified candidates again with each stage's W gathered in groups of 2 and 4.

    Only where the costs say a W run together with the next is cheaper
    (``W_fused``): the runtime then does each group as one product per weight.
    Candidates made of B are grouped too (each B split into I then W first);
    the simulation says whether that beats their fused backward.
    """
    out = []
    done: dict[tuple[int, int], tuple[Schedule, Timeline] | None] = {}  # shared schedules
    for cand in scored:
        stages = cand.costs.stages
        if not any(c.W_fused is not None and c.W_fused < c.W - _EPS for c in stages):
            continue
        for size in (2, 4):
            key = (id(cand.schedule), size)
            if key not in done:
                sched = group_weights(cand.schedule, size)
                try:
                    graph = validate(sched, memory_limit=limits, costs=cand.costs)
                except ScheduleError:
                    graph = None  # holding the W-parts longer does not fit the limit
                tl = None if graph is None else simulate(sched, cand.costs, graph=graph)
                done[key] = None if tl is None else (sched, tl)
            found = done[key]
            if found is None:
                continue
            sched, tl = found
            name = f"{cand.name}, W in groups of {size}"
            out.append(
                Candidate(
                    name, "grouped", cand.costs, tl.makespan, tl.steady_bubble_rate, tl, sched
                )
            )
    return out


def _fit(
    costs: CostsLike,
    ranks: int,
    m: int,
    limits: list[float],
    max_chunks: int,
    policies: Sequence[Policy] | None,
    named: bool,
    verify: int,
) -> Candidate:
    """The best schedule without a limit, made to fit ``limits`` by recompute and offload."""
    from zeropipe.core.passes.fit import fit_memory  # the memory passes; only needed here

    free = search(
        costs, ranks, m, None, max_chunks=max_chunks, policies=policies, named=named,
        verify=verify, recompute=False,
    )  # fmt: skip
    chosen, costs = free.schedule, free.costs
    how = free.explanation.split(";")[0].removeprefix("auto: ")
    try:
        fit = fit_memory(chosen, limits, costs)  # raises, naming what would fit
    except ScheduleError:
        # A rank holding two copies (dualpipe) has less to offload: the best without copies.
        plain = next((c for c in free.candidates if not c.schedule.copies), None)
        if not chosen.copies or plain is None:
            raise
        fit = fit_memory(plain.schedule, limits, plain.costs)
        costs, how = plain.costs, plain.name
    sched = _renamed(fit.schedule, "auto")
    graph = validate(sched, memory_limit=limits, costs=costs)
    tl = simulate(sched, costs, graph=graph)
    actions = len(fit.recompute) + len(fit.offload)
    label = f"{how}, with {actions} recompute/offload pair(s) inserted by fit_memory"
    return Candidate(label, "list", costs, tl.makespan, tl.steady_bubble_rate, tl, sched)


def _remembered(costs: CostsLike) -> Callable[[int], CostModel | None]:
    """``costs_for(costs, n)``, each ``n`` made once: the candidates of one stage count
    share one cost model (split or merged anew it would be an equal copy each time)."""
    made: dict[int, CostModel | None] = {}

    def costs_of(num_stages: int) -> CostModel | None:
        if num_stages not in made:
            made[num_stages] = costs_for(costs, num_stages)
        return made[num_stages]

    return costs_of


def _renamed(schedule: Schedule, name: str) -> Schedule:
    return schedule.replace_actions(schedule.actions, name=name)


def _fmt_limits(limits: Sequence[float]) -> str:
    if len(set(limits)) == 1:
        return f"{limits[0]:g}"
    return "[" + ", ".join(f"{x:g}" for x in limits) + "]"


def _least_memory(costs: CostsLike, ranks: int) -> float:
    c = costs_for(costs, ranks)
    if c is None:
        return math.nan
    return max(c.stages[r].weights + c.stages[r].act for r in range(ranks))


def auto_schedule(
    costs: CostsLike,
    ranks: int,
    microbatches: int,
    memory_limit: Limit = None,
    **options: Any,
) -> tuple[Schedule, str]:
    """The best schedule :func:`search` finds and its one-line explanation.

    The schedule has ``ranks * v`` stages for the ``v`` it chose (dualpipe: ``ranks``
    and their copies); simulate it with ``costs_for_schedule(costs, schedule)`` (or use
    :func:`search`, whose result carries that cost model and the timeline).
    """
    result = search(costs, ranks, microbatches, memory_limit, **options)
    return result.schedule, result.explanation


@register(
    "auto",
    "searched: shortest simulated step under unit costs within 1F1B's peak memory, "
    "using at most `chunks` chunks per rank (zeropipe.core.schedules.auto.search for real costs)",
    default_chunks=2,
    takes_chunks=True,
)
def auto(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """``search`` under unit costs, within 1F1B's peak, with up to ``chunks`` chunks per rank."""
    return search(CostModel.uniform(ranks), ranks, microbatches, "1f1b", max_chunks=chunks).schedule
