"""``auto``'s candidates timed by the list scheduler, hundreds of them in a search.

Each candidate to time is a :data:`Run`: a named schedule replayed as it is, a
named schedule's F / I order with its W placed anew, or a list-scheduler policy
on a placement.  :func:`time_runs` times them all, and keeps that fast without
changing which plans come out among the best few (the only ones the search
verifies):

    named first      replayed exactly, never cut: auto is never worse than a named
                     schedule that fits, and their makespans make the first cutoffs
    promising first  the runs that follow a named schedule's order, the best named
                     first, then the policies: the best plans are found early
    cut short        a list run is given up once it cannot end before the best few
                     found so far (ties included, see ``_cutoff``)
    shared           runs alike (one planner and order, policies apart in ``gap``,
                     ``first`` or ``reserve`` only) share one run while they decide
                     alike (``ListScheduler.run_alike``)
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence

from zeropipe.core.costs import CostModel
from zeropipe.core.ir import Schedule
from zeropipe.core.schedules.list_scheduler import (
    ListPlan,
    ListScheduler,
    Policy,
    Step,
    replay,
)

__all__ = ["Found", "Run", "time_runs"]

# One candidate to time: label, source ("named" or "list"), policy, schedule (or its
# shape), costs, and the F/I order it follows (a named schedule's, or None).
Run = tuple[str, str, Policy, Schedule, CostModel, list[list[Step]] | None]
# A plan found so far: makespan, steady bubble, source, index in the runs.
Found = tuple[float, float, str, int]


def time_runs(
    runs: Sequence[Run], m: int, limits: list[float], keep: int, deadline: float
) -> tuple[list[ListPlan | None], int]:
    """Per run, its plan (``None``: it does not fit, was cut short or came past
    ``deadline``); and how many list runs were cut short.

    Only the best ``keep`` go on to be verified, so a list run is given up as soon as it
    cannot end before ``keep`` plans already found (:func:`_cutoff`).  Any order of the
    runs gives the same plans to the best ``keep``; the order taken finds them early.
    """
    plans, found, named_end = _replay_named(runs, limits)

    def priority(n: int) -> tuple[bool, float, int]:
        follows = runs[n][5] is not None  # a named schedule's order
        return not follows, named_end.get(id(runs[n][3]), math.inf) if follows else 0.0, n

    planners: dict[tuple[tuple[int, ...], bool], ListScheduler] = {}
    cut = 0
    for n in sorted((n for n in range(len(runs)) if n not in plans), key=priority):
        _, _, policy, sched, c, order = runs[n]
        if n in plans:
            continue  # timed along with an earlier run
        if found and time.perf_counter() > deadline:
            plans[n] = None
            continue
        place = tuple(sched.placement)
        planner = planners.get((place, policy.split))
        if planner is None or planner.costs != c:
            planner = ListScheduler(c, place, m, split=policy.split)
            planners[(place, policy.split)] = planner
        group = [
            k
            for k in range(n, len(runs))
            if k not in plans
            and runs[k][5] is order
            and runs[k][4] is c
            and tuple(runs[k][3].placement) == place
        ]
        cutoff = _cutoff(found, keep, n, planner.exact)
        plan, shared = planner.run_alike([runs[k][2] for k in group], limits, order, cutoff)
        for j in shared:
            plans[group[j]] = plan
            if plan is not None:
                found.append((plan.makespan, plan.steady, "list", group[j]))
        if plan is None and cutoff < math.inf:
            cut += len(shared)  # (or it does not fit: a cut run cannot tell)
    return [plans.get(n) for n in range(len(runs))], cut


def _replay_named(
    runs: Sequence[Run], limits: list[float]
) -> tuple[dict[int, ListPlan | None], list[Found], dict[int, float]]:
    """The named runs replayed: their plans by index, those that fit as found plans, and
    each named schedule's makespan by its id (inf if it does not fit)."""
    plans: dict[int, ListPlan | None] = {}
    found: list[Found] = []
    named_end: dict[int, float] = {}
    for n, (_, source, _, sched, c, _) in enumerate(runs):
        if source == "named":
            plan = plans[n] = replay(sched, c, limits)  # never cut: auto is never worse
            named_end[id(sched)] = math.inf if plan is None else plan.makespan
            if plan is not None:
                found.append((plan.makespan, plan.steady, source, n))
    return plans, found, named_end


def _cutoff(found: Sequence[Found], keep: int, n: int, exact: bool) -> float:
    """The end past which run ``n`` (and the later runs alike) cannot be among the best ``keep``.

    Candidates sort on (makespan, steady bubble, named first), both rounded to 1e-9, then
    on their index (a stable sort).  A found plan is surely ahead of run ``n`` once ``n``'s
    makespan is past its own by more than the rounding.  With times the floats hold
    exactly (``exact``) a found plan with no steady bubble is ahead already at an equal
    makespan when a tie would put it first: named, or earlier in ``runs``; the
    schedules that reach the busiest rank's bound are cut at once so.
    """
    if keep <= 0:
        return -math.inf  # none of them is verified: no need to time any
    needs = []  # per found plan: the end of run n that puts it surely ahead
    for makespan, steady, source, k in found:
        first = source == "named" or k < n
        if exact and round(steady, 9) <= 0 and first:
            needs.append(math.nextafter(makespan, -math.inf))  # an end >= its makespan
        else:
            needs.append(makespan + 1e-6 * max(1.0, abs(makespan)))
    return heapq.nsmallest(keep, needs)[-1] if len(needs) >= keep else math.inf
