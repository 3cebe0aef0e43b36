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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zeropipe.costs import CostModel, initial_memory
from zeropipe.deps import Dependencies
from zeropipe.errors import ScheduleError
from zeropipe.ir import Action, Kind, Schedule
from zeropipe.simulate import simulate

__all__ = [
    "ListPlan",
    "ListScheduler",
    "Policy",
    "Step",
    "compute_order",
    "list_schedule",
    "placement_of",
    "replay",
]

_EPS = 1e-9
Step = tuple[Kind, int, int]  # (kind, stage, microbatch)
_TIMED = (Kind.F, Kind.B, Kind.I, Kind.W)
# Inside a run a kind is its index in _TIMED: Enum members hash in Python code, and the
# loop looks kinds up hundreds of thousands of times per search.
_F, _B, _I, _W = range(4)
_SLOT = {kind: n for n, kind in enumerate(_TIMED)}
_Slot = tuple[int, int, int]  # (index in _TIMED, stage, microbatch)


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
class ListPlan:
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


@dataclass(frozen=True, slots=True)
class _Need:
    """One dependency of an action: its producer's kind (index in _TIMED) and stage."""

    kind: int
    stage: int
    wire: float | None  # None: on the same rank, handed over


class _Facts:
    """What the dependency model and the costs say about each (kind, stage), asked once.

    Dependencies are the same for every microbatch when every backward is split
    (or none is); a replayed schedule may choose per microbatch, and is asked
    per microbatch.
    """

    def __init__(self, costs: CostModel, deps: Dependencies, *, uniform: bool) -> None:
        self.deps, self.costs, self.uniform = deps, costs, uniform
        placement = self.placement = tuple(deps.placement)
        n = len(placement)
        self.backward = _SLOT[deps.backward(0, 0).kind]
        self.duration: list[list[float]] = []
        self.needs: list[list[tuple[_Need, ...]]] = []
        self.wakes: list[list[tuple[int, ...]]] = []  # ranks that receive its output
        self.held = [[costs.stages[s].held_change(k) for s in range(n)] for k in _TIMED]
        for kind in _TIMED:
            duration, needs, wakes = [], [], []
            for s in range(n):
                action = Action(kind, s, 0)
                incoming, outgoing = deps.comm_of(action)
                posts = sum(costs.time(recv) for _, recv in incoming)
                posts += sum(costs.time(send) for send, _ in outgoing)
                duration.append(costs.time(action) + posts)
                wakes.append(tuple(placement[recv.stage] for _, recv in outgoing))
                needs.append(self._ask(action) if uniform else ())
            self.duration.append(duration)
            self.needs.append(needs)
            self.wakes.append(wakes)
        self.wire = [
            costs.boundary_time(s, s + 1) if s + 1 < n and deps.crosses(s, s + 1) else 0.0
            for s in range(n)
        ]
        self.initial = initial_memory(deps.schedule, costs)
        self._per_mb: dict[_Slot, tuple[_Need, ...]] = {}

    def needs_of(self, kind: int, stage: int, mb: int) -> tuple[_Need, ...]:
        if self.uniform:
            return self.needs[kind][stage]
        found = self._per_mb.get((kind, stage, mb))
        if found is None:
            found = self._ask(Action(_TIMED[kind], stage, mb))
            self._per_mb[(kind, stage, mb)] = found
        return found

    def _ask(self, action: Action) -> tuple[_Need, ...]:
        out = []
        for dep in self.deps.requires(action):
            producer = dep.action
            if producer.microbatch != action.microbatch or producer.kind not in _SLOT:
                raise ScheduleError(
                    f"the list scheduler times F, B, I and W of one microbatch at a time; "
                    f"{action} needs {producer}",
                    rule="unsupported",
                )
            wire = self.costs.boundary_time(producer.stage, action.stage) if dep.transfer else None
            out.append(_Need(_SLOT[producer.kind], producer.stage, wire))
        return tuple(out)


def list_schedule(
    costs: CostModel,
    placement: Sequence[int],
    microbatches: int,
    policy: Policy,
    limits: Sequence[float],
    order: Sequence[Sequence[Step]] | None = None,
) -> ListPlan | None:
    """Event-driven list scheduling; ``None`` if it cannot finish within ``limits``.

    Without ``order`` a free rank picks among its ready actions by ``policy``.
    With ``order`` (per rank, F and I of another schedule, from
    :func:`compute_order`) it runs those in that order and only places the W.
    """
    return ListScheduler(costs, placement, microbatches, split=policy.split).run(
        policy, limits, order
    )


class ListScheduler:
    """:func:`list_schedule` for one cost model, placement and backward form, under many
    policies: what the dependency and cost models say is asked once, not once a run."""

    def __init__(
        self, costs: CostModel, placement: Sequence[int], microbatches: int, *, split: bool
    ) -> None:
        self.costs = costs.for_stages(len(placement))
        self.placement = tuple(placement)
        self.microbatches, self.split = microbatches, split
        deps = Dependencies.planned(placement, microbatches, split=split)
        self._facts = _Facts(self.costs, deps, uniform=True)

    def run(
        self,
        policy: Policy,
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None = None,
    ) -> ListPlan | None:
        """One plan under ``policy`` (see :func:`list_schedule`)."""
        if policy.split != self.split:
            raise ScheduleError(
                f"this list scheduler plans {'split' if self.split else 'full'} backwards; "
                f"the policy asks for {'split' if policy.split else 'full'} ones",
                rule="unsupported",
            )
        return self.run_alike([policy], limits, order)[0]

    def run_alike(
        self,
        policies: Sequence[Policy],
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None = None,
        cutoff: float = math.inf,
    ) -> tuple[ListPlan | None, list[int]]:
        """The plan of ``policies[0]``, and the indices of those in ``policies`` with that plan.

        Policies that differ from the first only in ``gap``, ``first`` and
        ``reserve`` mostly take the same decisions: each is followed along the
        same run and dropped at the first decision it would take otherwise, so
        that the ones never dropped share its plan without a run of their own.

        ``cutoff``: give up (``None``) once some rank's end plus its work still to
        do exceeds it: the plan could not end sooner.  ``None`` is shared too,
        for the same reason (a shared run ends where the first one does).
        """
        lead = policies[0]
        if lead.split != self.split:
            raise ScheduleError(
                f"this list scheduler plans {'split' if self.split else 'full'} backwards; "
                f"the policy asks for {'split' if lead.split else 'full'} ones",
                rule="unsupported",
            )
        alike = [
            (k, p)
            for k, p in enumerate(policies)
            if k > 0
            and (p.placement, p.chunks, p.split, p.depth)
            == (lead.placement, lead.chunks, lead.split, lead.depth)
        ]
        run = _Run(self._facts, self.microbatches, lead, limits, order, False, alike, cutoff)
        plan = run.run()
        return plan, [0] + [k for k, _ in run.alike]


def replay(schedule: Schedule, costs: CostModel, limits: Sequence[float]) -> ListPlan | None:
    """``schedule``'s F, B, I and W timed as they stand; ``None`` if it exceeds ``limits``.

    The list scheduler's fast path to the makespan the simulator gives a
    compute-only schedule without recompute or offload (one with overlapped
    pairs is timed by the simulator itself).
    """
    base = schedule.compute_only()
    deps = Dependencies(base)
    pairs = [(s, i) for s in range(base.num_stages) for i in range(base.microbatches)]
    uniform = len({deps.split(s, i) for s, i in pairs}) == 1
    facts = _Facts(costs.for_stages(base.num_stages), deps, uniform=uniform)
    order = compute_order(base, keep_w=True)
    plan = _Run(facts, base.microbatches, Policy(), limits, order, replay=True).run()
    if plan is None or not base.overlaps:
        return plan
    # An overlapped pair starts only when the inputs of both its actions are ready, which
    # this loop does not model: time such a schedule (dualpipev's) as the simulator does.
    timeline = simulate(base, costs.for_stages(base.num_stages))
    starts = [[e.start for e in evs if e.lane == "compute"] for evs in timeline.events]
    return ListPlan(plan.steps, starts, timeline.makespan, timeline.steady_bubble_rate)


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
        alike: Sequence[tuple[int, Policy]] = (),
        cutoff: float = math.inf,
    ) -> None:
        self.facts, self.m, self.policy, self.limits = facts, m, policy, limits
        self.replay = replay
        self.order = None if order is None else [[(_SLOT[k], s, i) for k, s, i in o] for o in order]
        place = facts.placement
        ranks = max(place) + 1
        self.local = [[s for s in range(len(place)) if place[s] == r] for r in range(ranks)]
        self.later = [[u for u in self.local[place[s]] if u > s] for s in range(len(place))]
        self.want = self._reserve(policy.reserve)
        # Policies still taking this run's decisions (see ListScheduler.run_alike), and
        # the room each other ``reserve`` among them keeps.
        self.alike = list(alike)
        self.wants = {
            p.reserve: self._reserve(p.reserve) for _, p in alike if p.reserve != policy.reserve
        }
        self.cutoff = cutoff
        self.end = [[[-1.0] * m for _ in place] for _ in _TIMED]  # -1: not scheduled yet
        self.done_f, self.done_b = [0] * len(place), [0] * len(place)
        self.mem = list(facts.initial)
        self.held_w = [0.0] * ranks  # memory the pending W of each rank still hold
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.pos = [0] * ranks  # next entry of ``order`` per rank
        self.left = self._counts(ranks)
        self.clock = [0.0] * ranks  # when each rank is next free (or last decided)
        self.free = [0.0] * ranks  # when each rank's last action ends
        self.version = [0] * ranks  # a rank's heap entries of older versions are stale
        self.steps: list[list[_Slot]] = [[] for _ in range(ranks)]
        self.starts: list[list[float]] = [[] for _ in range(ranks)]
        self.heap = [(0.0, r, r, 0) for r in range(ranks)]
        self.seq = ranks
        self.bound = math.inf  # while a rank decides: see _choose
        self.work = self._work(ranks)  # per rank, the time its actions still to start take

    def _reserve(self, share: float) -> list[int]:
        """Per stage, how many of its F a shallower F of its rank leaves room for."""
        f, place = self.facts, self.facts.placement
        forward, backward = f.duration[_F], f.duration[f.backward]
        weight = f.duration[_W] if self.policy.split else [0.0] * len(place)
        cycle = [sum(forward[s] + backward[s] + weight[s] for s in lo) for lo in self.local]
        n = len(place)
        trip = [
            sum(forward[u] + backward[u] for u in range(s + 1, n)) + 2 * sum(f.wire[s:])
            for s in range(n)
        ]
        return [1 + math.ceil(share * trip[s] / max(cycle[place[s]], _EPS)) for s in range(n)]

    def _counts(self, ranks: int) -> list[int]:
        """Actions each rank still has to start."""
        if self.order is None:
            per_pair = 3 if self.policy.split else 2  # F, I, W or F, B
            return [len(self.local[r]) * self.m * per_pair for r in range(ranks)]
        if self.replay:
            return [len(o) for o in self.order]
        return [len(o) + sum(1 for k, _, _ in o if k == _I) for o in self.order]  # I brings W

    def _work(self, ranks: int) -> list[float]:
        duration = self.facts.duration
        if self.order is None:
            kinds = [_F, self.facts.backward] + ([_W] if self.policy.split else [])
            per_stage = [sum(duration[k][s] for k in kinds) for s in range(len(duration[0]))]
            return [self.m * sum(per_stage[s] for s in self.local[r]) for r in range(ranks)]
        out = []
        for steps in self.order:
            work = sum(duration[k][s] for k, s, _ in steps)
            if not self.replay:  # each I brings its W
                work += sum(duration[_W][s] for k, s, _ in steps if k == _I)
            out.append(work)
        return out

    def _push(self, t: float, r: int) -> None:
        self.version[r] += 1
        heapq.heappush(self.heap, (t, self.seq, r, self.version[r]))
        self.seq += 1

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> ListPlan | None:
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
                if self._start(r, pick, since) > self.cutoff:
                    return None  # it cannot end by the cutoff
            elif wake < math.inf:
                self._push(wake, r)
            elif not self.heap:
                return None  # every rank waits on another: deadlock under this limit
        return None if any(self.left) else self._plan()

    def _candidates(self, r: int) -> list[_Slot]:
        if self.order is not None:
            at = self.pos[r]
            return [self.order[r][at]] if at < len(self.order[r]) else []
        out: list[_Slot] = []
        for s in self.local[r]:
            if self.done_f[s] < self.m:
                out.append((_F, s, self.done_f[s]))
            if self.done_b[s] < self.done_f[s]:
                out.append((self.facts.backward, s, self.done_b[s]))
        return out

    def _choose(self, r: int, t: float) -> tuple[_Slot | None, float, float] | None:
        """``(pick, when it became ready, when to decide again)``; ``None``: replay does not fit."""
        best: tuple[float, ...] | None = None
        pick: _Slot | None = None
        since = t
        known = math.inf  # earliest known future ready time
        self.bound = math.inf  # earliest possible arrival of a dependency not yet scheduled
        blocked_by_w = False  # an F waits for memory that deferred W hold
        limit = self.limits[r] + _EPS
        kinds_ready = 0  # bit 1: an F is ready, bit 2: a backward
        for step in self._candidates(r):
            if step[0] == _F:
                room = self._room(r, step[1], self.want)
                if self.wants:
                    self._same_room(r, step[1], room, limit)
                if room > limit:
                    if self.replay:
                        return None
                    blocked_by_w = blocked_by_w or room - self.held_w[r] <= limit
                    continue
            ready = self._ready(step, t)
            if ready <= t + _EPS:
                kinds_ready |= 1 if step[0] == _F else 2
                key = self._key(step)
                if best is None or key < best:
                    best, pick, since = key, step, ready
            elif ready < known:
                known = ready
        if kinds_ready == 3 and self.alike:  # which runs first is ``first``'s to say
            self._keep(lambda p: p.first == self.policy.first)
        pending, bound = self.pending[r], self.bound
        if pick is None and pending and not self.replay:
            s, i = pending[0]
            gap = min(known, bound) - t
            w = self.facts.duration[_W][s]
            fill = blocked_by_w or gap >= self.policy.gap * w - _EPS
            if self.alike and not blocked_by_w:
                self._keep(lambda p: (gap >= p.gap * w - _EPS) == fill)
            if fill:
                pending.popleft()
                pick = (_W, s, i)
                since = self._ready(pick, t)
        if pick is not None:
            return pick, since, math.inf
        # Wait: until a known arrival, or (pending W) until the earliest possible one, to
        # decide again; else sleep until a producer on another rank wakes this one.
        if known < math.inf:
            return None, t, known
        return None, t, bound if pending and bound > t + _EPS else math.inf

    def _room(self, r: int, s: int, want: list[int]) -> float:
        """Memory of ``r`` after an F of ``s``, with room kept for its deeper stages' F."""
        held_f, m = self.facts.held[_F], self.m
        room = self.mem[r] + held_f[s]
        if self.order is None:
            for u in self.later[s]:
                done = self.done_f[u]
                if done < m:
                    room += held_f[u] * min(m - done, max(1, want[u] - done + self.done_b[u]))
        return room

    def _same_room(self, r: int, s: int, room: float, limit: float) -> None:
        """Drop the alike policies whose ``reserve`` would decide otherwise about an F of ``s``."""
        if not self.later[s]:
            return  # the deepest local stage keeps no room: every reserve agrees
        held = self.held_w[r]
        for reserve, want in list(self.wants.items()):
            other = self._room(r, s, want)
            if (other > limit) != (room > limit) or (
                room > limit and (other - held <= limit) != (room - held <= limit)
            ):
                self._keep(lambda p, gone=reserve: p.reserve != gone)  # type: ignore[misc]

    def _keep(self, same: Callable[[Policy], bool]) -> None:
        """Keep the alike policies that take this decision as the run's own does."""
        self.alike = [(k, p) for k, p in self.alike if same(p)]
        self.wants = {
            x: w for x, w in self.wants.items() if any(p.reserve == x for _, p in self.alike)
        }

    def _ready(self, step: _Slot, t: float) -> float:
        """When ``step``'s inputs are there (inf: not scheduled yet).  Lowers ``bound`` to
        the earliest a cross-rank producer not yet scheduled could deliver."""
        kind, s, i = step
        f = self.facts
        ready = 0.0
        for need in f.needs[kind][s] if f.uniform else f.needs_of(kind, s, i):
            end = self.end[need.kind][need.stage][i]
            if end >= 0:
                arrives = end if need.wire is None else end + need.wire
                if arrives > ready:
                    ready = arrives
            elif need.wire is None:
                return math.inf  # its producer is still to come on this rank
            else:
                q = f.placement[need.stage]
                soonest = max(self.clock[q], t) + f.duration[need.kind][need.stage] + need.wire
                if soonest < self.bound:
                    self.bound = soonest
                ready = math.inf
        return ready

    def _key(self, step: _Slot) -> tuple[float, ...]:
        """Lower runs first: the policy's order among ready actions."""
        kind, s, i = step
        first_i = self.policy.first == "I"
        if kind == _F:
            return (1.0 if first_i else 0.0, -s if self.policy.depth else i, s)
        if kind == _W:
            return (0.0, 0, 0)  # replay only: its I ran before it, here
        return (0.0 if first_i else 1.0, i, -s)

    def _start(self, r: int, step: _Slot, since: float) -> float:
        """Start ``step`` on ``r``; the soonest ``r`` can then end all its work."""
        kind, s, i = step
        f = self.facts
        # The rank may have waited past the moment this became ready (it hoped for
        # something better); run in order, it starts as soon as it can, as simulated.
        t = max(self.free[r], since)
        end = t + f.duration[kind][s]
        self.work[r] -= f.duration[kind][s]
        self.end[kind][s][i] = end
        self.mem[r] += f.held[kind][s]
        if kind == _F:
            self.done_f[s] += 1
        elif kind != _W:
            self.done_b[s] += 1
        if kind == _W:
            self.held_w[r] += f.held[_W][s]
        elif kind == _I and not self.replay:
            self.pending[r].append((s, i))
            self.held_w[r] -= f.held[_W][s]
        if kind != _W or self.replay:
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
        return end + self.work[r]

    def _plan(self) -> ListPlan:
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
        named = [[(_TIMED[k], s, i) for k, s, i in rank] for rank in self.steps]
        return ListPlan(named, self.starts, makespan, steady)
