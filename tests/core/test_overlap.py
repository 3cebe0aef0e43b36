"""Overlapped F/B pairs (torch's OVERLAP_F_B): their forms, rules, passes and price."""

from __future__ import annotations

import pytest

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Graph, keep_overlaps
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.passes.fuse import group_weights, split_full_backward
from zeropipe.core.passes.lower import lower
from zeropipe.core.passes.reduce import add_reductions
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

# torch 2.13's ScheduleDualPipeV for 2 ranks and 4 microbatches, as _dump_csv writes it.
DUALPIPEV = (
    "0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,"
    "(3F3;0B1)OVERLAP_F_B,3B3,0I2,0W2,0I3,0W3\n"
    "1F0,2F0,1F1,2F1,1F2,2B0,(2F2;1B0)OVERLAP_F_B,(1F3;2B1)OVERLAP_F_B,"
    "(2F3;1B1)OVERLAP_F_B,2B2,1B2,2I3,1I3,2W3,1W3\n"
)


@pytest.fixture
def dualpipev() -> Schedule:
    return Schedule.from_torch_csv(DUALPIPEV)


def _adjacent(s: Schedule) -> None:
    s.check_overlaps_adjacent()
    assert sum(len(s.overlapped(r)) for r in range(s.num_ranks)) == len(s.overlaps)


def test_pairs_are_two_actions_and_a_record(dualpipev: Schedule) -> None:
    assert len(dualpipev.overlaps) == 6
    assert (Action.parse("0F3"), Action.parse("3B1")) in dualpipev.overlaps
    assert dualpipev.overlapped(0) == frozenset({7, 9, 12})
    assert dualpipev.actions[0][7:9] == (Action.parse("0F3"), Action.parse("3B1"))
    assert dualpipev.overlapped(5) == frozenset()
    assert dualpipev.placement == (0, 1, 1, 0)


def test_every_form_round_trips_the_pairs(dualpipev: Schedule) -> None:
    text = dualpipev.to_text()
    assert "(0F3;3B1) (3F2;0B0) 3B2" in text
    assert Schedule.from_text(text) == dualpipev
    assert Schedule.from_json(dualpipev.to_json()) == dualpipev
    assert dualpipev.to_torch_csv() == DUALPIPEV
    assert Schedule.from_torch_csv(dualpipev.to_torch_csv()) == dualpipev
    lowered = lower(dualpipev)
    assert Schedule.from_text(lowered.to_text()) == lowered


def test_without_the_record_the_schedule_differs(dualpipev: Schedule) -> None:
    plain = Schedule(dualpipev.placement, dualpipev.actions, dualpipev.microbatches, "x")
    assert plain != dualpipev.replace_actions(dualpipev.actions, name="x")
    assert plain.overlapped(0) == frozenset()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("(0F0;0F1)", "a pair is a forward F then a backward B or I"),
        ("(0B0;0F1)", "a pair is a forward F then a backward B or I"),
        ("(0F0 0B0)", "cannot read"),
        ("(0F0;0B0;0B1)", "cannot read"),
    ],
)
def test_malformed_pairs_are_refused(text: str, words: str) -> None:
    with pytest.raises(ScheduleError, match=words.replace("(", r"\(")):
        Schedule.from_text(f"microbatches: 2\nplacement: 0\nrank 0: {text}\n")


def test_torch_fsdp_actions_are_refused_naming_fsdp2() -> None:
    with pytest.raises(ScheduleError, match="FSDP2's own hooks") as err:
        Schedule.from_torch_csv("0UNSHARD,0F0,0B0,0RESHARD\n")
    assert err.value.rule == "unsupported"


def test_validate_wants_pairs_adjacent_and_independent() -> None:
    apart = Schedule.from_text(
        "microbatches: 2\nplacement: 0 1\nrank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 (1F1;1B0) 1B1\n"
    )
    validate(apart)
    moved = apart.replace_actions(
        [apart.actions[0], [Action.parse(t) for t in ["1F0", "1F1", "1B1", "1B0"]]]
    )
    with pytest.raises(ScheduleError, match="must come right after") as err:
        validate(moved)
    assert err.value.rule == "overlap"
    own = Schedule.from_text("microbatches: 1\nplacement: 0\nrank 0: (0F0;0B0)\n")
    with pytest.raises(ScheduleError, match="0B0 needs 0F0") as err:
        validate(own)
    assert err.value.rule == "overlap"


def test_a_pair_starts_when_the_backwards_gradient_has_arrived() -> None:
    # 0B0 waits for 1B0's gradient; 0F1 of the pair may not start before it either.
    s = Schedule.from_text(
        "microbatches: 2\nplacement: 0 1\nrank 0: 0F0 (0F1;0B0) 0B1\nrank 1: 1F0 1B0 1F1 1B1\n"
    )
    validate(s)
    t = simulate(s, CostModel.uniform(2, F=1.0, B=2.0, comm=0.5))
    gradient_in = t.events[1][1].end + 0.5
    assert t.events[0][1].start == pytest.approx(gradient_in)


def test_the_graph_makes_the_pair_wait_for_both_inputs(dualpipev: Schedule) -> None:
    g = Graph(dualpipev)
    k = 7  # (0F3;3B1) on rank 0: 0F3 also waits for what 3B1 needs (3F1, the gradient of 3B1)
    waits = {str(dep.action) for _, _, dep in g.preds[0][k] if dep is not None}
    assert {"3F1"} <= waits


@pytest.mark.parametrize("ahead", [None, 1, 2])
def test_lowering_keeps_pairs_whole(dualpipev: Schedule, ahead: int | None) -> None:
    lowered = lower(dualpipev, ahead)
    validate(lowered)
    _adjacent(lowered)
    assert lowered.overlaps == dualpipev.overlaps


def test_memory_and_w_passes_keep_pairs_whole(dualpipev: Schedule) -> None:
    for out in (
        checkpoint(dualpipev, ahead=1),
        offload(dualpipev, prefetch=2),
        offload_weights(dualpipev),
        checkpoint(lower(dualpipev)),
        group_weights(dualpipev, 2),
        add_reductions(lower(dualpipev)),
    ):
        validate(out)
        _adjacent(out)


def test_splitting_b_pairs_the_forward_with_i(dualpipev: Schedule) -> None:
    split = split_full_backward(dualpipev)
    assert (Action.parse("0F3"), Action.parse("3I1")) in split.overlaps
    validate(split)
    _adjacent(split)


def test_keep_overlaps_moves_out_what_a_pass_put_inside() -> None:
    s = Schedule.from_text(
        "microbatches: 2\nplacement: 0 1\nrank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 (1F1;1B0) 1B1\n"
    )
    inside = s.replace_actions(
        [
            s.actions[0],
            [Action.parse(t) for t in ["1F0", "1F1", "1OFFLOAD1", "1R0", "1B0", "1RELOAD1", "1B1"]],
        ]
    )
    fixed = keep_overlaps(inside)
    assert " ".join(map(str, fixed.actions[1])) == "1F0 1R0 1F1 1B0 1OFFLOAD1 1RELOAD1 1B1"


def test_pair_pricing(dualpipev: Schedule) -> None:
    s = Schedule.from_text("microbatches: 2\nplacement: 0\nrank 0: 0F0 (0F1;0B0) 0B1\n")
    base = CostModel.uniform(1, F=1.0, B=3.0)
    assert simulate(s, base).makespan == pytest.approx(1 + 1 + 3 + 3)
    half = CostModel(base.stages, overlap=0.5)
    t = simulate(s, half)
    assert t.makespan == pytest.approx(1 + (1 + 3 - 0.5 * 1) + 3)
    f, b = t.events[0][1], t.events[0][2]
    assert (f.end - f.start, b.end - b.start) == pytest.approx((1.0, 2.5))
    assert b.start == pytest.approx(f.end)
    assert CostModel.from_json(half.to_json()) == half
    with pytest.raises(ScheduleError, match=r"overlap = 1\.5"):
        CostModel(base.stages, overlap=1.5)
    # The same schedule without the record is priced as two actions.
    full = simulate(dualpipev, CostModel(CostModel.uniform(4, chunks=2).stages, overlap=1.0))
    none = simulate(dualpipev, CostModel.uniform(4, chunks=2))
    assert full.makespan < none.makespan


def test_kind_of_a_pair_member_is_its_own() -> None:
    s = Schedule.from_text("microbatches: 2\nplacement: 0\nrank 0: 0F0 (0F1;0B0) 0B1\n")
    assert [a.kind for a in s.actions[0]] == [Kind.F, Kind.F, Kind.B, Kind.B]
