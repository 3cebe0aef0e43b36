"""Validator: valid schedules pass; each broken rule raises a ScheduleError naming the culprit."""

from __future__ import annotations

import importlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import valid_schedules
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.passes.reduce import add_reductions
from zeropipe.core.validate import validate

GOOD = """
microbatches: 2
placement: 0 1
rank 0: 0F0 0F1 0B0 0I1 0W1
rank 1: 1F0 1B0 1F1 1I1 1W1
"""


def two_ranks(rank0: str, rank1: str, m: int = 2) -> Schedule:
    return Schedule.from_text(
        f"microbatches: {m}\nplacement: 0 1\nrank 0: {rank0}\nrank 1: {rank1}\n"
    )


def rejects(schedule: Schedule, rule: str, *culprits: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    assert err.value.rule == rule, str(err.value)
    message = str(err.value)
    for c in culprits:
        assert c in err.value.actions or c in message.splitlines()[0], message
        assert f">{c}<" in err.value.grid or c in message.splitlines()[0], message
    assert "rank 0" in err.value.grid and "rank 1" in err.value.grid
    return err.value


def test_good_schedule_passes_and_lowered_too() -> None:
    s = Schedule.from_text(GOOD)
    validate(s)
    validate(lower(s))


@given(valid_schedules())
@settings(max_examples=80, deadline=None)
def test_random_valid_schedules_pass(schedule: Schedule) -> None:
    validate(schedule)
    validate(lower(schedule))


def test_missing_action() -> None:
    err = rejects(two_ranks("0F0 0F1 0B0 0I1", "1F0 1B0 1F1 1I1 1W1"), "missing", "0I1")
    assert "0W1 is missing" in str(err)


def test_missing_backward_entirely() -> None:
    err = rejects(two_ranks("0F0 0F1 0B0", "1F0 1B0 1F1 1B1"), "missing", "0F1")
    assert "stage 0 microbatch 1 has no backward" in str(err)


def test_duplicated_action() -> None:
    err = rejects(two_ranks("0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"), "duplicate", "0B1")
    assert "appears 2 times" in str(err)


def test_w_before_its_i() -> None:
    err = rejects(two_ranks("0F0 0F1 0B0 0W1 0I1", "1F0 1B0 1F1 1B1"), "order", "0W1", "0I1")
    assert "0W1 comes before 0I1" in str(err)


def test_backward_before_its_forward() -> None:
    err = rejects(two_ranks("0F0 0B0 0F1 0B1", "1B0 1F0 1F1 1B1"), "order", "1B0", "1F0")
    assert "1B0 comes before 1F0" in str(err)


def test_action_on_a_rank_that_does_not_own_the_stage() -> None:
    err = rejects(two_ranks("0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"), "placement", "1F0")
    assert "stage 1 is placed on rank 1" in str(err)


def test_two_ranks_each_waiting_to_receive_from_the_other_first() -> None:
    # rank 0 waits for 1's gradient of mb 0 before sending mb 1's activation;
    # rank 1 insists on receiving mb 1's activation before doing mb 0's backward.
    bad = lower(two_ranks("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"))
    err = rejects(bad, "deadlock")
    msg = str(err)
    assert "rank 0 is stuck" in msg and "rank 1 is stuck" in msg
    assert "0B0" in err.actions and "1F1" in err.actions
    assert "1SEND_B0 (rank 1)" in msg and "0SEND_F1 (rank 0)" in msg
    # The compute-only form deadlocks the same way.
    rejects(two_ranks("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"), "deadlock", "0B0", "1F1")


def test_missing_send_in_a_lowered_schedule() -> None:
    s = lower(Schedule.from_text(GOOD))
    cut = s.replace_actions([[a for a in s.actions[0] if str(a) != "0SEND_F1"], s.actions[1]])
    err = rejects(cut, "missing")
    assert "0SEND_F1 is missing" in str(err)


def test_memory_limit() -> None:
    s = Schedule.from_text(GOOD)
    validate(s, memory_limit=2)
    with pytest.raises(ScheduleError) as err:
        validate(s, memory_limit=1.5)
    assert err.value.rule == "memory"
    assert "rank 0 holds 2 microbatch(s) of memory at step 1 (0F1)" in str(err.value)
    assert ">0F1<" in err.value.grid


def test_microbatch_out_of_range() -> None:
    rejects(two_ranks("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"), "range", "0F2")


def test_weight_offload_rules() -> None:
    ok = Schedule.from_text(
        "microbatches: 1\nplacement: 0 0\nrank 0: 0RELOAD 0F0 0OFFLOAD 1RELOAD 1F0 1B0 1OFFLOAD 0RELOAD 0B0 0OFFLOAD\n"
    )
    validate(ok)
    bad = Schedule.from_text("microbatches: 1\nplacement: 0\nrank 0: 0F0 0OFFLOAD 0B0\n")
    with pytest.raises(ScheduleError, match="0B0 runs while stage 0's weights are offloaded"):
        validate(bad)


def _full_checks(schedule: Schedule) -> str | None:
    """The rule the validator's full checks name for ``schedule``, or None if it is valid."""
    v = importlib.import_module("zeropipe.core.validate")  # the package's name is the function
    deps = Dependencies(schedule)
    try:
        v._check_shape(schedule)
        v._check_complete(schedule, deps)
        v._check_reductions(schedule)
        v._check_order(schedule, deps)
        v._check_overlaps(schedule, deps)
        Graph(schedule, deps)
    except ScheduleError as err:
        return err.rule
    return None


@given(valid_schedules(), st.randoms(use_true_random=False), st.booleans(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_the_quick_pass_judges_as_the_full_checks_do(
    schedule: Schedule, rng: random.Random, lowered: bool, reduced: bool
) -> None:
    # validate() takes a quick integer pass over the actions and runs the full checks
    # only when it finds something off; what it says must be what they say.
    if reduced:
        schedule = add_reductions(schedule)
    if lowered:
        schedule = lower(schedule)
    acts = [list(a) for a in schedule.actions]
    r = rng.randrange(len(acts))
    if acts[r]:
        k, j = rng.randrange(len(acts[r])), rng.randrange(len(acts[r]))
        op = rng.choice(["keep", "swap", "drop", "duplicate", "move", "stray"])
        if op == "swap":
            acts[r][k], acts[r][j] = acts[r][j], acts[r][k]
        elif op == "drop":
            del acts[r][k]
        elif op == "duplicate":
            acts[r].insert(j, acts[r][k])
        elif op == "move":
            acts[(r + 1) % len(acts)].append(acts[r].pop(k))
        elif op == "stray":  # an action of a microbatch the schedule does not have
            a = acts[r][k]
            if a.microbatch is not None:
                acts[r].append(Action(a.kind, a.stage, schedule.microbatches))
    mutant = schedule.replace_actions(acts)
    want = _full_checks(mutant)
    try:
        validate(mutant)
        got = None
    except ScheduleError as err:
        got = err.rule
    assert got == want
