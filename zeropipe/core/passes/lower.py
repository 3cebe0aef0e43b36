"""Passes that rewrite schedules.  Each takes a valid schedule and returns one.

``lower`` spells out communication: for every boundary tensor that crosses
ranks (the dependency model's *transfers*) it puts the SEND right after the
producer and a RECV ahead of the consumer.  By default a rank posts all of a
step's RECVs at once, right before its first compute action that consumes
received data -- where it waits for its first data anyway::

    rank a:  F(s-1,0)  SEND_F(s-1,0)  F(s-1,1)  SEND_F(s-1,1) ...
    rank b:  RECV_F(s,0)  RECV_F(s,1) ... RECV_B(s,0) ...  F(s,0)  ...

Posting early matters with gloo: a message whose receive is already posted
goes out from the sender's own call, while one that finds no receive waits
for the receiver's notice and is then written by the sender's communication
thread -- a thread that, on a host whose cores are busy computing, waits for
a core (measured on the 2-rank CPU benchmark: interleaved-1f1b 0.185 s ->
0.159 s per step; the communication thread's CPU time halved).  The price is
memory: every receive buffer of the step is allocated when it is posted,
m x (boundary tensors) per received stage instead of a few.  ``ahead=k``
posts each RECV k compute actions before its consumer instead::

    rank b:  ...  RECV_F(s,i)  X  F(s,i)          (k = 1: X = the previous compute action)

Same-rank hand-offs (V placement) get nothing: the tensor is passed as is.
An overlapped pair (``Schedule.overlaps``) is lowered as one action: the
receives either member needs go before the pair, the sends after it.
REDUCE_GRAD actions stay where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import COMPUTE_KINDS, Action, Schedule

__all__ = ["lower", "strip_comm"]


def lower(schedule: Schedule, ahead: int | None = None) -> Schedule:
    """Insert the SEND/RECV actions of every cross-rank transfer.

    ``ahead``: ``None`` posts all of a rank's RECVs before its first consumer of
    received data; ``k >= 1`` posts each RECV ``k`` compute actions before its
    consumer (fewer receive buffers alive at once).
    """
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
        raise ScheduleError(f"ahead must be None or a whole number >= 1, got {ahead!r}")
    base = strip_comm(schedule)
    deps = Dependencies(base)
    sends_after: dict[Action, list[Action]] = {}
    recvs_before: dict[Action, list[Action]] = {}
    for acts in base.actions:
        for a in acts:
            incoming, outgoing = deps.comm_of(a)
            if incoming:
                recvs_before[a] = [recv for _, recv in incoming]
            if outgoing:
                sends_after[a] = [send for send, _ in outgoing]
    out = []
    for rank, acts in enumerate(base.actions):
        lowered: list[Action] = []
        units = _units(acts, base.overlapped(rank))
        if ahead is None:
            step_recvs = [r for unit in units for a in unit for r in recvs_before.get(a, [])]
            for unit in units:
                if step_recvs and any(a in recvs_before for a in unit):
                    lowered.extend(step_recvs)  # before the first consumer
                    step_recvs = []
                lowered.extend(unit)
                lowered.extend(s for a in unit for s in sends_after.get(a, []))
        else:
            computes: list[int] = []  # where in `lowered` the compute units so far start
            for unit in units:
                recvs = [r for a in unit for r in recvs_before.get(a, [])]
                if recvs:
                    if len(computes) >= ahead:
                        at = computes[-ahead]
                    else:  # before the first compute action, after earlier RECVs
                        at = computes[0] if computes else len(lowered)
                    lowered[at:at] = recvs
                    computes = [c + len(recvs) if c >= at else c for c in computes]
                if unit[0].kind in COMPUTE_KINDS:
                    computes.append(len(lowered))
                lowered.extend(unit)
                lowered.extend(s for a in unit for s in sends_after.get(a, []))
        out.append(lowered)
    return base.replace_actions(out)


def _units(acts: Sequence[Action], pair_starts: frozenset[int]) -> list[list[Action]]:
    """``acts`` cut into what runs as one: an overlapped pair, or a single action.

    A pair's receives go before it and its sends after it, so it stays adjacent.
    """
    units: list[list[Action]] = []
    k = 0
    while k < len(acts):
        size = 2 if k in pair_starts else 1
        units.append(list(acts[k : k + size]))
        k += size
    return units


def strip_comm(schedule: Schedule) -> Schedule:
    """The compute-only form: every SEND/RECV removed."""
    return schedule.compute_only()
