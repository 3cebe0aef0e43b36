"""Cost model helpers that the simulator and the list scheduler share."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind
from zeropipe.core.memory import initial_memory, memory_deltas, peak_memory
from zeropipe.core.passes.fit import offload_weights
from zeropipe.core.schedules import generate


def test_scaled_touches_every_figure_but_the_boundary_and_the_workspace() -> None:
    names = [f.name for f in dataclasses.fields(StageCost)]
    stage = StageCost(**{n: float(k + 1) for k, n in enumerate(names)})
    half = stage.scaled(0.5)
    whole = ("boundary_bytes", "workspace")  # a part still sends and rebuilds whole ones
    for n in names:
        want = getattr(stage, n) if n in whole else getattr(stage, n) * 0.5
        assert getattr(half, n) == want, n
    assert StageCost().scaled(3.0).B is None  # a default stays a default


def test_merged_sums_and_keeps_the_last_boundary() -> None:
    a = StageCost(F=1, I=2, W=3, act=1, boundary_bytes=10)
    b = StageCost(F=2, I=1, W=1, B=1.5, W_fused=0.5, act=2, boundary_bytes=20)
    m = StageCost.merged([a, b])
    assert (m.F, m.I, m.W, m.act, m.boundary_bytes) == (3, 3, 4, 3, 20)
    assert m.B == 5 + 1.5 and m.W_fused == 3 + 0.5
    # One backward at a time: the group reserves its largest workspace, not their sum.
    wide = StageCost.merged([replace(a, workspace=4.0), replace(b, workspace=3.0)])
    assert wide.workspace == 4.0


def test_a_rank_reserves_its_largest_workspace_once_beside_its_weights() -> None:
    # zbv: rank 0 holds stages 0 and 3.  The workspace is held the whole step, so it is in
    # the memory before the first action, once per rank (the larger of its stages'), scaled
    # to the largest microbatch, and not moved by a weight offload.
    sched = generate("zbv", 2, 4)
    assert sched.stages_of(0) == (0, 3)
    stages = tuple(StageCost(weights=10.0, workspace=w, act=1.0) for w in (2.0, 0.5, 0.25, 3.0))
    costs = CostModel(stages)
    assert initial_memory(sched, costs) == [10.0 * 2 + 3.0, 10.0 * 2 + 0.5]
    peaks = [p for p, _ in peak_memory(sched, costs)]
    plain = CostModel(tuple(replace(c, workspace=0.0) for c in stages))
    assert [p - q for p, (q, _) in zip(peaks, peak_memory(sched, plain), strict=True)] == [3.0, 0.5]
    sized = replace(costs, microbatch_scale=(1.0, 2.0, 0.5, 1.0))
    assert initial_memory(sched, sized) == [20.0 + 6.0, 20.0 + 1.0]
    moved = offload_weights(sched, [0])
    assert initial_memory(moved, costs)[0] == 10.0 + 3.0  # stage 0's weights start away


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


# -- bad numbers fail where the model is built, naming the field, stage and value -----
_BAD = [-1.0, -1e-9, float("nan"), float("inf"), float("-inf")]
_FIELDS = [f.name for f in dataclasses.fields(StageCost)]


@pytest.mark.parametrize("name", _FIELDS)
@pytest.mark.parametrize("value", _BAD)
def test_stage_cost_rejects_negative_and_non_finite_figures(name: str, value: float) -> None:
    with pytest.raises(ScheduleError, match=rf"^{name} = .* must be finite and >= 0"):
        StageCost(**{name: value})


@pytest.mark.parametrize("value", ["1", True, [1.0]])
def test_stage_cost_rejects_what_is_not_a_number(value: object) -> None:
    with pytest.raises(ScheduleError, match=r"F = .* is not a number"):
        StageCost(F=value)  # type: ignore[arg-type]


def test_optional_figures_may_be_none_and_zero_is_fine() -> None:
    stage = StageCost(F=0, I=0, W=0, B=None, R=None, W_fused=None, act=0)
    assert stage.time(Kind.B) == 0 and stage.fused_w == 0
    with pytest.raises(ScheduleError, match="act = None is not a number"):
        StageCost(act=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"latency": -1.0}, "latency = -1.0 must be finite and >= 0"),
        ({"post": float("nan")}, "post = nan must be finite"),
        ({"overhead": float("inf")}, "overhead = inf must be finite"),
        ({"bandwidth": 0.0}, "bandwidth = 0.0 must be > 0"),
        ({"bandwidth": -3.0}, "bandwidth = -3.0 must be > 0"),
        ({"bandwidth": float("nan")}, "bandwidth = nan must be > 0"),
    ],
)
def test_cost_model_rejects_bad_wire_and_runtime_figures(changes, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        dataclasses.replace(CostModel.uniform(2), **changes)


def test_infinite_bandwidth_is_an_instant_wire() -> None:
    model = dataclasses.replace(CostModel.uniform(2, comm=0.5), bandwidth=float("inf"))
    assert model.boundary_time(0, 1) == 0.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("F=-1", "F = -1.0 must be finite and >= 0"),
        ("comm=-5", "comm = -5.0 must be finite and >= 0"),
        ("F=nan", "F = nan must be finite"),
        ("F=inf", "F = inf must be finite"),
        ("I=1,W=-0.5", "W = -0.5 must be"),
        ("B=1e400", "B = inf must be"),
        ("W_fused=-1", "W_fused = -1.0 must be"),
        ("overhead=nan", "overhead = nan"),
        ("post=-1", "post = -1.0"),
        ("act_w=-2", "act_w = -2.0"),
    ],
)
def test_parse_rejects_impossible_costs_naming_the_spec(spec: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        CostModel.parse(spec, 4, chunks=2)
    assert repr(spec) in str(info.value)


def test_from_json_names_the_stage_of_a_bad_figure() -> None:
    data = CostModel.uniform(4).to_dict()
    data["stages"][2]["F"] = -1
    with pytest.raises(ScheduleError, match=r"^stage 2: F = -1 must be finite and >= 0$"):
        CostModel.from_dict(data)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "not a zeropipe cost model"),
        ('{"format": "zeropipe-costs"}', "needs 'stages'"),
        ('{"format": "zeropipe-costs", "stages": [1]}', "stage 0: expected an object"),
        ('{"format": "zeropipe-costs", "stages": [{"Q": 1}]}', "stage 0: unknown field"),
        ('{"format": "zeropipe-costs", "stages": [{"F": "1"}]}', "stage 0: F = '1' is not"),
        ('{"format": "zeropipe-costs", "stages": [{"F": NaN}]}', "stage 0: F = nan"),
        ('{"format": "zeropipe-costs", "stages": [], "latency": "x"}', "latency = 'x'"),
        ('{"format": "zeropipe-costs", "stages": [], "bandwidth": 0}', "bandwidth = 0.0"),
        ('{"format": "zeropipe-costs", "stages": [], "meta": 3}', "'meta' must be"),
    ],
)
def test_malformed_cost_json_is_a_schedule_error(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        CostModel.from_json(text)


def test_round_trip_through_json_still_works() -> None:
    model = CostModel.uniform(3, comm=0.25, W_fused=0.5, post=0.1)
    assert CostModel.from_json(model.to_json()) == model


def test_replace_stage_checks_the_new_figures_and_names_the_stage() -> None:
    model = CostModel.uniform(3)
    assert model.replace_stage(1, F=2.0).stages[1].F == 2.0
    with pytest.raises(ScheduleError, match=r"^stage 1: F = -2.0 must be finite"):
        model.replace_stage(1, F=-2.0)
    with pytest.raises(ScheduleError, match="no stage 3"):
        model.replace_stage(3, F=1.0)
    with pytest.raises(ScheduleError, match=r"unknown field.*Q"):
        model.replace_stage(0, Q=1.0)


def test_uniform_reports_the_value_given_not_its_share_per_chunk() -> None:
    with pytest.raises(ScheduleError, match=r"^F = -4 must be"):
        CostModel.uniform(2, chunks=4, F=-4)
    with pytest.raises(ScheduleError, match="chunks must be an integer >= 1"):
        CostModel.uniform(2, chunks=0)


def test_scaled_and_merged_check_their_input() -> None:
    with pytest.raises(ScheduleError, match=r"scale factor = -1\.0"):
        StageCost().scaled(-1.0)
    with pytest.raises(ScheduleError, match="at least one stage"):
        StageCost.merged([])
