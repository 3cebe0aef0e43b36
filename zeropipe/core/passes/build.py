"""From a name or a schedule to the exact schedule a pipeline runs; no torch, no modules.

    name ──generate──► compute schedule ──group W──► ──lower──► [──add REDUCE_GRAD──►] ──validate──► schedule

:func:`build_schedule` is what :class:`~zeropipe.runtime.pipeline.Pipeline`
calls, and what ``zeropipe train`` and ``zeropipe simulate`` call, so the
schedule printed, simulated and drawn is the one that runs.  A schedule that
already spells out its sends and receives is kept as given (unless W is
regrouped or ``recv_ahead`` asks for another posting), so a hand-written or
hand-lowered schedule runs exactly as written.
"""

from __future__ import annotations

from numbers import Integral

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.passes.fuse import group_weights
from zeropipe.core.passes.lower import lower
from zeropipe.core.passes.reduce import add_reductions
from zeropipe.core.schedules import generate
from zeropipe.core.validate import validate

__all__ = ["build_schedule", "check_count"]


def check_count(name: str, value: object) -> int:
    """``value`` as an int, or a one-line error naming ``name``: it must be a whole number >= 1.

    A float such as 2.5 would otherwise reach ``range()`` deep inside a generator and
    surface as a bare TypeError; numpy's integers are accepted, bools are not.
    """
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise ScheduleError(
            f"{name} must be a whole number >= 1, got {value!r}", rule="unsupported"
        )
    return int(value)


def build_schedule(
    schedule: Schedule | str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    group_w: int = 1,
    recv_ahead: int | None = None,
    reduce_grad: bool = False,
) -> Schedule:
    """The validated schedule to run: generated, W grouped, lowered.

    Args:
        schedule: a generator name (``zeropipe schedules`` lists them) or a
            :class:`~zeropipe.core.ir.Schedule`, compute-only or lowered.
        ranks, microbatches, chunks: for a name (``chunks``: the generator's
            default if not given).  With a Schedule, any that are given must
            match it.
        group_w: split every B into I then W and run each stage's W in runs of
            this many (:func:`zeropipe.core.passes.fuse.group_weights`); 1 keeps the schedule.
        recv_ahead: where each receive is posted (:func:`zeropipe.core.passes.lower.lower`).
        reduce_grad: post each stage's data-parallel gradient all-reduce as a
            REDUCE_GRAD action right after its last B/W
            (:func:`zeropipe.core.passes.reduce.add_reductions`).  A schedule that already
            has REDUCE_GRAD actions keeps them where they are (the validator
            checks there is one per stage, after its backwards).

    Raises:
        ScheduleError: an unknown name, values a generator cannot take, or a
            schedule that breaks a rule (the error shows the rank x step grid).
    """
    group_w = check_count("group_w", group_w)
    ranks, microbatches, chunks = (
        None if value is None else check_count(key, value)
        for key, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks))
    )
    if isinstance(schedule, str):
        if schedule == "auto" and group_w != 1:
            # The search already gathers W where its costs say it pays and the memory
            # limit allows; grouping its result again could break that limit.
            raise ScheduleError(
                f"group_w={group_w} with the 'auto' schedule: the search groups W itself "
                "where that is faster and fits the memory limit; leave group_w at 1",
                rule="unsupported",
            )
        if ranks is None or microbatches is None:
            raise ScheduleError(
                f"building {schedule!r} needs ranks= and microbatches=", rule="unsupported"
            )
        built = generate(schedule, ranks, microbatches, chunks)
    elif isinstance(schedule, Schedule):
        given = {"ranks": ranks, "microbatches": microbatches, "chunks": chunks}
        has = {
            "ranks": schedule.num_ranks,
            "microbatches": schedule.microbatches,
            "chunks": schedule.chunks_per_rank,
        }
        for key, value in given.items():
            if value is not None and value != has[key]:
                raise ScheduleError(
                    f"{key}={value} but the schedule {schedule.name!r} has {has[key]}; "
                    f"drop {key}= (a Schedule fixes it)",
                    rule="unsupported",
                )
        built = schedule
    else:
        raise ScheduleError(
            f"schedule must be a Schedule or a generator name, got {type(schedule).__name__}",
            rule="unsupported",
        )
    built = group_weights(built, group_w)
    if built.num_ranks > 1 and (recv_ahead is not None or not built.is_lowered):
        built = lower(built, recv_ahead)
    if reduce_grad and not any(a.kind is Kind.REDUCE_GRAD for acts in built.actions for a in acts):
        built = add_reductions(built)
    validate(built)
    return built
