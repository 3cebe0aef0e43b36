"""Cost model helpers that the simulator and the list scheduler share."""

from __future__ import annotations

import dataclasses

import pytest

from zeropipe.costs import CostModel, StageCost, memory_deltas
from zeropipe.errors import ScheduleError
from zeropipe.ir import Kind
from zeropipe.schedules import generate


def test_scaled_touches_every_figure_but_the_boundary() -> None:
    names = [f.name for f in dataclasses.fields(StageCost)]
    stage = StageCost(**{n: float(k + 1) for k, n in enumerate(names)})
    half = stage.scaled(0.5)
    for n in names:
        want = getattr(stage, n) if n == "boundary_bytes" else getattr(stage, n) * 0.5
        assert getattr(half, n) == want, n
    assert StageCost().scaled(3.0).B is None  # a default stays a default


def test_merged_sums_and_keeps_the_last_boundary() -> None:
    a = StageCost(F=1, I=2, W=3, act=1, boundary_bytes=10)
    b = StageCost(F=2, I=1, W=1, B=1.5, W_fused=0.5, act=2, boundary_bytes=20)
    m = StageCost.merged([a, b])
    assert (m.F, m.I, m.W, m.act, m.boundary_bytes) == (3, 3, 4, 3, 20)
    assert m.B == 5 + 1.5 and m.W_fused == 3 + 0.5


def test_held_change_matches_memory_deltas() -> None:
    sched = generate("zb-h1", 2, 3)
    costs = CostModel.uniform(2, act_w=0.4)
    for acts, deltas in zip(sched.actions, memory_deltas(sched, costs), strict=True):
        for a, d in zip(acts, deltas, strict=True):
            assert d == costs.stages[a.stage].held_change(a.kind)
    with pytest.raises(ScheduleError):
        StageCost().held_change(Kind.OFFLOAD)


def test_defaults_follow_the_schedule_shape() -> None:
    sched = generate("interleaved-1f1b", 2, 4, 3)
    assert sched.chunks_per_rank == 3
    costs = CostModel.uniform_for(sched)
    assert len(costs.stages) == 6 and pytest.approx(1 / 3) == costs.stages[0].F


def test_boundary_time_is_the_lower_stages_output_either_way() -> None:
    costs = CostModel(
        (StageCost(boundary_bytes=100), StageCost(boundary_bytes=900)),
        latency=0.5,
        bandwidth=100.0,
    )
    assert costs.boundary_time(0, 1) == costs.boundary_time(1, 0) == 0.5 + 1.0
