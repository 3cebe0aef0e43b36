"""group_weights: B split into I and W, W of a stage gathered in runs, nothing else moved,
and the runtime fuses them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from tests.gradcheck import (
    assert_same_gradients,
    assert_same_loss,
    batch_for,
    reference,
    token_loss,
    token_model,
)
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fuse import fused_weights, group_weights, split_full_backward
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.core.validate import validate
from zeropipe.runtime.pipeline import Pipeline

WITH_W = ("zb-h1", "zb-h2", "zbv", "interleaved-zb", "dualpipev")
WITH_B = ("gpipe", "1f1b", "interleaved-1f1b")


def _runs(schedule: Schedule) -> list[list[int]]:
    """Per rank and stage, the lengths of runs of consecutive W of that stage (compute order)."""
    out = []
    for actions in schedule.compute_only().actions:
        run: list[int] = []
        prev = None
        for a in actions:
            if (
                a.kind is Kind.W
                and prev is not None
                and prev.kind is Kind.W
                and prev.stage == a.stage
            ):
                run[-1] += 1
            elif a.kind is Kind.W:
                run.append(1)
            prev = a
        out.append(run)
    return out


def _others_before(actions: Sequence[Action], w: Action) -> int:
    return sum(1 for a in actions[: actions.index(w)] if a.kind is not Kind.W)


@pytest.mark.parametrize("name", WITH_W + WITH_B)
def test_split_full_backward_puts_i_then_w_where_each_b_was(name: str) -> None:
    base = generate(name, 2, 6)
    split = split_full_backward(base)
    validate(split)
    assert split.name == base.name
    for before, after in zip(base.actions, split.actions, strict=True):
        expected = []
        for a in before:
            if a.kind is Kind.B:
                expected += [
                    Action(Kind.I, a.stage, a.microbatch),
                    Action(Kind.W, a.stage, a.microbatch),
                ]
            else:
                expected.append(a)
        assert list(after) == expected
    assert not any(a.kind is Kind.B for actions in split.actions for a in actions)


def test_split_full_backward_of_a_schedule_without_b_is_that_schedule() -> None:
    base = generate("zb-h1", 2, 4)
    assert split_full_backward(base) is base


def test_split_full_backward_of_a_lowered_schedule_sends_after_i() -> None:
    split = split_full_backward(lower(generate("1f1b", 2, 4)))
    assert split.is_lowered
    validate(split)
    for actions in split.actions:
        for k, a in enumerate(actions):
            if a.kind is Kind.SEND_B:
                assert actions[k - 1] == Action(Kind.I, a.stage, a.microbatch)


@pytest.mark.parametrize("name", WITH_W + WITH_B)
@pytest.mark.parametrize("size", [2, 3, 8])
def test_grouped_schedules_validate_and_only_w_moves_later(name: str, size: int) -> None:
    base = split_full_backward(generate(name, 2, 8))
    grouped = group_weights(base, size)
    validate(grouped)
    assert grouped.name == f"{base.name}+w{size}"
    for before, after in zip(base.actions, grouped.actions, strict=True):
        assert sorted(map(str, before)) == sorted(map(str, after))
        assert [a for a in before if a.kind is not Kind.W] == [
            a for a in after if a.kind is not Kind.W
        ]
        for w in (a for a in before if a.kind is Kind.W):  # W only ever waits
            assert _others_before(after, w) >= _others_before(before, w)
    for rank, runs in enumerate(_runs(grouped)):
        per_stage = [
            sum(1 for a in base.actions[rank] if a.kind is Kind.W and a.stage == s)
            for s in base.stages_of(rank)
        ]
        # At most one run per group (adjacent groups merge into one longer run).
        assert len(runs) <= sum(-(-n // size) for n in per_stage), runs


def test_lowered_schedules_are_grouped_and_lowered_again() -> None:
    base = lower(generate("zbv", 2, 6))
    grouped = group_weights(base, 2)
    assert grouped.is_lowered
    validate(grouped)
    assert grouped.compute_only().actions == group_weights(base.compute_only(), 2).actions


def test_size_one_is_the_schedule_itself_and_bad_sizes_are_refused() -> None:
    base = generate("zb-h1", 2, 4)
    assert group_weights(base, 1) is base
    with pytest.raises(ScheduleError, match="size must be >= 1"):
        group_weights(base, 0)


def test_fused_weights_are_the_w_followed_by_a_w_of_their_stage() -> None:
    grouped = lower(group_weights(generate("zb-h1", 2, 4), 2))
    fused = fused_weights(grouped)
    assert fused  # sends/receives between two W do not break the pair
    for actions in grouped.actions:
        compute = [a for a in actions if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.R)]
        for a, b in itertools.pairwise(compute):
            assert (a in fused) == (a.kind is Kind.W and b.kind is Kind.W and a.stage == b.stage)
    # Named schedules have adjacent W only where their cooldown leaves them.
    assert len(fused_weights(lower(generate("zb-h1", 2, 4)))) < len(fused)


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "interleaved-zb", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("size", [2, 4])
def test_pipeline_with_grouped_w_matches_the_reference(name: str, size: int) -> None:
    model = token_model(dropout=0.2)
    x, y = batch_for(model, batch=11)
    ref_loss, ref = reference(model, x, y, token_loss, 5)
    pipe = Pipeline(
        model, build_schedule(name, ranks=2, microbatches=5, group_w=size), loss_fn=token_loss
    )
    assert pipe.fused_weights
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    ran = {e.action for evs in pipe.last_events for e in evs}
    assert pipe.fused_weights <= ran


def test_grouped_w_with_recompute_still_matches() -> None:
    from zeropipe.core.passes.fit import checkpoint

    model = token_model(dropout=0.2)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, token_loss, 4)
    schedule = group_weights(checkpoint(generate("zbv", 2, 4)), 2)
    pipe = Pipeline(model, schedule, loss_fn=token_loss)
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)


def test_auto_refuses_group_w_because_it_groups_w_itself() -> None:
    with pytest.raises(
        ScheduleError, match=r"group_w=4 with the 'auto' schedule.*leave group_w at 1"
    ):
        build_schedule("auto", ranks=2, microbatches=4, group_w=4)
