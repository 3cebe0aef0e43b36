"""build_schedule: the one path from a name or a Schedule to the schedule that runs."""

from __future__ import annotations

import pytest

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fuse import group_weights
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.core.validate import validate


def test_a_name_is_generated_grouped_lowered_and_validated() -> None:
    built = build_schedule("1f1b", ranks=2, microbatches=4, group_w=2)
    assert built == lower(group_weights(generate("1f1b", 2, 4), 2))
    assert built.is_lowered and not any(a.kind is Kind.B for acts in built.actions for a in acts)
    validate(built)


def test_a_lowered_schedule_runs_as_given_unless_asked_otherwise() -> None:
    ahead = lower(generate("interleaved-1f1b", 2, 4), 1)
    assert build_schedule(ahead) == ahead  # not re-lowered with the default posting
    assert build_schedule(ahead, recv_ahead=None) == ahead
    assert build_schedule(ahead, recv_ahead=2) == lower(ahead, 2)
    one_rank = generate("1f1b", 1, 4)
    assert build_schedule(one_rank) == one_rank  # nothing to send


def test_values_given_with_a_schedule_must_match_it() -> None:
    schedule = generate("zbv", 2, 4)
    assert build_schedule(schedule, ranks=2, microbatches=4, chunks=2).num_ranks == 2
    for key, value in (("ranks", 4), ("microbatches", 8), ("chunks", 1)):
        with pytest.raises(ScheduleError, match=f"{key}={value} but the schedule"):
            build_schedule(schedule, **{key: value})


def test_bad_requests_are_typed_errors() -> None:
    with pytest.raises(ScheduleError, match="needs ranks= and microbatches="):
        build_schedule("1f1b", ranks=2)
    with pytest.raises(ScheduleError, match="group_w must be a whole number >= 1"):
        build_schedule("1f1b", ranks=2, microbatches=4, group_w=0)
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        build_schedule("nope", ranks=2, microbatches=4)
    with pytest.raises(ScheduleError, match="Schedule or a generator name"):
        build_schedule(3, ranks=2, microbatches=4)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="the search groups W itself"):
        build_schedule("auto", ranks=2, microbatches=4, group_w=2)
