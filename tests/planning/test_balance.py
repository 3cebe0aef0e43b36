"""zeropipe.planning.balance: exact contiguous cuts (pure arithmetic, no torch)."""

from __future__ import annotations

import itertools
import random

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.simulate import simulate
from zeropipe.planning.balance import balance, balance_schedule, even_cut, stage_costs, stage_times


def _cuts(n: int, parts: int) -> list[list[int]]:
    """Every way to cut n layers into parts non-empty consecutive groups."""
    out = []
    for bounds in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *bounds, n)
        out.append([b - a for a, b in itertools.pairwise(edges)])
    return out


def test_balance_is_exact_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        times = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        cut = balance(times, parts)
        assert len(cut) == parts and sum(cut) == n and min(cut) >= 1
        best = min(max(stage_times(times, c)) for c in _cuts(n, parts))
        assert max(stage_times(times, cut)) == pytest.approx(best)


def test_balance_respects_a_memory_cap_exactly() -> None:
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 8)
        parts = rng.randint(1, n)
        times = [rng.uniform(0, 5) for _ in range(n)]
        memory = [rng.uniform(0, 3) for _ in range(n)]
        cap = rng.uniform(max(memory), sum(memory))
        fitting = [c for c in _cuts(n, parts) if max(stage_times(memory, c)) <= cap]
        if not fitting:
            with pytest.raises(ScheduleError, match="memory"):
                balance(times, parts, memory=memory, memory_limit=cap)
            continue
        cut = balance(times, parts, memory=memory, memory_limit=cap)
        assert max(stage_times(memory, cut)) <= cap + 1e-9
        best = min(max(stage_times(times, c)) for c in fitting)
        assert max(stage_times(times, cut)) == pytest.approx(best)


def test_the_docstring_example() -> None:
    assert balance([1, 1, 1, 8, 1, 1, 1, 1], 3) == [3, 1, 4]


def test_bad_requests_say_why() -> None:
    with pytest.raises(ScheduleError, match="at least one layer"):
        balance([1, 2], 3)
    with pytest.raises(ScheduleError, match="layer 1 alone"):
        balance([1, 2], 2, memory=[1, 5], memory_limit=4)


def test_stage_costs_sum_layers_and_keep_the_last_boundary() -> None:
    layers = CostModel(
        tuple(
            StageCost(F=f, I=1, W=0.5, act=2, boundary_bytes=b)
            for f, b in [(1, 10), (2, 20), (3, 30)]
        )
    )
    costs = stage_costs(layers, [2, 1])
    assert [s.F for s in costs.stages] == [3, 3]
    assert costs.stages[0].act == 4 and costs.stages[0].boundary_bytes == 20
    assert costs.stages[0].time(Kind.B) == 3  # two layers of I + W
    assert costs.meta["cut"] == [2, 1]


def test_even_cut_gives_the_first_stages_the_remainder() -> None:
    assert even_cut(10, 4) == [3, 3, 2, 2]
    assert even_cut(4, 4) == [1, 1, 1, 1]
    for layers in range(1, 12):
        for parts in range(1, layers + 1):
            cut = even_cut(layers, parts)
            assert sum(cut) == layers and max(cut) - min(cut) <= 1
            assert cut == sorted(cut, reverse=True)
    with pytest.raises(ScheduleError, match="at least one layer"):
        even_cut(2, 3)


def _layer_model(times: list[float]) -> CostModel:
    """One stage per layer, F = t, I = W = t (so B = 2t)."""
    return CostModel(tuple(StageCost(F=t, I=t, W=t) for t in times))


def test_balance_schedule_is_the_best_simulated_cut_and_the_descent_finds_it() -> None:
    # A small embedding, equal blocks, a head a third of a block: the transformer shape.
    times = [0.05, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.35]
    layers = _layer_model(times)
    for name in ("1f1b", "zbv", "interleaved-1f1b"):
        schedule = build_schedule(name, ranks=2, microbatches=8)
        spans = {
            tuple(cut): simulate(schedule, stage_costs(layers, cut)).makespan
            for cut in _cuts(len(times), schedule.num_stages)
        }
        best = min(spans.values())
        chosen = balance_schedule(layers, schedule)
        assert spans[tuple(chosen)] <= best * (1 + 1e-3), name
        descended = balance_schedule(layers, schedule, exhaustive_limit=0)
        assert spans[tuple(descended)] <= best * (1 + 1e-3), name


def test_balance_schedule_pairs_the_ends_of_a_v() -> None:
    # zbv puts stages 0 and 3 on rank 0: the even cut gives rank 0 one block plus the cheap
    # ends and rank 1 four blocks; the balanced cut evens the ranks, which balance() cannot see.
    times = [0.05, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.35]
    layers = _layer_model(times)
    schedule = build_schedule("zbv", ranks=2, microbatches=8)
    even = [2, 2, 2, 2]
    assert balance(times, 4) == even
    chosen = balance_schedule(layers, schedule)
    per_rank = [0.0, 0.0]
    for total, rank in zip(stage_times(times, chosen), schedule.placement, strict=True):
        per_rank[rank] += total
    assert max(per_rank) < 3.5  # the even cut's busiest rank holds 4 blocks
    assert (
        simulate(schedule, stage_costs(layers, chosen)).makespan
        < 0.9 * simulate(schedule, stage_costs(layers, even)).makespan
    )
