"""W fusion: move weight-gradient actions of a stage next to each other so the runtime fuses them.

W of one microbatch is ``grad += grad_output^T @ input`` for every weight.
With small microbatches (a few rows against a large weight) its cost is
reading and writing the weight-sized gradient, not the product.  When a rank
runs two W of the same stage back to back, the runtime does them as one
product over the rows of both (:func:`~zeropipe.autograd.split_backward.weight_backward_together`):
the gradient is read and written once.  The named schedules put two W of a
stage side by side only in their cooldown, so :func:`group_weights` moves them
there::

    before   I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3        (one rank, one stage)
    after    I0 F1 I1 W0 W1 F2 I2 F3 I3 W2 W3        size=2: W0 waits for W1

A full backward B is an I and its W in one action, so schedules without W
(gpipe, 1f1b, interleaved-1f1b) gain the same way once each B is split in
place into I then W (:func:`split_full_backward`, which ``group_weights``
applies first)::

    before   F0 B0 F1 B1                      after   F0 I0 F1 I1 W0 W1

Only W move, and only later: nothing in a step depends on W, so every other
action runs no later than before, and the rank's work shrinks by what fusion
saves.  The price is memory: a moved W keeps its microbatch's W-part (the
linears' inputs and output gradients) alive until its group runs, at most
``size - 1`` extra microbatches' W-parts per stage.  Simulate with a cost
model whose stages' ``W_fused`` says what a fused W costs to compare.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import COMPUTE_KINDS, Action, Kind, Schedule
from zeropipe.core.passes.lower import lower

__all__ = ["fused_weights", "group_weights", "split_full_backward"]


def group_weights(schedule: Schedule, size: int = 2) -> Schedule:
    """``schedule`` with each rank's W of a stage gathered in runs of ``size`` (in order).

    Every B is first split into I then W (:func:`split_full_backward`).  Each
    group of ``size`` consecutive W of a stage (in the rank's order) is then
    moved to where its last member was.  A lowered schedule is stripped of its
    sends and receives and lowered again.  ``size=1`` returns it unchanged.
    """
    if size < 1:
        raise ScheduleError(f"group_weights: size must be >= 1, got {size}")
    if size == 1:
        return schedule
    lowered = schedule.is_lowered
    compute = split_full_backward(schedule.compute_only() if lowered else schedule)
    grouped = compute.replace_actions(
        [_group_rank(actions, size) for actions in compute.actions],
        name=f"{schedule.name}+w{size}",
    )
    return lower(grouped) if lowered else grouped


def split_full_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every B replaced, where it stands, by I then W of the same
    stage and microbatch.

    The runtime runs B as I then W already, so this alone changes no work and
    no order; it lets later passes move the W.  An overlapped (F, B) pair
    becomes the pair (F, I), its W right after it.  A schedule without B is returned
    unchanged; a lowered one is stripped of its sends and receives and lowered
    again, so that each SEND_B follows its I.
    """
    if not any(a.kind is Kind.B for actions in schedule.actions for a in actions):
        return schedule
    if schedule.is_lowered:  # SEND_B would follow W; lower again to follow I
        return lower(split_full_backward(schedule.compute_only()))
    return schedule.replace_actions(
        [
            [
                part
                for a in actions
                for part in (
                    (Action(Kind.I, a.stage, a.microbatch), Action(Kind.W, a.stage, a.microbatch))
                    if a.kind is Kind.B
                    else (a,)
                )
            ]
            for actions in schedule.actions
        ],
        # An overlapped (F, B) pair becomes (F, I): I is what stays next to the forward.
        overlaps=[
            (f, Action(Kind.I, b.stage, b.microbatch) if b.kind is Kind.B else b)
            for f, b in schedule.overlaps
        ],
    )


def _group_rank(actions: Sequence[Action], size: int) -> list[Action]:
    by_stage: dict[int, list[Action]] = {}
    for a in actions:
        if a.kind is Kind.W:
            by_stage.setdefault(a.stage, []).append(a)
    # Each W waits for the last of its group; the group runs there, in the original order.
    at_last: dict[Action, list[Action]] = {}
    for ws in by_stage.values():
        for k in range(0, len(ws), size):
            group = ws[k : k + size]
            at_last[group[-1]] = group
    out: list[Action] = []
    for a in actions:
        if a.kind is not Kind.W:
            out.append(a)
        elif a in at_last:
            out.extend(at_last[a])
    return out


def fused_weights(schedule: Schedule) -> frozenset[Action]:
    """The W actions that run together with the next one: its rank's next compute
    action is a W of the same stage.

    Sends and receives between them are posts that do not wait for W, so they
    do not break the pair.  The runtime defers these W into the next one; the
    simulator charges them ``W_fused`` instead of ``W``.
    """
    fused = set()
    for actions in schedule.actions:
        compute = [a for a in actions if a.kind in COMPUTE_KINDS]
        for a, b in itertools.pairwise(compute):
            if a.kind is Kind.W and b.kind is Kind.W and a.stage == b.stage:
                fused.add(a)
    return frozenset(fused)
