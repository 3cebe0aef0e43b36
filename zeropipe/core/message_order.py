"""One order of a lowered schedule's messages that every rank agrees on.

NCCL ignores tags: a communicator runs each process's point-to-point
operations on one stream in issue order, matches a pair's messages in that
order, and a posted receive holds back everything issued after it until its
send arrives.  A protocol that is correct under those rules must have both
ends of every transfer issue it at the same place in one order, and that
order must never make a rank wait for a message whose sender first needs
something this rank has not sent yet.

Both hold when the order is a topological order of the schedule's graph
(program order on each rank plus every data dependency, :class:`~zeropipe.core.deps.Graph`),
read off at the transfers' SEND actions: each rank issues its sends and its
receives in the order their transfers appear there.  Whatever a transfer's
sender needs first comes earlier in that order, so by induction every
transfer completes::

    global order     T0        T1        T2        T3   ...   (one per SEND, topological)
    rank a           send T0             recv T2   send T3
    rank b           recv T0   send T1   send T2   recv T3
    rank c                     recv T1

Among the many topological orders, the one taken follows the simulated step
(ties by rank, then step), so a rank rarely waits behind a message that
the unordered runtime would have let it pass.  Receives are issued as soon
as the order allows them (earlier than the schedule's RECV action, when
that comes late); sends as soon as their data exists.
"""

from __future__ import annotations

import functools
import heapq

from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.simulate import simulate

__all__ = ["message_order", "receiver_of"]


@functools.lru_cache(maxsize=1 << 16)
def receiver_of(send: Action) -> Action:
    """The RECV that receives what ``send`` sends (SEND_F(s,i) -> RECV_F(s+1,i)).

    Cached: the runtime asks it for every send of every step.
    """
    if send.microbatch is None or send.kind not in (Kind.SEND_F, Kind.SEND_B):
        raise ScheduleError(f"{send} is not a SEND of a boundary transfer", rule="comm")
    if send.kind is Kind.SEND_F:
        return Dependencies.comm_pair(Kind.F, send.stage, send.stage + 1, send.microbatch)[1]
    return Dependencies.comm_pair(Kind.B, send.stage, send.stage - 1, send.microbatch)[1]


def message_order(schedule: Schedule, graph: Graph | None = None) -> list[list[Action]]:
    """Per rank, the SEND and RECV actions of ``schedule`` in the order that rank issues them.

    ``schedule`` must be lowered (see :func:`zeropipe.core.passes.lower.lower`); ``graph``
    is its :class:`~zeropipe.core.deps.Graph` if already built.  The i-th message
    rank a sends to rank b is the i-th one b receives from a.
    """
    if not schedule.is_lowered and schedule.num_ranks > 1:
        raise ScheduleError(
            "message_order needs a lowered schedule (with SEND/RECV actions); lower it first",
            rule="comm",
        )
    graph = graph or Graph(schedule)
    starts = [[e.start for e in evs] for evs in simulate(schedule, graph=graph).events]
    acts = schedule.actions
    waiting = [[len(p) for p in rank_preds] for rank_preds in graph.preds]
    succs: list[list[list[tuple[int, int]]]] = [[[] for _ in a] for a in acts]
    for r, rank_preds in enumerate(graph.preds):
        for k, preds in enumerate(rank_preds):
            for pr, pk, _ in preds:
                succs[pr][pk].append((r, k))
    ready = [(starts[r][k], r, k) for r, w in enumerate(waiting) for k, n in enumerate(w) if not n]
    heapq.heapify(ready)
    order: list[list[Action]] = [[] for _ in acts]
    while ready:
        _, r, k = heapq.heappop(ready)
        a = acts[r][k]
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            recv = receiver_of(a)
            order[r].append(a)
            order[schedule.placement[recv.stage]].append(recv)
        for nr, nk in succs[r][k]:
            waiting[nr][nk] -= 1
            if not waiting[nr][nk]:
                heapq.heappush(ready, (starts[nr][nk], nr, nk))
    return order
