"""zeropipe.balance: exact contiguous cuts, and a measured win over the uniform cut."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from zeropipe.balance import (
    balance,
    balance_by_time,
    plan,
    split_layers,
    stage_costs,
    stage_times,
)
from zeropipe.costs import CostModel, StageCost
from zeropipe.errors import ScheduleError
from zeropipe.ir import Kind
from zeropipe.models import GPTConfig, gpt
from zeropipe.models.gpt import lm_loss
from zeropipe.profiling import profile
from zeropipe.validate import validate


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


def _lopsided(seed: int = 0) -> nn.Sequential:
    """Six layers, two of them (0 and 2) several times the work of the others."""
    torch.manual_seed(seed)

    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 64))

    def narrow() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))

    return nn.Sequential(wide(), narrow(), wide(), narrow(), narrow(), narrow())


def test_balancing_beats_the_uniform_cut_measured() -> None:
    model = _lopsided()
    x = torch.randn(64, 64)
    cut = balance_by_time(model, x, 2, repeat=5)
    uniform = [3, 3]  # both wide layers in stage 0
    assert cut == [2, 4]  # one wide layer per stage

    def slowest(c: list[int]) -> float:
        costs = profile(split_layers(model, c), x, repeat=7)
        return max(s.F + s.time(Kind.B) for s in costs.stages)

    assert slowest(cut) < 0.85 * slowest(uniform)


def test_split_layers_shares_the_layers() -> None:
    model = _lopsided()
    stages = split_layers(model, [3, 3])
    assert [len(s) for s in stages] == [3, 3]
    assert stages[1][0] is model[3]


def test_plan_cuts_the_model_for_the_schedule_it_picks() -> None:
    cfg = GPTConfig(layers=4, width=32, heads=2, seq=16)
    model = gpt(cfg)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(0))
    result = plan(model, tokens, 2, 4, target=tokens, loss_fn=lm_loss, repeat=3)
    assert sum(result.balance) == len(model)
    assert len(result.balance) == result.schedule.num_stages
    assert "cut" in result.explanation
    validate(result.schedule, costs=result.costs)
