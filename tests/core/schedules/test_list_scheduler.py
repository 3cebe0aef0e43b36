"""The list scheduler times its plans exactly as the simulator does.

It asks the same dependency model and cost model as :func:`zeropipe.core.simulate.simulate`,
so over a grid of ranks, microbatches, costs (a wire, uneven W, a fused backward,
runtime overhead), memory limits and policies every action of a plan must
start when the simulator starts it, and the makespans must be equal.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import signal
from collections.abc import Iterator

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind
from zeropipe.core.schedules import GENERATORS
from zeropipe.core.schedules.list_scheduler import (
    ListPlan,
    ListScheduler,
    Policy,
    compute_order,
    list_schedule,
    placement_of,
    replay,
)
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

COSTS = {
    "unit": "F=1,I=1,W=1",
    "wire, W cheap, W holds memory": "F=1,I=1,W=0.5,comm=0.3,act_w=0.4",
    "fused backward, overhead": "F=1,B=1.5,overhead=0.1",
}


def _policies() -> list[Policy]:
    out = []
    for place, chunks, split, gap, first, depth, reserve in itertools.product(
        ("looped", "v"), (1, 2), (True, False), (0.0, 1.0), ("I", "F"), (True, False), (0.0, 2.0)
    ):
        if place == "v" and chunks == 1:
            continue
        out.append(Policy(place, chunks, split, gap, first, depth, reserve))
    return out


def _uneven(stages: int, seed: int) -> CostModel:
    rng = random.Random(seed)
    return CostModel(
        tuple(
            StageCost(
                F=rng.uniform(0.5, 1.5),
                I=rng.uniform(0.5, 1.5),
                W=rng.uniform(0.2, 1.0),
                act=rng.uniform(0.5, 1.5),
                act_w=rng.uniform(0, 0.5),
                weights=rng.uniform(0, 0.5),
                boundary_bytes=rng.uniform(0, 50),
            )
            for _ in range(stages)
        ),
        latency=0.05,
        bandwidth=200.0,
    )


def _check_against_simulator(plan: ListPlan, placement: tuple[int, ...], m: int, costs: CostModel,
                             limit: float) -> None:  # fmt: skip
    schedule = plan.schedule(placement, m)
    graph = validate(schedule, memory_limit=None if math.isinf(limit) else limit, costs=costs)
    timeline = simulate(schedule, costs, graph=graph)
    assert plan.makespan == pytest.approx(timeline.makespan, abs=1e-9)
    assert plan.steady == pytest.approx(timeline.steady_bubble_rate, abs=1e-9)
    for rank, events in enumerate(timeline.events):
        assert [e.action.kind for e in events] == [k for k, _, _ in plan.steps[rank]]
        assert plan.starts[rank] == pytest.approx([e.start for e in events], abs=1e-9), rank


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("costs_name", [*COSTS, "random"])
def test_every_start_time_is_the_simulators(ranks: int, costs_name: str) -> None:
    rng = random.Random(ranks * 100 + len(costs_name))
    policies = _policies()
    checked = skipped = 0
    for m in (2, 3, 5, 8):
        for policy in rng.sample(policies, 12):
            place = placement_of(policy.placement, ranks, policy.chunks)
            if costs_name == "random":
                costs = _uneven(len(place), rng.randrange(10**6))
            else:
                costs = CostModel.parse(COSTS[costs_name], len(place), policy.chunks)
            # No limit, and one that leaves room for about two microbatches per rank.
            for limit in (math.inf, 2.5):
                plan = list_schedule(costs, place, m, policy, [limit] * ranks)
                if plan is None:
                    skipped += 1  # this policy cannot finish under this limit
                    continue
                _check_against_simulator(plan, place, m, costs, limit)
                checked += 1
    assert checked > 60 and checked > skipped, (checked, skipped)


@pytest.mark.parametrize("ranks", [2, 4])
def test_named_orders_with_w_placed_anew_are_timed_as_simulated(ranks: int) -> None:
    for name, gen in sorted(GENERATORS.items()):
        if name == "auto":
            continue
        for m in (2 * ranks, 3 * ranks):
            sched = gen.build(ranks, m, gen.default_chunks)
            if sched.routes:
                continue  # the list scheduler plans microbatches that visit every stage
            costs = CostModel.parse(COSTS["wire, W cheap, W holds memory"], sched.num_stages,
                                    sched.chunks_per_rank)  # fmt: skip
            policy = Policy("order", sched.chunks_per_rank, True, 0.5)
            order = compute_order(sched, keep_w=False)
            plan = list_schedule(costs, sched.placement, m, policy, [math.inf] * ranks, order)
            assert plan is not None, name
            _check_against_simulator(plan, sched.placement, m, costs, math.inf)
            replayed = replay(sched, costs, [math.inf] * ranks)
            assert replayed is not None
            assert replayed.makespan == pytest.approx(simulate(sched, costs).makespan)


def test_replay_refuses_a_schedule_over_the_limit() -> None:
    sched = GENERATORS["gpipe"].build(2, 6, 1)
    costs = CostModel.uniform(2)
    assert replay(sched, costs, [6.0, 6.0]) is not None
    assert replay(sched, costs, [5.0, 5.0]) is None  # gpipe holds all 6 microbatches


def test_a_plan_holds_every_action_once() -> None:
    place = placement_of("v", 3, 2)
    plan = list_schedule(CostModel.uniform(6, chunks=2), place, 4, Policy("v", 2), [math.inf] * 3)
    assert plan is not None
    steps = [step for rank in plan.steps for step in rank]
    assert len(steps) == len(set(steps)) == 6 * 4 * 3
    assert {k for k, _, _ in steps} == {Kind.F, Kind.I, Kind.W}


def test_unknown_placement_is_a_schedule_error() -> None:
    with pytest.raises(ScheduleError, match="placement"):
        placement_of("ring", 4, 2)


def test_a_reused_scheduler_plans_as_a_fresh_one() -> None:
    place = placement_of("v", 3, 2)
    costs = CostModel.parse(COSTS["wire, W cheap, W holds memory"], 6, 2)
    planner = ListScheduler(costs, place, 6, split=True)
    for policy in [p for p in _policies() if p.split and p.placement == "v" and p.chunks == 2]:
        for limit in (math.inf, 2.5):
            again = planner.run(policy, [limit] * 3)
            fresh = list_schedule(costs, place, 6, policy, [limit] * 3)
            assert (again is None) == (fresh is None)
            if again is not None and fresh is not None:
                assert again.steps == fresh.steps and again.starts == fresh.starts
    with pytest.raises(ScheduleError, match="full"):
        planner.run(Policy("v", 2, split=False), [math.inf] * 3)


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (the alarm interrupts a pure-Python loop)."""
    if not hasattr(signal, "SIGALRM"):
        pytest.skip("needs SIGALRM to guard against a hang")

    def expired(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("gap", [0.0, 0.5, 1.0])
def test_a_run_stuck_under_the_limit_with_w_pending_ends(gap: float) -> None:
    # zb-h2's order needs more than 2 microbatches of memory on rank 0 here: rank 0 stops
    # at an F that does not fit, and rank 1, its W pending, waited for an arrival from
    # rank 0 that could never come, re-deciding forever (gap x W above the wait it
    # expected).  Now the W run and the run ends: None, the order does not fit.
    costs = CostModel.uniform(2, F=1.0, I=1.0, W=2.0)
    sched = GENERATORS["zb-h2"].build(2, 4, 1)
    order = compute_order(sched, keep_w=False)
    scheduler = ListScheduler(costs, sched.placement, 4, split=True)
    with _time_limit(10):
        assert scheduler.run(Policy("order", 1, True, gap), [2.0, 2.0], order) is None
        assert scheduler.run(Policy("order", 1, True, gap), [4.0, 4.0], order) is not None


def test_auto_ends_where_a_named_order_deadlocks_under_the_limit() -> None:
    from zeropipe.core.schedules.auto import search

    costs = CostModel.uniform(2, F=1.0, I=1.0, W=2.0)
    with _time_limit(30):
        result = search(costs, 2, 4, 2.0, max_chunks=1)
    assert max(result.timeline.peak_memory) <= 2.0 + 1e-9
