"""The list scheduler behind ``auto``: one candidate schedule from a placement and a policy.

Each rank, whenever it is free, starts the most urgent ready action under a
:class:`Policy` (warm-up forwards while memory allows, input gradients as
soon as their gradient arrives, weight gradients into gaps).  The search in
:mod:`zeropipe.schedules.auto` runs it for many placements and policies and
keeps the best.

It states no rule of its own about actions; it asks where the simulator asks:

    what an action waits for        Dependencies.requires        (zeropipe.deps)
    which transfers it sends/recvs  Dependencies.comm_of         (zeropipe.deps)
    how long it and each post take  CostModel.time               (zeropipe.costs)
    the wire between two stages     CostModel.boundary_time      (zeropipe.costs)
    what it holds or frees          StageCost.held_change        (zeropipe.costs)

so a plan's times equal :func:`zeropipe.simulate.simulate`'s for the same
schedule (a test checks every action's start).  One exception: with a
``post`` cost the simulator runs the lowered schedule, whose receives a rank
posts all at once ahead of its first consumer; here each post is charged to
its own compute action, an estimate -- the search simulates the candidates
it keeps.  What is the list scheduler's own is the *choice*: the policy's
priorities, the memory it reserves for deeper stages, when a W fills a gap.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zeropipe.costs import CostModel, initial_memory
from zeropipe.deps import Dependencies
from zeropipe.errors import ScheduleError
from zeropipe.ir import Action, Kind, Schedule

__all__ = ["Plan", "Policy", "Step", "compute_order", "list_schedule", "placement_of"]

EPS = 1e-9
Step = tuple[Kind, int, int]  # (kind, stage, microbatch)
_TIMED = (Kind.F, Kind.B, Kind.I, Kind.W)


@dataclass(frozen=True)
class Policy:
    """One point of the search: where stages go and how a free rank picks its next action.

    ``gap``: a pending W runs in an idle gap only if the gap is at least
    ``gap`` x W's time (0: whenever the rank would idle).  ``first``: which of
    a ready I and a ready F runs first.  ``depth``: among ready F, the later
    stage first (push microbatches towards the loss) rather than the oldest.
    ``split``: I + W, or one full backward B.  ``reserve``: how many F of the
    rank's deeper stages a shallow F leaves memory for, as a multiple of their
    round trip over the rank's cycle (one at least).
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


@dataclass
class Plan:
    """A list-scheduled (or replayed) schedule: per rank, its steps and their start times."""

    steps: list[list[Step]]  # per rank, in start order
    starts: list[list[float]]
    makespan: float
    steady: float  # Timeline.steady_bubble_rate of the same timing

    def schedule(self, placement: Sequence[int], microbatches: int, name: str = "auto") -> Schedule:
        return Schedule(
            placement, [[Action(*s) for s in rank] for rank in self.steps], microbatches, name
        )


def placement_of(kind: str, ranks: int, chunks: int) -> tuple[int, ...]:
    """``looped``: stage s on rank s % p.  ``v``: down the ranks, back up, down, ..."""
    if kind not in ("looped", "v") or ranks < 1 or chunks < 1:
        raise ScheduleError(
            f"placement must be 'looped' or 'v' with ranks, chunks >= 1; got {kind!r}, "
            f"{ranks}, {chunks}",
            rule="unsupported",
        )
    out: list[int] = []
    for c in range(chunks):
        order = range(ranks) if kind == "looped" or c % 2 == 0 else reversed(range(ranks))
        out.extend(order)
    return tuple(out)


def compute_order(schedule: Schedule, keep_w: bool, split: bool = True) -> list[list[Step]]:
    """Per rank, a schedule's compute actions in order.

    ``keep_w``: every F, B, I and W as they are (to replay the schedule).
    Otherwise only F and the backwards, a B read as I when ``split`` (and an I
    as B when not): the W are left for the list scheduler to place.
    """
    out = []
    for acts in schedule.actions:
        steps: list[Step] = []
        for a in acts:
            if a.microbatch is None or a.kind not in _TIMED:
                continue
            if keep_w or a.kind is Kind.F:
                steps.append((a.kind, a.stage, a.microbatch))
            elif a.kind is not Kind.W:
                steps.append((Kind.I if split else Kind.B, a.stage, a.microbatch))
        out.append(steps)
    return out


@dataclass(frozen=True)
class _Need:
    """One dependency of a (kind, stage), the same for every microbatch."""

    kind: Kind
    stage: int
    wire: float | None  # None: on the same rank, handed over


class _Facts:
    """What the dependency model and the costs say about each (kind, stage), asked once."""

    def __init__(self, costs: CostModel, deps: Dependencies, *, per_microbatch: bool) -> None:
        """``per_microbatch``: the schedule's choices (B, or I + W) differ by microbatch, so
        its dependencies are asked for each one; otherwise once per (kind, stage)."""
        self.deps, self.costs = deps, costs
        placement = self.placement = tuple(deps.placement)
        n = len(placement)
        self._per_mb: dict[Step, tuple[_Need, ...]] | None = {} if per_microbatch else None
        self.backward = deps.backward(0, 0).kind
        self.duration: dict[Kind, list[float]] = {}
        self.needs: dict[Kind, list[tuple[_Need, ...]]] = {}
        self.wakes: dict[Kind, list[tuple[int, ...]]] = {}  # ranks that receive its output
        self.held = {k: [costs.stages[s].held_change(k) for s in range(n)] for k in _TIMED}
        for kind in _TIMED:
            self.duration[kind], self.needs[kind], self.wakes[kind] = [], [], []
            for s in range(n):
                action = Action(kind, s, 0)
                incoming, outgoing = deps.comm_of(action)
                posts = sum(costs.time(recv) for _, recv in incoming)
                posts += sum(costs.time(send) for send, _ in outgoing)
                self.duration[kind].append(costs.time(action) + posts)
                self.wakes[kind].append(tuple(placement[r.stage] for _, r in outgoing))
                self.needs[kind].append(self._needs(deps, costs, action))
        self.wire = [
            costs.boundary_time(s, s + 1) if s + 1 < n and deps.crosses(s, s + 1) else 0.0
            for s in range(n)
        ]
        self.initial = initial_memory(deps.schedule, costs)

    def needs_of(self, kind: Kind, stage: int, mb: int) -> tuple[_Need, ...]:
        if self._per_mb is None:
            return self.needs[kind][stage]
        found = self._per_mb.get((kind, stage, mb))
        if found is None:
            found = self._per_mb[(kind, stage, mb)] = self._needs(
                self.deps, self.costs, Action(kind, stage, mb)
            )
        return found

    @staticmethod
    def _needs(deps: Dependencies, costs: CostModel, action: Action) -> tuple[_Need, ...]:
        out = []
        for dep in deps.requires(action):
            if dep.action.microbatch != action.microbatch:
                raise ScheduleError(f"{action} depends on another microbatch's {dep.action}")
            wire = costs.boundary_time(dep.action.stage, action.stage) if dep.transfer else None
            out.append(_Need(dep.action.kind, dep.action.stage, wire))
        return tuple(out)


def list_schedule(
    costs: CostModel,
    placement: Sequence[int],
    microbatches: int,
    policy: Policy,
    limits: Sequence[float],
    order: Sequence[Sequence[Step]] | None = None,
    replay: bool = False,
) -> Plan | None:
    """Event-driven list scheduling; ``None`` if it cannot finish within ``limits``.

    Without ``order`` a free rank picks among its ready actions by ``policy``.
    With ``order`` (per rank, F and backwards of another schedule) it runs
    those in that order and only places the W; with ``replay`` as well the
    order holds every action and is timed as it stands (the simulator's rules).
    """
    if replay:
        if order is None:
            raise ScheduleError("replay needs the order to replay", rule="unsupported")
        # Its own choices (split or not) per microbatch: the rules of the schedule itself.
        acts = [[Action(*step) for step in rank] for rank in order]
        deps = Dependencies(Schedule(placement, acts, microbatches))
    else:
        deps = Dependencies.planned(placement, microbatches, split=policy.split)
    facts = _Facts(costs.for_stages(len(placement)), deps, per_microbatch=replay)
    return _Run(facts, microbatches, policy, limits, order, replay).run()


class _Run:
    """The state of one list-scheduling run: per rank its clock, memory and pending W."""

    def __init__(
        self,
        facts: _Facts,
        m: int,
        policy: Policy,
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None,
        replay: bool,
    ) -> None:
        self.facts, self.m, self.policy, self.limits = facts, m, policy, limits
        self.order, self.replay = order, replay
        place = facts.placement
        ranks = max(place) + 1
        self.local = [[s for s in range(len(place)) if place[s] == r] for r in range(ranks)]
        self.later = [[u for u in self.local[place[s]] if u > s] for s in range(len(place))]
        self.want = self._reserve()
        self.end: dict[Kind, list[list[float]]] = {
            k: [[-1.0] * m for _ in place] for k in _TIMED
        }  # -1: not scheduled yet
        self.done_f, self.done_b = [0] * len(place), [0] * len(place)
        self.mem = list(facts.initial)
        self.held_w = [0.0] * ranks  # memory the pending W of each rank still hold
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.pos = [0] * ranks  # next entry of ``order`` per rank
        self.left = self._counts(ranks)
        self.clock = [0.0] * ranks  # when each rank is next free (or last decided)
        self.free = [0.0] * ranks  # when each rank's last action ends
        self.version = [0] * ranks  # a rank's heap entries of older versions are stale
        self.steps: list[list[Step]] = [[] for _ in range(ranks)]
        self.starts: list[list[float]] = [[] for _ in range(ranks)]
        self.heap = [(0.0, r, r, 0) for r in range(ranks)]
        self.seq = ranks

    def _reserve(self) -> list[int]:
        """Per stage, how many of its F a shallower F of its rank leaves room for."""
        f, place = self.facts, self.facts.placement
        forward, backward = f.duration[Kind.F], f.duration[f.backward]
        weight = f.duration[Kind.W] if self.policy.split else [0.0] * len(place)
        cycle = [sum(forward[s] + backward[s] + weight[s] for s in lo) for lo in self.local]
        n = len(place)
        trip = [
            sum(forward[u] + backward[u] for u in range(s + 1, n)) + 2 * sum(f.wire[s:])
            for s in range(n)
        ]
        share = self.policy.reserve
        return [1 + math.ceil(share * trip[s] / max(cycle[place[s]], EPS)) for s in range(n)]

    def _counts(self, ranks: int) -> list[int]:
        """Actions each rank still has to start."""
        if self.order is None:
            per_pair = 3 if self.policy.split else 2  # F, I, W or F, B
            return [len(self.local[r]) * self.m * per_pair for r in range(ranks)]
        if self.replay:
            return [len(o) for o in self.order]
        return [len(o) + sum(1 for k, _, _ in o if k is Kind.I) for o in self.order]  # I brings W

    def _push(self, t: float, r: int) -> None:
        self.version[r] += 1
        heapq.heappush(self.heap, (t, self.seq, r, self.version[r]))
        self.seq += 1

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> Plan | None:
        while self.heap:
            t, _, r, ver = heapq.heappop(self.heap)
            if ver != self.version[r]:
                continue
            self.clock[r] = t
            choice = self._choose(r, t)
            if choice is None:
                return None  # the replayed schedule does not fit its limit
            pick, since, wake = choice
            if pick is not None:
                self._start(r, pick, since)
            elif wake < math.inf:
                self._push(wake, r)
            elif not self.heap:
                return None  # every rank waits on another: deadlock under this limit
        return None if any(self.left) else self._plan()

    def _candidates(self, r: int) -> list[Step]:
        if self.order is not None:
            at = self.pos[r]
            return [self.order[r][at]] if at < len(self.order[r]) else []
        out: list[Step] = []
        for s in self.local[r]:
            if self.done_f[s] < self.m:
                out.append((Kind.F, s, self.done_f[s]))
            if self.done_b[s] < self.done_f[s]:
                out.append((self.facts.backward, s, self.done_b[s]))
        return out

    def _choose(self, r: int, t: float) -> tuple[Step | None, float, float] | None:
        """``(pick, when it became ready, when to decide again)``; ``None``: replay does not fit."""
        best: tuple[float, ...] | None = None
        pick: Step | None = None
        since = t
        known = math.inf  # earliest known future ready time
        bound = math.inf  # earliest possible arrival of a dependency not yet scheduled
        blocked_by_w = False  # an F waits for memory that deferred W hold
        limit = self.limits[r] + EPS
        for step in self._candidates(r):
            if step[0] is Kind.F:
                room = self._room(r, step[1])
                if room > limit:
                    if self.replay:
                        return None
                    blocked_by_w = blocked_by_w or room - self.held_w[r] <= limit
                    continue
            ready, bound = self._ready(step, t, bound)
            if ready <= t + EPS:
                key = self._key(step)
                if best is None or key < best:
                    best, pick, since = key, step, ready
            elif ready < known:
                known = ready
        pending = self.pending[r]
        if pick is None and pending and not self.replay:
            s, i = pending[0]
            gap = min(known, bound) - t
            if blocked_by_w or gap >= self.policy.gap * self.facts.duration[Kind.W][s] - EPS:
                pending.popleft()
                pick = (Kind.W, s, i)
                since, _ = self._ready(pick, t, bound)
        if pick is not None:
            return pick, since, math.inf
        # Wait: until a known arrival, or (pending W) until the earliest possible one, to
        # decide again; else sleep until a producer on another rank wakes this one.
        if known < math.inf:
            return None, t, known
        return None, t, bound if pending and bound > t + EPS else math.inf

    def _room(self, r: int, s: int) -> float:
        """Memory of ``r`` after an F of ``s``, with room kept for its deeper stages' F."""
        held_f, m = self.facts.held[Kind.F], self.m
        room = self.mem[r] + held_f[s]
        if self.order is None:
            for u in self.later[s]:
                done = self.done_f[u]
                if done < m:
                    room += held_f[u] * min(m - done, max(1, self.want[u] - done + self.done_b[u]))
        return room

    def _ready(self, step: Step, t: float, bound: float) -> tuple[float, float]:
        """When ``step``'s inputs are there (inf: not scheduled yet), and ``bound`` lowered
        to the earliest a cross-rank producer not yet scheduled could deliver."""
        kind, s, i = step
        f = self.facts
        ready = 0.0
        for need in f.needs_of(kind, s, i):
            end = self.end[need.kind][need.stage][i]
            if end >= 0:
                ready = max(ready, end if need.wire is None else end + need.wire)
            elif need.wire is None:
                return math.inf, bound  # its producer is still to come on this rank
            else:
                q = f.placement[need.stage]
                soonest = max(self.clock[q], t) + f.duration[need.kind][need.stage] + need.wire
                bound, ready = min(bound, soonest), math.inf
        return ready, bound

    def _key(self, step: Step) -> tuple[float, ...]:
        """Lower runs first: the policy's order among ready actions."""
        kind, s, i = step
        first_i = self.policy.first == "I"
        if kind is Kind.F:
            return (1.0 if first_i else 0.0, -s if self.policy.depth else i, s)
        if kind is Kind.W:
            return (0.0, 0, 0)  # replay only: its I ran before it, here
        return (0.0 if first_i else 1.0, i, -s)

    def _start(self, r: int, step: Step, since: float) -> None:
        kind, s, i = step
        f = self.facts
        # The rank may have waited past the moment this became ready (it hoped for
        # something better); run in order, it starts as soon as it can, as simulated.
        t = max(self.free[r], since)
        end = t + f.duration[kind][s]
        self.end[kind][s][i] = end
        self.mem[r] += f.held[kind][s]
        if kind is Kind.F:
            self.done_f[s] += 1
        elif kind is not Kind.W:
            self.done_b[s] += 1
        if kind is Kind.W:
            self.held_w[r] += f.held[Kind.W][s]
        elif kind is Kind.I and not self.replay:
            self.pending[r].append((s, i))
            self.held_w[r] -= f.held[Kind.W][s]
        if kind is not Kind.W or self.replay:
            self.pos[r] += 1
        self.steps[r].append(step)
        self.starts[r].append(t)
        self.left[r] -= 1
        self.clock[r] = self.free[r] = end
        if self.left[r]:
            self._push(end, r)
        else:
            self.version[r] += 1  # done: nothing of it in the heap is current
        for q in f.wakes[kind][s]:
            if self.left[q] and self.clock[q] <= end:
                # It may be waiting for this: let it decide again now, knowing when it lands.
                self._push(max(t, self.clock[q]), q)

    def _plan(self) -> Plan:
        duration = self.facts.duration
        spans = []
        for steps, starts in zip(self.steps, self.starts, strict=True):
            busy = sum(duration[k][s] for k, s, _ in steps)
            k, s, _ = steps[-1]
            end = starts[-1] + duration[k][s]
            spans.append((end - starts[0], busy, end))
        makespan = max(end for _, _, end in spans)
        span, busy, _ = max(spans)  # the longest span (the busiest among equal ones)
        steady = (span - busy) / span if span > 0 else 0.0
        return Plan(self.steps, self.starts, makespan, steady)
