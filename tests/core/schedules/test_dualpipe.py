"""DualPipe: routes and copies in the IR, the generator's refusals, and DeepSeek's table.

The table (github.com/deepseek-ai/DualPipe, README): per-rank bubble 1F1B
(PP-1)(F+B), ZB1P (PP-1)(F+B-2W), DualPipe (PP/2-1)(F&B+B-3W); parameters 2x,
activations PP+1.  The bubble is the largest ``makespan - busy(rank)`` of the
simulated step, communication free; ``F&B = F + B - overlap * min(F, B)``.
"""

from __future__ import annotations

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.message_order import message_order
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate


def _costs(schedule: Schedule, F: float, I: float, W: float, overlap: float) -> CostModel:
    """Every stage alike, one unit of weights and of activations per stage."""
    stage = StageCost(F=F, I=I, W=W, act=1.0, weights=1.0)
    return CostModel(tuple(stage for _ in range(schedule.num_stages)), overlap=overlap)


def _bubble(name: str, pp: int, m: int, costs: tuple[float, float, float, float]) -> float:
    s = generate(name, pp, m)
    timeline = simulate(s, _costs(s, *costs))
    return max(timeline.bubble(r) for r in range(pp))


# (F, I, W, overlap): I = F, as the table's figure draws a backward's input part.
TABLE_COSTS = [
    (1.0, 1.0, 1.0, 0.0),
    (1.0, 1.0, 0.5, 0.5),
    (2.0, 2.0, 1.0, 1.0),
    (1.0, 1.0, 0.25, 0.3),
]


@pytest.mark.parametrize("pp", [4, 6, 8])
@pytest.mark.parametrize("costs", TABLE_COSTS)
def test_simulated_bubbles_are_the_published_table(
    pp: int, costs: tuple[float, float, float, float]
) -> None:
    F, I, W, overlap = costs
    B = I + W
    pair = F + B - overlap * min(F, B)
    m = 2 * pp
    assert _bubble("1f1b", pp, m, costs) == pytest.approx((pp - 1) * (F + B))
    assert _bubble("zb-h1", pp, m, costs) == pytest.approx((pp - 1) * (F + B - 2 * W))
    assert _bubble("dualpipe", pp, m, costs) == pytest.approx((pp / 2 - 1) * (pair + B - 3 * W))
    # More microbatches lengthen the steady state only: the bubble stays.
    assert _bubble("dualpipe", pp, m + 6, costs) == pytest.approx(_bubble("dualpipe", pp, m, costs))


@pytest.mark.parametrize("pp", [4, 6, 8])
def test_parameters_twice_and_activations_pp_plus_one(pp: int) -> None:
    s = generate("dualpipe", pp, 2 * pp)
    for costs in (_costs(s, 1.0, 1.0, 1.0, 0.0), _costs(s, 1.0, 1.0, 1.0, 1.0)):
        timeline = simulate(s, costs)
        # Each rank holds two stages' weights (1 each) plus PP+1 microbatches' activations.
        assert [len(s.stages_of(r)) for r in range(pp)] == [2] * pp
        assert max(timeline.peak_memory) == pytest.approx(2 + pp + 1)
    one = generate("1f1b", pp, 2 * pp)
    assert max(simulate(one, _costs(one, 1.0, 1.0, 1.0, 0.0)).peak_memory) == pytest.approx(1 + pp)


@pytest.mark.parametrize("pp", [2, 4, 6])
@pytest.mark.parametrize("extra", [0, 2, 8])
def test_every_microbatch_runs_its_own_route_once(pp: int, extra: int) -> None:
    m = 2 * pp - 2 + extra if pp > 2 else 2 + extra
    s = generate("dualpipe", pp, m)
    validate(s)
    assert s.num_stages == 2 * pp and s.copies == tuple((pp + k, k) for k in range(pp))
    for i in range(m):
        route = s.route(i)
        assert route == (tuple(range(pp)) if i < m // 2 else tuple(range(pp, 2 * pp)))
        done = {
            a.stage for acts in s.actions for a in acts if a.microbatch == i and a.kind is Kind.F
        }
        assert done == set(route)
    # Half the microbatches enter at rank 0, half at the last rank.
    assert s.placement[0] == 0 and s.placement[pp] == pp - 1
    assert all(f.kind is Kind.F for f, _ in s.overlaps)
    assert s.overlaps or pp == 2  # two ranks: each direction's V has no steady state


def test_lowered_dualpipe_sends_only_along_routes_and_orders_its_messages() -> None:
    s = generate("dualpipe", 4, 8)
    low = lower(s)
    validate(low)
    sends = [a for acts in low.actions for a in acts if a.kind is Kind.SEND_F]
    # Stage 3 (end of the down route) and stage 7 (end of the up route) send nothing on.
    assert {a.stage for a in sends} == {0, 1, 2, 4, 5, 6}
    assert len(sends) == 6 * 4
    order = message_order(low)
    assert sum(len(o) for o in order) == 2 * sum(
        a.kind.value.startswith("SEND") for acts in low.actions for a in acts
    )


@pytest.mark.parametrize(
    ("pp", "m", "words"),
    [
        (3, 8, "even number of ranks"),
        (4, 7, "even number of microbatches"),
        (4, 4, ">= 2 x ranks - 2"),
    ],
)
def test_refusals_are_one_line(pp: int, m: int, words: str) -> None:
    with pytest.raises(ScheduleError, match=words) as err:
        generate("dualpipe", pp, m)
    assert err.value.rule == "unsupported" and "\n" not in str(err.value)


def test_routes_and_copies_round_trip_through_text_and_json() -> None:
    s = generate("dualpipe", 4, 8)
    text = s.to_text()
    assert "route 0-3: 0 1 2 3\nroute 4-7: 4 5 6 7\ncopies: 4=0 5=1 6=2 7=3" in text
    for back in (Schedule.from_text(text), Schedule.from_json(s.to_json())):
        assert back == s and back.routes == s.routes and back.copies == s.copies
    assert s.to_dict()["routes"] == {"0-3": [0, 1, 2, 3], "4-7": [4, 5, 6, 7]}
    with pytest.raises(ScheduleError, match="no routes or copies"):
        s.to_torch_csv()


def test_a_schedule_without_routes_writes_and_reads_as_before() -> None:
    s = generate("1f1b", 2, 2)
    assert "route" not in s.to_text() and "copies" not in s.to_text()
    assert set(s.to_dict()) == {"format", "version", "name", "microbatches", "placement", "actions"}
    assert s.route(1) == (0, 1) and s.copy_of(1) == 1
    # Routes that all visit every stage are the default: written as none.
    same = Schedule(s.placement, s.actions, 2, routes=[(0, 1), (0, 1)])
    assert "route" not in same.to_text()


def test_a_route_line_names_some_microbatches_and_the_rest_visit_every_stage() -> None:
    text = "microbatches: 2\nplacement: 0 1\nroute 1: 1\nrank 0: 0F0 0B0\nrank 1: 1F0 1B0 1F1 1B1\n"
    s = Schedule.from_text(text)
    assert s.route(0) == (0, 1) and s.route(1) == (1,)
    validate(s)
    assert simulate(s).makespan > 0


@pytest.mark.parametrize(
    ("routes", "copies", "words"),
    [
        ([(0, 2), (0, 1, 2)], {}, "consecutive stages"),
        ([(0, 1, 2)], {}, "one per microbatch"),
        ([(0, 1, 2, 3), (0, 1, 2)], {}, "consecutive stages"),
        ([], {2: 2}, "copy of stage 2"),
        ([], {2: 1, 1: 0}, "an original"),
    ],
)
def test_bad_routes_and_copies_are_refused(
    routes: list[tuple[int, ...]], copies: dict[int, int], words: str
) -> None:
    acts = [[Action(Kind.F, 0, 0)], [Action(Kind.F, 1, 0)], [Action(Kind.F, 2, 0)]]
    with pytest.raises(ScheduleError, match=words):
        Schedule((0, 1, 2), acts, 2, routes=routes, copies=copies)


def test_an_action_off_its_microbatchs_route_is_refused_by_name() -> None:
    text = "microbatches: 2\nplacement: 0 1\nroute 1: 1\nrank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1B0 1F1 1B1\n"
    with pytest.raises(ScheduleError, match="stage 0 is not on the route of microbatch 1") as err:
        validate(Schedule.from_text(text))
    assert err.value.rule == "route"


def test_a_route_line_for_a_microbatch_twice_or_out_of_range_is_refused() -> None:
    base = "microbatches: 2\nplacement: 0 1\nrank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1B0 1F1 1B1\n"
    with pytest.raises(ScheduleError, match="given twice"):
        Schedule.from_text(base + "route 0-1: 0 1\nroute 1: 0 1\n")
    with pytest.raises(ScheduleError, match="no such microbatch"):
        Schedule.from_text(base + "route 5: 0 1\n")


def test_a_stage_reduces_its_gradients_after_the_microbatches_of_its_route_only() -> None:
    s = build_schedule("dualpipe", ranks=4, microbatches=8, reduce_grad=True, group_w=2)
    deps = Dependencies(s)
    for stage in range(8):
        needs = deps.requires(Action(Kind.REDUCE_GRAD, stage))
        assert sorted(d.action.microbatch for d in needs) == deps.visitors(stage)
        assert deps.visitors(stage) == ([0, 1, 2, 3] if stage < 4 else [4, 5, 6, 7])
    assert deps.first_stage(5) == 4 and deps.last_stage(5) == 7 and not deps.visits(3, 5)


def test_its_step_ends_with_the_sum_of_its_copies_gradients_across_ranks() -> None:
    # Every model stage runs on two ranks: the runtime sums its gradients over the
    # pipeline's ranks after the last action, one ring all-reduce of every model stage's.
    made = generate("dualpipe", 4, 8)
    stage = StageCost(F=1.0, B=2.0, weights=3.0)
    free = CostModel((stage,) * 4).with_copies(made)
    linked = CostModel((stage,) * 4, latency=0.25, bandwidth=2.0).with_copies(made)
    expected = 0.25 + 2 * 3 / 4 * (4 * 3.0) / 2.0  # latency + 2 (p-1)/p x bytes / bandwidth
    assert linked.copies_sum_time(made) == pytest.approx(expected)
    assert free.copies_sum_time(made) == 0.0  # an infinitely fast link
    before, after = simulate(made, free), simulate(made, linked)
    assert after.tail == pytest.approx(expected) and before.tail == 0.0
    last = max(e.end for evs in after.events for e in evs)
    assert after.makespan == pytest.approx(last - after.start + expected)
    assert after.bubble_rate > before.bubble_rate  # every rank idles in the sum
    one_way = generate("dualpipev", 4, 8)
    assert CostModel((stage,) * 8, latency=0.25, bandwidth=2.0).copies_sum_time(one_way) == 0.0
