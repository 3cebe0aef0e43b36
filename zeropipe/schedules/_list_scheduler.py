"""The list scheduler behind ``auto``: one candidate schedule from a placement and a policy.

Each rank, whenever it is free, starts the most urgent ready action under a
:class:`Policy` (warm-up forwards while memory allows, input gradients as
soon as their gradient arrives, weight gradients into gaps).  The event loop
keeps the same timing rules as :func:`zeropipe.simulate.simulate`, so a
candidate's makespan here equals the simulator's (a test checks this); the
search in :mod:`zeropipe.schedules.auto` runs it for many placements and
policies and keeps the best.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zeropipe.costs import CostModel
from zeropipe.ir import Kind, Schedule

__all__ = ["Policy", "Step"]

_EPS = 1e-9


# -- placements -------------------------------------------------------------------------
def _placement(kind: str, ranks: int, chunks: int) -> tuple[int, ...]:
    """``looped``: stage s on rank s % p.  ``v``: down the ranks, back up, down, ..."""
    out: list[int] = []
    for c in range(chunks):
        order = range(ranks) if kind == "looped" or c % 2 == 0 else reversed(range(ranks))
        out.extend(order)
    return tuple(out)


# -- the list scheduler -------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """One point of the search: where stages go and how a free rank picks its next action.

    ``gap``: a pending W runs in an idle gap only if the gap is at least
    ``gap`` x W's time (0: whenever the rank would idle).  ``first``: which of
    a ready I and a ready F runs first.  ``depth``: among ready F, the later
    stage first (push microbatches towards the loss) rather than the oldest.
    ``split``: I + W, or one full backward B.
    """

    placement: str = "looped"  # "looped" | "v"
    chunks: int = 1
    split: bool = True
    gap: float = 0.0
    first: str = "I"  # "I" | "F"
    depth: bool = True
    reserve: float = 0.0

    def describe(self) -> str:
        where = "V" if self.placement == "v" and self.chunks == 2 else self.placement
        if self.placement == "v" and self.chunks > 2:
            where = "zig-zag"
        back = "I/W split, W into gaps" if self.split else "full backward B"
        if self.split and self.gap > 0:
            back += f" >= {self.gap:g} W"
        return f"{where} placement, {self.chunks} chunk(s)/rank, {back}, {self.first} first"


Step = tuple[Kind, int, int]  # (kind, stage, microbatch)


@dataclass
class _Plan:
    steps: list[list[Step]]  # per rank, in start order
    makespan: float
    steady: float  # Timeline.steady_bubble_rate of the same timing


def _order(schedule: Schedule, keep_w: bool, split: bool = True) -> list[list[Step]]:
    """Per rank, a schedule's compute actions in order.

    ``keep_w``: every F, B, I and W as they are (to replay the schedule).
    Otherwise only F and the backwards, a B read as I when ``split`` (and an I
    as B when not): the W are left for the list scheduler to place.
    """
    out = []
    for acts in schedule.actions:
        steps: list[Step] = []
        for a in acts:
            if a.microbatch is None or a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                continue
            if keep_w or a.kind is Kind.F:
                steps.append((a.kind, a.stage, a.microbatch))
            elif a.kind is not Kind.W:
                steps.append((Kind.I if split else Kind.B, a.stage, a.microbatch))
        out.append(steps)
    return out


def _list_schedule(
    costs: CostModel,
    placement: tuple[int, ...],
    m: int,
    policy: Policy,
    limits: Sequence[float],
    order: Sequence[Sequence[Step]] | None = None,
    replay: bool = False,
) -> _Plan | None:
    """Event-driven list scheduling; ``None`` if it cannot finish within ``limits``.

    Without ``order`` a free rank picks among its ready actions by ``policy``.
    With ``order`` (per rank, F and backwards of another schedule) it runs
    those in that order and only places the W; with ``replay`` as well the
    order holds every action and is timed as it stands (the simulator's rules).
    """
    S, P = len(placement), max(placement) + 1
    st = costs.stages
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
    cross = [placement[s] != placement[s + 1] for s in range(S - 1)] + [False]
    # The runtime's own time per action, and the posts of the transfers each one
    # starts or ends (a forward receives its input and sends its output; a backward
    # the other way round), all on the rank's one thread.
    posts = [costs.post * ((s > 0 and cross[s - 1]) + cross[s]) for s in range(S)]
    extra = [costs.overhead + posts[s] for s in range(S)]
    dur = {
        F: [c.F + extra[s] for s, c in enumerate(st)],
        B: [c.time(B) + extra[s] for s, c in enumerate(st)],
        I: [c.I + extra[s] for s, c in enumerate(st)],
        W: [c.W + costs.overhead for c in st],
    }
    act = [c.act for c in st]
    # What each kind gives back: B all, I all but what W still needs, W that part.
    frees = {B: act, I: [c.act - c.act_w for c in st], W: [c.act_w for c in st]}
    tF = dur[F]
    kind_b = I if policy.split else B
    tBk = dur[kind_b]
    wire = [costs.transfer_time(s) if cross[s] else 0.0 for s in range(S)]
    local = [[s for s in range(S) if placement[s] == r] for r in range(P)]
    mem = [sum(st[s].weights for s in local[r]) for r in range(P)]
    if any(mem[r] > limits[r] + _EPS for r in range(P)):
        return None
    # A shallow stage's F keeps room for F of the deeper stages of its rank: at least
    # one (or the V deadlocks), ``reserve`` x (round trip / the rank's cycle) more.
    later = [[u for u in local[placement[s]] if u > s] for s in range(S)]
    cycle = [sum(tF[s] + tBk[s] + (dur[W][s] if policy.split else 0.0) for s in lo) for lo in local]
    trip = [sum(tF[u] + tBk[u] for u in range(s + 1, S)) + 2 * sum(wire[s:]) for s in range(S)]
    want = [
        1 + math.ceil(policy.reserve * trip[s] / max(cycle[placement[s]], _EPS)) for s in range(S)
    ]
    endF: list[list[float]] = [[-1.0] * m for _ in range(S)]
    endB: list[list[float]] = [[-1.0] * m for _ in range(S)]
    nF, nB = [0] * S, [0] * S
    pos = [0] * P  # next entry of ``order`` per rank
    pend: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
    held_w = [0.0] * P  # memory the pending W of each rank still hold
    if order is not None:
        left = [len(o) for o in order]
        if not replay:
            left = [n + sum(1 for k, _, _ in o if k is I) for n, o in zip(left, order, strict=True)]
    else:
        left = [len(local[r]) * m * (3 if policy.split else 2) for r in range(P)]
    clock = [0.0] * P  # when each rank is next free (or last decided, while it waits)
    free = [0.0] * P  # when each rank's last action ends
    version = [0] * P  # a rank's heap entries of older versions are stale
    out: list[list[Step]] = [[] for _ in range(P)]
    starts: list[list[float]] = [[] for _ in range(P)]
    inf = math.inf
    heap = [(0.0, r, r, 0) for r in range(P)]
    seq = P
    first_i = policy.first == "I"

    while heap:
        t, _, r, ver = heapq.heappop(heap)
        if ver != version[r]:
            continue
        clock[r] = t
        cands: list[Step]
        if order is not None:
            cands = [order[r][pos[r]]] if pos[r] < len(order[r]) else []
        else:
            cands = []
            for s in local[r]:
                if nF[s] < m:
                    cands.append((F, s, nF[s]))
                if nB[s] < nF[s]:
                    cands.append((kind_b, s, nB[s]))
        best: tuple[float, ...] | None = None
        pick: Step | None = None
        since = t  # when ``pick`` became ready
        known = inf  # earliest known future ready time
        bound = inf  # earliest possible arrival of a dependency not yet scheduled
        f_blocked_by_w = False
        for kind, s, i in cands:
            if kind is F:
                room = mem[r] + act[s]
                if order is None:
                    for u in later[s]:
                        if nF[u] < m:
                            room += act[u] * min(m - nF[u], max(1, want[u] - nF[u] + nB[u]))
                if room > limits[r] + _EPS:
                    if replay:
                        return None  # the schedule as it stands does not fit
                    # Deferred W hold memory too: running them may make room for this F.
                    f_blocked_by_w = f_blocked_by_w or room - held_w[r] <= limits[r] + _EPS
                    continue
                ready = 0.0
                if s > 0:
                    e = endF[s - 1][i]
                    if e < 0:
                        if cross[s - 1]:
                            q = placement[s - 1]
                            bound = min(bound, max(clock[q], t) + tF[s - 1] + wire[s - 1])
                        ready = inf
                    else:
                        ready = e + wire[s - 1]
                key = (1.0 if first_i else 0.0, -s if policy.depth else i, s)
            elif kind is W:
                ready, key = endB[s][i], (0.0, 0, 0)  # replay only: its I ran before, here
            else:
                ready = endF[s][i]
                if ready < 0:
                    continue  # its F is still to come on this rank
                if s < S - 1:
                    e = endB[s + 1][i]
                    if e < 0:
                        if cross[s]:
                            q = placement[s + 1]
                            bound = min(bound, max(clock[q], t) + tBk[s + 1] + wire[s])
                        ready = inf
                    else:
                        ready = max(ready, e + wire[s])
                key = (0.0 if first_i else 1.0, i, -s)
            if ready <= t + _EPS:
                if best is None or key < best:
                    best, pick, since = key, (kind, s, i), ready
            elif ready < known:
                known = ready
        if pick is None and pend[r] and not replay:
            gap = min(known, bound) - t
            if f_blocked_by_w or gap >= policy.gap * dur[W][pend[r][0][0]] - _EPS:
                s, i = pend[r].popleft()
                pick, since = (W, s, i), endB[s][i]
        if pick is None:
            # Wait: until a known arrival, or (pending W) until the earliest possible one,
            # to decide again; else sleep until a producer on another rank wakes us.
            wake = known if known < inf else bound if pend[r] and bound > t + _EPS else inf
            if wake < inf:
                version[r] += 1
                heapq.heappush(heap, (wake, seq, r, version[r]))
                seq += 1
            elif not heap:
                return None  # every rank waits on another: deadlock under this limit
            continue
        kind, s, i = pick
        d = dur[kind][s]
        # The rank may have waited past the moment this became ready (it hoped for
        # something better); run in order, it starts as soon as it can, as simulated.
        t = max(free[r], since)
        if kind is F:
            endF[s][i] = t + d
            nF[s] += 1
            mem[r] += act[s]
            pos[r] += 1
            consumer = placement[s + 1] if cross[s] else -1
        else:
            mem[r] -= frees[kind][s]
            consumer = -1
            if kind is W:
                held_w[r] -= frees[W][s]
                pos[r] += replay
            else:
                endB[s][i] = t + d
                nB[s] += 1
                pos[r] += 1
                if s > 0 and cross[s - 1]:
                    consumer = placement[s - 1]
                if kind is I and not replay:
                    pend[r].append((s, i))
                    held_w[r] += frees[W][s]
        out[r].append((kind, s, i))
        starts[r].append(t)
        left[r] -= 1
        clock[r] = free[r] = t + d
        version[r] += 1
        if left[r]:
            heapq.heappush(heap, (t + d, seq, r, version[r]))
            seq += 1
        if consumer >= 0 and left[consumer] and clock[consumer] <= t + d:
            # It may be waiting for this: let it decide again now, knowing when it lands.
            version[consumer] += 1
            heapq.heappush(heap, (max(t, clock[consumer]), seq, consumer, version[consumer]))
            seq += 1
    if any(left):
        return None
    spans = []
    for steps, ts in zip(out, starts, strict=True):
        busy = sum(dur[k][s] for k, s, _ in steps)
        k, s, _ = steps[-1]
        spans.append((ts[-1] + dur[k][s] - ts[0], busy, ts[-1] + dur[k][s]))
    makespan = max(end for _, _, end in spans)
    span, busy, _ = max(spans)
    return _Plan(out, makespan, (span - busy) / span if span > 0 else 0.0)
