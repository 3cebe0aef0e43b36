"""Shortcuts of the list scheduler that must not change a plan.

``ListScheduler.run_alike`` follows policies apart only in ``gap``, ``first`` and
``reserve`` along one run and hands the ones that never decided otherwise the same
plan; a ``cutoff`` gives a run up once it cannot end sooner.  Each shared plan must be
the plan a run of its own gives, action for action and start for start.
"""

from __future__ import annotations

import math
import random

import pytest

from tests.strategies import random_costs
from zeropipe.core.costs import CostModel
from zeropipe.core.schedules.auto import costs_for, default_policies
from zeropipe.core.schedules.list_scheduler import ListScheduler, list_schedule, placement_of


def _costs(rng: random.Random, ranks: int) -> CostModel:
    if rng.random() < 0.4:
        return CostModel.uniform(ranks, act_w=rng.choice([0.0, 0.9]), comm=rng.choice([0, 0.3]))
    return random_costs(ranks, rng)


@pytest.mark.parametrize("seed", range(6))
def test_policies_run_alike_get_the_plan_of_their_own_run(seed: int) -> None:
    rng = random.Random(seed)
    ranks, m = rng.choice([2, 3, 4]), rng.choice([3, 5, 8])
    base = _costs(rng, ranks)
    limits = [rng.choice([math.inf, 2.5, 1.5 * ranks])] * ranks
    groups: dict[tuple[str, int, bool], list] = {}
    for policy in default_policies(ranks, 3, [True, False]):
        groups.setdefault((policy.placement, policy.chunks, policy.split), []).append(policy)
    shared = 0
    for (kind, chunks, split), group in groups.items():
        place = placement_of(kind, ranks, chunks)
        costs = costs_for(base, len(place))
        assert costs is not None
        planner = ListScheduler(costs, place, m, split=split)
        todo = list(group)
        while todo:
            plan, alike = planner.run_alike(todo, limits)
            for j in alike:
                own = list_schedule(costs, place, m, todo[j], limits)
                assert (plan is None) == (own is None), todo[j]
                if plan is not None and own is not None:
                    assert plan.steps == own.steps and plan.starts == own.starts, todo[j]
                    assert (plan.makespan, plan.steady) == (own.makespan, own.steady)
            shared += len(alike) - 1
            todo = [p for j, p in enumerate(todo) if j not in set(alike)]
    assert shared > 0  # the shortcut is taken at all


def test_a_cutoff_gives_up_only_runs_that_end_later() -> None:
    costs = CostModel.uniform(8, chunks=2, F=18.5, I=18.1, W=9.3, comm=0.6)
    place = placement_of("v", 4, 2)
    planner = ListScheduler(costs, place, 8, split=True)
    for policy in default_policies(4, 2, [True])[:6]:
        full, _ = planner.run_alike([policy], [math.inf] * 4)
        assert full is not None
        kept, _ = planner.run_alike([policy], [math.inf] * 4, cutoff=full.makespan + 1e-6)
        assert kept is not None and kept.steps == full.steps
        cut, _ = planner.run_alike([policy], [math.inf] * 4, cutoff=full.makespan - 1e-3)
        assert cut is None
