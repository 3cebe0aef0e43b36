"""Passes that rewrite schedules.  Each takes a valid schedule and returns one.

``lower`` spells out communication: for every boundary tensor that crosses
ranks (the dependency model's *transfers*) it puts the SEND right after the
producer and posts the RECV one compute action before the consumer, so the
wire time overlaps that action::

    rank a:  F(s-1,i)  SEND_F(s-1,i)  ...
    rank b:  ...  RECV_F(s,i)  X  F(s,i)          X = the previous compute action

Same-rank hand-offs (V placement) get nothing: the tensor is passed as is.
"""

from __future__ import annotations

from zeropipe.deps import Dependencies
from zeropipe.ir import COMPUTE_KINDS, Action, Kind, Schedule

__all__ = ["lower", "strip_comm"]


def lower(schedule: Schedule) -> Schedule:
    """Insert the SEND/RECV actions of every cross-rank transfer."""
    base = strip_comm(schedule)
    deps = Dependencies(base)
    sends_after: dict[Action, list[Action]] = {}
    recvs_before: dict[Action, list[Action]] = {}
    for direction, src, dst, i in deps.transfers():
        send, recv = deps.comm_pair(direction, src, dst, i)
        producer = Action(Kind.F, src, i) if direction is Kind.F else deps.backward(src, i)
        consumer = Action(Kind.F, dst, i) if direction is Kind.F else deps.backward(dst, i)
        sends_after.setdefault(producer, []).append(send)
        recvs_before.setdefault(consumer, []).append(recv)
    out = []
    for acts in base.actions:
        lowered: list[Action] = []
        last_compute = 0  # index in `lowered` of the previous compute action
        for a in acts:
            recvs = recvs_before.get(a, [])
            if recvs:
                # Post one compute action early so the wire overlaps that action.
                lowered[last_compute:last_compute] = recvs
            if a.kind in COMPUTE_KINDS:
                last_compute = len(lowered)
            lowered.append(a)
            lowered.extend(sends_after.get(a, []))
        out.append(lowered)
    return base.replace_actions(out)


def strip_comm(schedule: Schedule) -> Schedule:
    """The compute-only form: every SEND/RECV removed."""
    return schedule.compute_only()
