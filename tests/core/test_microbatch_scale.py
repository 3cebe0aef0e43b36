"""Microbatches of their own sizes in the cost model (``CostModel.microbatch_scale``): the
simulator and the list scheduler behind ``auto`` price each microbatch's compute, memory and
boundary bytes by its own factor, where the schedule puts it; all 1.0 (or none) is what
every cost was before.

GPipe is a proportionate flow shop (each microbatch costs the same on every stage, every
rank runs them in one order), whose makespan is known in closed form: ``sum_i t_i + (p - 1)
max_i t_i`` for the forwards, and again for the backwards.  1F1B runs a long microbatch in
its steady state under the others' work; a long first or last one is exposed.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.schedules.auto import search
from zeropipe.core.schedules.list_scheduler import Policy, list_schedule, placement_of, replay
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate


def _sized(costs: CostModel, *scale: float) -> CostModel:
    return replace(costs, microbatch_scale=tuple(scale))


@pytest.mark.parametrize(("ranks", "m"), [(2, 4), (4, 8)])
def test_sizes_of_one_change_nothing(ranks: int, m: int) -> None:
    for name, gen in sorted(GENERATORS.items()):
        if name == "auto":
            continue
        try:
            sched = gen.build(ranks, m, gen.default_chunks)
        except ScheduleError:
            continue
        costs = CostModel.parse("F=1,I=1,W=0.5,comm=0.3,act_w=0.4", sched.num_stages,
                                sched.chunks_per_rank)  # fmt: skip
        plain, ones = simulate(sched, costs), simulate(sched, _sized(costs, *[1.0] * m))
        assert ones.makespan == plain.makespan and ones.peak_memory == plain.peak_memory, name
        assert [[e.start for e in evs] for evs in ones.events] == [
            [e.start for e in evs] for evs in plain.events
        ], name
    assert "microbatch_scale" not in CostModel.uniform(2).to_dict()


@pytest.mark.parametrize(("ranks", "m"), [(2, 3), (3, 4), (4, 6)])
def test_gpipe_takes_the_flow_shops_closed_form(ranks: int, m: int) -> None:
    sched = generate("gpipe", ranks, m)
    base = CostModel.uniform(ranks, F=1.0, B=2.0)
    for j in range(m):
        for k in (3.0, 0.5):
            scale = [1.0] * m
            scale[j] = k
            f, b = scale, [2 * x for x in scale]
            want = sum(f) + (ranks - 1) * max(f) + sum(b) + (ranks - 1) * max(b)
            assert simulate(sched, _sized(base, *scale)).makespan == pytest.approx(want), (j, k)


def test_1f1b_hides_a_long_microbatch_in_its_steady_state_and_exposes_one_at_the_ends() -> None:
    ranks, m = 4, 6
    sched = generate("1f1b", ranks, m)
    base = CostModel.uniform(ranks, F=1.0, B=2.0)
    plain = simulate(sched, base).makespan
    assert plain == 27.0  # (m + p - 1) (F + B)

    def one(j: int, k: float) -> float:
        scale = [1.0] * m
        scale[j] = k
        return simulate(sched, _sized(base, *scale)).makespan

    # Three times as long at either end: as exposed as in GPipe (51, the flow shop's closed
    # form); in the steady state part of it hides under the others' work.
    assert one(0, 3.0) == one(m - 1, 3.0) == 51.0
    assert plain < min(one(j, 3.0) for j in range(1, m - 1))
    assert max(one(j, 3.0) for j in range(1, m - 1)) < 51.0
    # Half as long: the first one shortens the warm-up; one in the steady state waits for
    # the others, and the step is as long as without it.
    assert one(0, 0.5) < plain
    assert all(one(j, 0.5) == plain for j in range(1, m - 1))


def test_memory_and_boundary_bytes_scale_with_the_microbatch() -> None:
    stage = StageCost(F=1.0, I=1.0, W=1.0, act=1.0, boundary_bytes=10.0)
    costs = CostModel((stage, stage), latency=0.5, bandwidth=10.0)
    sched = generate("gpipe", 2, 3)
    timeline = simulate(sched, _sized(costs, 1.0, 2.0, 0.5))
    assert timeline.peak_memory == [3.5, 3.5]  # gpipe holds every microbatch's activations
    # One microbatch: F, the wire, F, B, the wire back, B, each at its size.
    one = generate("gpipe", 2, 1)
    for k in (1.0, 3.0):
        wire = 0.5 + 10.0 * k / 10.0
        assert simulate(one, _sized(costs, k)).makespan == pytest.approx(
            2 * k + 2 * 2 * k + 2 * wire
        )


def test_the_list_scheduler_times_sized_microbatches_as_the_simulator() -> None:
    m, ranks = 6, 4
    scale = (0.5, 1.0, 2.0, 1.0, 1.5, 3.0)
    checked = 0
    for policy in (
        Policy("looped", 1, True, 0.0),
        Policy("looped", 1, False, 1.0),
        Policy("v", 2, True, 1.0, "F"),
        Policy("looped", 2, True, 0.5, "I", False, 2.0),
    ):
        place = placement_of(policy.placement, ranks, policy.chunks)
        stage = StageCost(F=1.0, I=1.0, W=0.5, act=0.5, act_w=0.2, boundary_bytes=4.0)
        costs = CostModel(
            (stage,) * len(place), latency=0.25, bandwidth=8.0, microbatch_scale=scale
        )
        for limit in (math.inf, 4.0):
            plan = list_schedule(costs, place, m, policy, [limit] * ranks)
            if plan is None:
                continue
            sched = plan.schedule(place, m)
            graph = validate(sched, memory_limit=None if math.isinf(limit) else limit, costs=costs)
            timeline = simulate(sched, costs, graph=graph)
            assert plan.makespan == pytest.approx(timeline.makespan, abs=1e-9)
            for rank, events in enumerate(timeline.events):
                assert plan.starts[rank] == pytest.approx([e.start for e in events], abs=1e-9)
            checked += 1
    assert checked >= 6
    named = generate("1f1b", ranks, m)
    costs = CostModel.uniform(ranks, F=1.0, I=1.0, W=0.5, comm=0.3, act_w=0.4)
    replayed = replay(named, _sized(costs, *scale), [math.inf] * ranks)
    assert replayed is not None
    assert replayed.makespan == pytest.approx(simulate(named, _sized(costs, *scale)).makespan)


def test_auto_prices_each_microbatch() -> None:
    ranks, m = 2, 4
    base = CostModel.uniform(ranks, F=1.0, I=1.0, W=1.0)
    sized = _sized(base, 1.0, 1.0, 1.0, 4.0)
    found = search(sized, ranks, m, time_budget=10.0)
    assert found.costs.microbatch_scale == sized.microbatch_scale
    assert found.timeline.makespan == pytest.approx(simulate(found.schedule, found.costs).makespan)
    assert found.timeline.makespan > search(base, ranks, m, time_budget=10.0).timeline.makespan


def test_sizes_are_checked() -> None:
    with pytest.raises(ScheduleError, match=r"microbatch_scale\[1\]"):
        CostModel.uniform(2).__class__(CostModel.uniform(2).stages, microbatch_scale=(1.0, 0.0))
    with pytest.raises(ScheduleError, match=r"3 factor\(s\) but the schedule has 4 microbatches"):
        simulate(generate("1f1b", 2, 4), _sized(CostModel.uniform(2), 1.0, 2.0, 1.0))
    sized = _sized(CostModel.uniform(2), 1.0, 2.5)
    assert CostModel.from_json(sized.to_json()) == sized
