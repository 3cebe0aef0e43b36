"""REDUCE_GRAD: the dependency rule, the validator's rules, add_reductions, its price,
the simulated data-parallel link and how the pictures show it."""

from __future__ import annotations

import json

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.memory import peak_memory
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.passes.fuse import group_weights
from zeropipe.core.passes.lower import lower, strip_comm
from zeropipe.core.passes.reduce import add_reductions, strip_reductions
from zeropipe.core.render import render_text, to_chrome_trace
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

RG = Kind.REDUCE_GRAD


def _reductions(s: Schedule) -> dict[int, tuple[int, int]]:
    return {
        a.stage: (r, k)
        for r, acts in enumerate(s.actions)
        for k, a in enumerate(acts)
        if a.kind is RG
    }


def _last_backward(s: Schedule, stage: int) -> tuple[int, int]:
    r = s.placement[stage]
    return r, max(
        k for k, a in enumerate(s.actions[r]) if a.stage == stage and a.kind in (Kind.B, Kind.W)
    )


# -- deps ------------------------------------------------------------------------------
def test_reduce_grad_needs_every_final_backward_of_its_stage() -> None:
    s = Schedule.from_text(
        "microbatches: 3\nplacement: 0\nrank 0: 0F0 0F1 0F2 0B0 0I1 0W1 0I2 0W2 0REDUCE_GRAD\n"
    )
    need = {d.action for d in Dependencies(s).requires(Action(RG, 0))}
    assert need == {Action.parse(t) for t in ("0B0", "0W1", "0W2")}
    # Nothing needs it: no other action's rule names it.
    deps = Dependencies(s)
    assert all(Action(RG, 0) not in {d.action for d in deps.requires(a)} for a in s.actions[0])


# -- validate ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev"])
def test_add_reductions_gives_valid_schedules_one_per_stage(name: str) -> None:
    s = add_reductions(lower(generate(name, 3, 6)))
    validate(s)
    where = _reductions(s)
    assert sorted(where) == list(range(s.num_stages))
    for stage, (r, k) in where.items():
        assert r == s.placement[stage]
        lr, lk = _last_backward(s, stage)
        assert lr == r and lk < k
        # right after the backward, past only the sends that follow it at once
        assert all(a.kind in (Kind.SEND_B, Kind.SEND_F) for a in s.actions[r][lk + 1 : k])


def test_add_reductions_is_idempotent_and_keeps_every_other_action() -> None:
    base = lower(generate("interleaved-1f1b", 2, 4))
    once = add_reductions(base)
    assert add_reductions(once) == once
    assert strip_reductions(once) == base
    # hand-moved reductions are put back in place
    moved = once.replace_actions(
        [
            [*[a for a in acts if a.kind is not RG], *[a for a in acts if a.kind is RG]]
            for acts in once.actions
        ]
    )
    assert add_reductions(moved) == once


@pytest.mark.parametrize(
    ("text", "rule", "words"),
    [
        (
            "rank 0: 0F0 0F1 0B0 0REDUCE_GRAD 0B1\nrank 1: 1F0 1B0 1F1 1B1 1REDUCE_GRAD\n",
            "order",
            "0REDUCE_GRAD comes before 0B1",
        ),
        (
            "rank 0: 0F0 0F1 0B0 0B1 0REDUCE_GRAD\nrank 1: 1F0 1B0 1F1 1B1\n",
            "reduce",
            "1REDUCE_GRAD is missing",
        ),
        (
            "rank 0: 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0REDUCE_GRAD\n"
            "rank 1: 1F0 1B0 1F1 1B1 1REDUCE_GRAD\n",
            "reduce",
            "0REDUCE_GRAD appears 2 times",
        ),
        (
            "rank 0: 0F0 0F1 0B0 0B1 1REDUCE_GRAD\nrank 1: 1F0 1B0 1F1 1B1 0REDUCE_GRAD\n",
            "placement",
            "1REDUCE_GRAD is on rank 0",
        ),
    ],
)
def test_validate_names_the_broken_reduction_rule(text: str, rule: str, words: str) -> None:
    s = Schedule.from_text("microbatches: 2\nplacement: 0 1\n" + text)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert err.value.rule == rule
    assert words in str(err.value)


def test_torch_style_reduction_after_last_b_validates() -> None:
    s = Schedule.from_torch_csv("0F0,0F1,0B0,0B1,0REDUCE_GRAD\n1F0,1B0,1F1,1B1,1REDUCE_GRAD\n")
    validate(s)
    assert Schedule.from_torch_csv(s.to_torch_csv()) == s
    assert Schedule.from_json(s.to_json()) == s == Schedule.from_text(s.to_text())


# -- passes keep them -------------------------------------------------------------------
def test_passes_keep_reductions_after_the_backward() -> None:
    s = add_reductions(generate("1f1b", 2, 4))
    for out in (
        lower(s),
        strip_comm(lower(s)),
        lower(s, ahead=1),
        checkpoint(s),
        offload(s),
        offload_weights(s),
        group_weights(s, 2),
        group_weights(lower(s), 3),
    ):
        validate(out)
        assert sorted(_reductions(out)) == [0, 1]


def test_build_schedule_adds_reductions_only_when_asked() -> None:
    plain = build_schedule("zb-h1", ranks=2, microbatches=4)
    reduced = build_schedule("zb-h1", ranks=2, microbatches=4, reduce_grad=True, group_w=2)
    assert not _reductions(plain)
    assert sorted(_reductions(reduced)) == [0, 1]
    assert strip_reductions(reduced) == build_schedule("zb-h1", ranks=2, microbatches=4, group_w=2)


def test_build_schedule_keeps_reductions_a_schedule_already_places() -> None:
    """A hand-placed REDUCE_GRAD (here: every one at the end of its rank) runs as written."""
    s = build_schedule("zbv", ranks=2, microbatches=4, reduce_grad=True)  # 2 stages per rank
    at_end = s.replace_actions(
        [
            [a for a in acts if a.kind is not RG] + [a for a in acts if a.kind is RG]
            for acts in s.actions
        ]
    )
    assert at_end != s
    assert build_schedule(at_end, reduce_grad=True) == at_end


# -- costs -------------------------------------------------------------------------------
def test_reduce_time_is_a_ring_all_reduce_and_zero_without_replicas() -> None:
    stages = (StageCost(weights=100.0), StageCost(weights=100.0, grad_bytes=40.0))
    one = CostModel(stages, dp_latency=1.0, dp_bandwidth=10.0)
    assert one.reduce_time(0) == 0.0
    four = CostModel(stages, dp=4, dp_latency=1.0, dp_bandwidth=10.0)
    assert four.reduce_time(0) == pytest.approx(1.0 + 2 * 3 / 4 * 100 / 10)
    assert four.reduce_time(1) == pytest.approx(1.0 + 2 * 3 / 4 * 40 / 10)
    assert four.time(Action(RG, 0)) == 0.0
    assert CostModel(stages, overhead=0.25).time(Action(RG, 0)) == 0.25
    assert CostModel.from_json(four.to_json()) == four
    with pytest.raises(ScheduleError, match="dp = 0"):
        CostModel(stages, dp=0)


def test_reductions_hold_no_memory() -> None:
    s = add_reductions(generate("1f1b", 2, 3))
    costs = CostModel(tuple(StageCost(weights=5.0) for _ in range(2)))
    assert peak_memory(s, costs) == peak_memory(strip_reductions(s), costs)


# -- simulate ----------------------------------------------------------------------------
def test_reductions_run_beside_compute_and_end_the_step() -> None:
    base = lower(generate("1f1b", 4, 8))
    s = add_reductions(base)
    uniform = CostModel.uniform(4)
    dp = CostModel(uniform.stages, dp=2, dp_latency=2.0)
    t = simulate(s, dp)
    plain = simulate(base, uniform)
    # The last stage finishes first: its reduction ends while rank 0 still computes.
    last = t.reductions(3)[0]
    assert last.end - last.start == pytest.approx(2.0)
    assert last.end < max(e.end for e in t.events[0] if e.lane == "compute")
    assert t.compute_end == pytest.approx(plain.makespan)
    assert t.makespan == pytest.approx(t.reductions(0)[0].end)
    assert t.makespan == pytest.approx(plain.makespan + 2.0)
    # Reductions are not compute: the busy time is the same, the bubble larger.
    assert [t.busy(r) for r in range(4)] == [plain.busy(r) for r in range(4)]
    assert simulate(s, uniform).makespan == pytest.approx(plain.makespan)  # dp = 1


def test_one_link_per_rank_runs_reductions_in_posting_order() -> None:
    s = add_reductions(lower(generate("zbv", 2, 4)))  # two stages per rank
    t = simulate(s, CostModel(CostModel.uniform(4, chunks=2).stages, dp=2, dp_latency=5.0))
    for r in range(2):
        first, second = t.reductions(r)
        assert second.start >= first.end - 1e-12


def test_graph_of_a_reduced_schedule_has_no_cycle() -> None:
    s = add_reductions(lower(generate("interleaved-zb", 2, 4)))
    assert len(Graph(s).order) == sum(len(a) for a in s.actions)


# -- render ------------------------------------------------------------------------------
def test_text_grid_and_trace_show_reductions_on_their_own_row() -> None:
    s = add_reductions(lower(generate("1f1b", 2, 2)))
    t = simulate(s, CostModel(CostModel.uniform(2).stages, dp=2, dp_latency=3.0))
    text = render_text(t, width=60)
    rows = text.splitlines()
    reduce_rows = [r for r in rows if r.startswith("  reduce")]
    assert len(reduce_rows) == 2 and all("G" in r for r in reduce_rows)
    assert "G grad all-reduce" in rows[-1]
    trace = json.loads(json.dumps(to_chrome_trace(t)))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"rank 0 reduce", "rank 1 reduce"} <= names
    reduce_events = [e for e in trace["traceEvents"] if e.get("cat") == "REDUCE_GRAD"]
    assert len(reduce_events) == 2 and all(e["dur"] == pytest.approx(3000) for e in reduce_events)


def test_png_draws_reductions() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from zeropipe.core.render import KIND_COLORS, draw_timeline

    s = add_reductions(lower(generate("1f1b", 2, 2)))
    t = simulate(s, CostModel(CostModel.uniform(2).stages, dp=2, dp_latency=3.0))
    ax = Figure(figsize=(10, 2)).subplots()
    draw_timeline(ax, t)
    labels = [x.get_text() for x in ax.get_legend().get_texts()]
    assert "grad all-reduce" in labels
    want = tuple(int(KIND_COLORS[RG][i : i + 2], 16) / 255 for i in (1, 3, 5))
    colors = {tuple(round(c, 3) for c in p.get_facecolor()[0][:3]) for p in ax.collections}
    assert tuple(round(c, 3) for c in want) in colors


def test_cost_spec_reads_the_data_parallel_figures() -> None:
    c = CostModel.parse("F=1,dp=4,dp_latency=0.5,dp_bandwidth=10,grad_bytes=20,overlap=0.25", 4, 2)
    assert (c.dp, c.dp_latency, c.dp_bandwidth, c.overlap) == (4, 0.5, 10.0, 0.25)
    assert c.stages[0].grad_bytes == 10.0  # one chunk's share
    assert c.reduce_time(3) == pytest.approx(0.5 + 1.5 * 10 / 10)
    with pytest.raises(ScheduleError, match=r"dp = 1\.5 is not a whole number"):
        CostModel.parse("dp=1.5", 2)
