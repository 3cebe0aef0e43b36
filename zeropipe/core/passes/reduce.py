"""Data-parallel gradient reduction as schedule actions: :func:`add_reductions`.

With data parallelism every pipeline replica holds the same stages; before the
optimizer step each stage's weight gradients are all-reduced across replicas.
``REDUCE_GRAD(s)`` posts that all-reduce (asynchronously) on the rank that
owns stage ``s``, as soon as the gradients are final, so the reduction of an
early-finishing stage runs while the rank, and the others, still compute::

    rank 0:  ... 0B2 0B3 0REDUCE_GRAD                    (stage 0 done last)
    rank 1:  ... 1B2 1B3 1SEND_B3 1REDUCE_GRAD ...       (reduction overlaps rank 0's B)

It goes right after the stage's last backward (B or W) on its rank, and after
the sends that follow that backward at once: those carry the input gradient
the rank upstream waits for, the reduction is wanted only by the optimizer.
"""

from __future__ import annotations

from zeropipe.core.deps import keep_overlaps
from zeropipe.core.ir import Action, Kind, Schedule

__all__ = ["add_reductions", "strip_reductions"]

_BACKWARD = frozenset({Kind.B, Kind.W})
_SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})


def add_reductions(schedule: Schedule) -> Schedule:
    """``schedule`` with one REDUCE_GRAD per stage right after the stage's last B/W.

    Idempotent: existing REDUCE_GRAD actions are removed and placed again, so
    the result is the same whether or not the input had them.  SEND/RECV and
    every other action keep their order.
    """
    base = strip_reductions(schedule)
    out = []
    for rank, acts in enumerate(base.actions):
        last: dict[int, int] = {}  # stage -> index of its last B/W on this rank
        for k, a in enumerate(acts):
            if a.kind in _BACKWARD:
                last[a.stage] = k
        after: dict[int, list[Action]] = {}
        for stage in base.stages_of(rank):
            if stage not in last:
                continue  # no backward at all: the validator names what is missing
            k = last[stage]
            # Past the sends that follow at once (posts on the critical path), and past
            # the second action of an overlapped pair, which runs as one with the first.
            while k + 1 < len(acts) and (
                acts[k + 1].kind in _SENDS or (acts[k], acts[k + 1]) in base.overlaps
            ):
                k += 1
            after.setdefault(k, []).append(Action(Kind.REDUCE_GRAD, stage))
        lst: list[Action] = []
        for k, a in enumerate(acts):
            lst.append(a)
            lst.extend(after.get(k, ()))
        out.append(lst)
    return keep_overlaps(base.replace_actions(out))


def strip_reductions(schedule: Schedule) -> Schedule:
    """``schedule`` without its REDUCE_GRAD actions."""
    if not any(a.kind is Kind.REDUCE_GRAD for acts in schedule.actions for a in acts):
        return schedule
    return schedule.replace_actions(
        [[a for a in acts if a.kind is not Kind.REDUCE_GRAD] for acts in schedule.actions]
    )
