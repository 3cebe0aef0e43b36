"""The list scheduler's event loop: the state of one run, the facts it reads, and replay.

:mod:`zeropipe.core.schedules.list_scheduler` is the interface (:class:`ListScheduler`,
``list_schedule``, ``replay``); this module is what runs underneath it, hot enough
(hundreds of thousands of decisions a search) that its inner loops use local names and
small integers for kinds.  :class:`Facts` holds what the dependency and cost models say
about each (kind, stage), asked once; :class:`ListRun` is one run under a
:class:`Policy`; :func:`replayed` times a fixed order without choices.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.memory import initial_memory

__all__ = ["Facts", "ListPlan", "ListRun", "Policy", "Step", "replayed"]

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


@dataclass(frozen=True, slots=True)
class _Need:
    """One dependency of an action: its producer's kind (index in _TIMED) and stage."""

    kind: int
    stage: int
    wire: float | None  # None: on the same rank, handed over


class Facts:
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
        self.sized = self._sized(costs) if costs.microbatch_scale else None
        self._per_mb: dict[_Slot, tuple[_Need, ...]] = {}

    def exact(self, m: int) -> bool:
        """Whether every time of a run is a float sum without rounding: each duration and
        wire a multiple of 2**-20, and all of them together (``m`` times) below 2**32."""
        if self.sized is not None:
            return False  # microbatches of their own sizes: not asked, taken as inexact
        values = [x for per_stage in self.duration for x in per_stage] + self.wire
        values += [n.wire for per_kind in self.needs for per_stage in per_kind for n in per_stage
                   if n.wire is not None]  # fmt: skip
        return all(math.isfinite(x) and (x * 2**20).is_integer() for x in values) and (
            m * sum(abs(x) for x in values) < 2**32
        )

    def _sized(self, costs: CostModel) -> Sized:
        """Each microbatch's duration (posts, which do not scale, as microbatch 0's), memory
        change and needs, per (kind, stage)."""
        sizes = costs.microbatch_scale
        times, held, needs = [], [], []
        for k, kind in enumerate(_TIMED):
            per_mb = [
                [Action(kind, s, i) for i in range(len(sizes))] for s in range(len(self.placement))
            ]
            times.append(
                [
                    [self.duration[k][s] + costs.time(a) - costs.time(acts[0]) for a in acts]
                    for s, acts in enumerate(per_mb)
                ]
            )
            held.append([[h * x for x in sizes] for h in self.held[k]])
            needs.append([[self._ask(a) for a in acts] if self.uniform else [] for acts in per_mb])
        return Sized(times, held, needs)

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
            wire = (
                self.costs.boundary_time(producer.stage, action.stage, action.microbatch)
                if dep.transfer
                else None
            )
            out.append(_Need(_SLOT[producer.kind], producer.stage, wire))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Sized:
    """Microbatches of their own sizes (``CostModel.microbatch_scale``): per (kind, stage,
    microbatch), each one's duration, memory change and dependencies (their wires)."""

    times: list[list[list[float]]]
    held: list[list[list[float]]]
    needs: list[list[list[tuple[_Need, ...]]]]


def replayed(
    facts: Facts, m: int, limits: Sequence[float], order: Sequence[Sequence[Step]]
) -> ListPlan | None:
    """Each rank's ``order`` timed as it stands: every action starts when its rank is free
    and its inputs are there, as :class:`ListRun` (and the simulator) would start it, without
    the choices: no heap, each rank advanced as far as it goes whenever an input lands."""
    slots = [[(_SLOT[k], s, i) for k, s, i in steps] for steps in order]
    held, duration, sized = facts.held, facts.duration, facts.sized
    for r, steps in enumerate(slots):  # an F that does not fit: the same in any timing
        mem, limit = facts.initial[r], limits[r] + _EPS
        for k, s, i in steps:
            change = held[k][s] if sized is None else sized.held[k][s][i]
            if k == _F and mem + change > limit:
                return None
            mem += change
    end = [[[-1.0] * m for _ in facts.placement] for _ in _TIMED]  # -1: not yet
    pos, free = [0] * len(slots), [0.0] * len(slots)
    starts: list[list[float]] = [[] for _ in slots]
    todo, moved = list(range(len(slots))), True
    while moved:  # (wakes say who may move; one more sweep over all ranks makes sure)
        moved = False
        while todo:
            r = todo.pop()
            steps, at, now = slots[r], pos[r], free[r]
            while at < len(steps):
                k, s, i = steps[at]
                ready = 0.0
                needs = facts.needs[k][s] if facts.uniform else facts.needs_of(k, s, i)
                for need in needs if sized is None or not facts.uniform else sized.needs[k][s][i]:
                    e = end[need.kind][need.stage][i]
                    if e < 0:
                        break
                    if need.wire is not None:
                        e = e + need.wire
                    if e > ready:
                        ready = e
                else:
                    start = now if now >= ready else ready
                    now = start + (duration[k][s] if sized is None else sized.times[k][s][i])
                    end[k][s][i] = now
                    starts[r].append(start)
                    at += 1
                    todo.extend(facts.wakes[k][s])
                    continue
                break
            moved = moved or at > pos[r]
            pos[r], free[r] = at, now
        todo = [r for r in range(len(slots)) if pos[r] < len(slots[r])] if moved else []
    if any(pos[r] < len(steps) for r, steps in enumerate(slots)):
        return None  # some rank waits on another for ever
    return _plan_of(facts, slots, starts, [list(steps) for steps in order])


class ListRun:
    """The state of one list-scheduling run: per rank its clock, memory and pending W."""

    def __init__(
        self,
        facts: Facts,
        m: int,
        policy: Policy,
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None,
        alike: Sequence[tuple[int, Policy]] = (),
        cutoff: float = math.inf,
    ) -> None:
        self.facts, self.m, self.policy, self.limits = facts, m, policy, limits
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
        self.other_first = any(p.first != policy.first for _, p in alike)
        self.other_gap = any(p.gap != policy.gap for _, p in alike)
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
        return [len(o) + sum(1 for k, _, _ in o if k == _I) for o in self.order]  # I brings W

    def _work(self, ranks: int) -> list[float]:
        duration, sized = self.facts.duration, self.facts.sized
        if sized is not None:  # each microbatch its own size; an I in an order brings its W
            t, m = sized.times, range(self.m)
            kinds = [_F, self.facts.backward] + ([_W] if self.policy.split else [])
            every = [[(k, s, i) for s in lo for k in kinds for i in m] for lo in self.local]
            return [
                sum(t[k][s][i] + (t[_W][s][i] if k == _I and self.order else 0.0) for k, s, i in o)
                for o in self.order or every
            ]
        if self.order is None:
            kinds = [_F, self.facts.backward] + ([_W] if self.policy.split else [])
            per_stage = [sum(duration[k][s] for k in kinds) for s in range(len(duration[0]))]
            return [self.m * sum(per_stage[s] for s in self.local[r]) for r in range(ranks)]
        out = []
        for steps in self.order:
            work = sum(duration[k][s] for k, s, _ in steps)
            work += sum(duration[_W][s] for k, s, _ in steps if k == _I)  # each I brings its W
            out.append(work)
        return out

    def _push(self, t: float, r: int) -> None:
        self.version[r] += 1
        heapq.heappush(self.heap, (t, self.seq, r, self.version[r]))
        self.seq += 1

    # -- the loop ---------------------------------------------------------------------
    # Hot: run hundreds of thousands of times a search, hence the local names.
    def run(self) -> ListPlan | None:
        heap, version, clock, cutoff = self.heap, self.version, self.clock, self.cutoff
        pop, choose, start = heapq.heappop, self._choose, self._start
        while heap:
            t, _, r, ver = pop(heap)
            if ver != version[r]:
                continue
            clock[r] = t
            pick, since, wake = choose(r, t)
            if pick is not None:
                if start(r, pick, since) > cutoff:
                    return None  # it cannot end by the cutoff
            elif wake < math.inf:
                self._push(wake, r)
            elif not heap:
                return None  # every rank waits on another: deadlock under this limit
        return None if any(self.left) else self._plan()

    def _candidates(self, r: int) -> list[_Slot]:
        if self.order is not None:
            at, order = self.pos[r], self.order[r]
            return [order[at]] if at < len(order) else []
        out: list[_Slot] = []
        done_f, done_b, m, back = self.done_f, self.done_b, self.m, self.facts.backward
        for s in self.local[r]:
            done = done_f[s]
            if done < m:
                out.append((_F, s, done))
            if done_b[s] < done:
                out.append((back, s, done_b[s]))
        return out

    def _choose(self, r: int, t: float) -> tuple[_Slot | None, float, float]:
        """``(pick, when it became ready, when to decide again)``."""
        f, end_of, clock = self.facts, self.end, self.clock
        sized = f.sized
        best: tuple[float, ...] | None = None
        pick: _Slot | None = None
        since = t
        known = math.inf  # earliest known future ready time
        bound = math.inf  # earliest possible arrival of a dependency not yet scheduled
        blocked_by_w = False  # an F waits for memory that deferred W hold
        limit = self.limits[r] + _EPS
        soon = t + _EPS
        kinds_ready = 0  # bit 1: an F is ready, bit 2: a backward
        first_f = 0.0 if self.policy.first == "I" else 1.0  # the F's place among ready ones
        depth = self.policy.depth
        for step in self._candidates(r):
            kind, s, i = step
            if kind == _F:
                room = self._room(r, s, self.want)
                if self.wants:
                    self._same_room(r, s, room, limit)
                if room > limit:
                    blocked_by_w = blocked_by_w or room - self.held_w[r] <= limit
                    continue
            # When its inputs are there (inf: not scheduled yet); ``bound``: the earliest a
            # producer on another rank not scheduled yet could deliver.  Inlined: hottest.
            ready = 0.0
            for need in f.needs[kind][s] if sized is None else sized.needs[kind][s][i]:
                end = end_of[need.kind][need.stage][i]
                wire = need.wire
                if end >= 0:
                    arrives = end if wire is None else end + wire
                    if arrives > ready:
                        ready = arrives
                elif wire is None:
                    ready = math.inf  # its producer is still to come on this rank
                    break
                else:
                    c = clock[f.placement[need.stage]]
                    soonest = (c if c > t else t) + f.duration[need.kind][need.stage] + wire
                    if soonest < bound:
                        bound = soonest
                    ready = math.inf
            if ready <= soon:
                if kind == _F:
                    kinds_ready |= 1
                    key = (1.0 - first_f, -s if depth else i, s)
                else:
                    kinds_ready |= 2
                    key = (first_f, i, -s)
                if best is None or key < best:
                    best, pick, since = key, step, ready
            elif ready < known:
                known = ready
        if kinds_ready == 3 and self.other_first:  # which runs first is ``first``'s to say
            self._keep(lambda p: p.first == self.policy.first)
        if pick is not None:
            return pick, since, math.inf
        return self._idle(r, t, known, bound, blocked_by_w)

    def _idle(
        self, r: int, t: float, known: float, bound: float, blocked_by_w: bool
    ) -> tuple[_Slot | None, float, float]:
        """:meth:`_choose` for a rank with no F or backward ready at ``t``: a pending W if
        the gap until ``known`` (the earliest known arrival) or ``bound`` (the earliest
        possible one) is worth filling, or an F waits for W's memory; else a wait."""
        pending = self.pending[r]
        if pending:
            s, i = pending[0]
            if known == math.inf and not self._others_due():
                # ``bound`` assumes a producer's rank will run, but no other rank is due to
                # decide again: only this rank's actions could wake one, and a W wakes
                # none.  Waiting until ``bound`` would only recompute it, forever (a
                # deadlock under the limit, unnoticed while this rank keeps its heap
                # entry); the idle gap is unbounded: run the W, then the run ends.
                bound = math.inf
            gap = min(known, bound) - t
            w = self.facts.duration[_W][s]
            fill = blocked_by_w or gap >= self.policy.gap * w - _EPS
            if self.other_gap and not blocked_by_w:
                self._keep(lambda p: (gap >= p.gap * w - _EPS) == fill)
            if fill:
                pending.popleft()
                pick = (_W, s, i)
                return pick, self._ready(pick), math.inf
        # Wait: until a known arrival, or (pending W) until the earliest possible one, to
        # decide again; else sleep until a producer on another rank wakes this one.
        if known < math.inf:
            return None, t, known
        return None, t, bound if pending and bound > t + _EPS else math.inf

    def _others_due(self) -> bool:
        """Whether another rank is due to decide again (a current entry in the heap; the
        deciding rank's own was popped)."""
        version = self.version
        return any(ver == version[q] for _, _, q, ver in self.heap)

    def _room(self, r: int, s: int, want: list[int]) -> float:
        """Memory of ``r`` after an F of ``s``, with room kept for its deeper stages' F."""
        held_f, m, sized = self.facts.held[_F], self.m, self.facts.sized
        room = self.mem[r] + (held_f[s] if sized is None else sized.held[_F][s][self.done_f[s]])
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
        kept = [(k, p) for k, p in self.alike if same(p)]
        if len(kept) == len(self.alike):
            return
        self.alike = kept
        self.other_first = any(p.first != self.policy.first for _, p in kept)
        self.other_gap = any(p.gap != self.policy.gap for _, p in kept)
        self.wants = {
            x: w for x, w in self.wants.items() if any(p.reserve == x for _, p in self.alike)
        }

    def _ready(self, step: _Slot) -> float:
        """When ``step``'s inputs are there; for a pending W, whose inputs ran already."""
        kind, s, i = step
        ready = 0.0
        sized = self.facts.sized
        for need in self.facts.needs[kind][s] if sized is None else sized.needs[kind][s][i]:
            end = self.end[need.kind][need.stage][i]
            if end < 0:
                return math.inf  # not scheduled yet (a W's never: its I ran first)
            arrives = end if need.wire is None else end + need.wire
            if arrives > ready:
                ready = arrives
        return ready

    def _start(self, r: int, step: _Slot, since: float) -> float:
        """Start ``step`` on ``r``; the soonest ``r`` can then end all its work."""
        kind, s, i = step
        f = self.facts
        # The rank may have waited past the moment this became ready (it hoped for
        # something better); run in order, it starts as soon as it can, as simulated.
        free = self.free[r]
        t = free if free >= since else since
        sized = f.sized
        took = f.duration[kind][s] if sized is None else sized.times[kind][s][i]
        end = t + took
        self.work[r] -= took
        self.end[kind][s][i] = end
        self.mem[r] += f.held[kind][s] if sized is None else sized.held[kind][s][i]
        if kind == _F:
            self.done_f[s] += 1
            self.pos[r] += 1
        elif kind == _W:
            self.held_w[r] += f.held[_W][s] if sized is None else sized.held[_W][s][i]
        else:
            self.done_b[s] += 1
            self.pos[r] += 1
            if kind == _I:
                self.pending[r].append((s, i))
                self.held_w[r] -= f.held[_W][s] if sized is None else sized.held[_W][s][i]
        self.steps[r].append(step)
        self.starts[r].append(t)
        left = self.left
        left[r] -= 1
        clock = self.clock
        clock[r] = self.free[r] = end
        heap, version = self.heap, self.version
        if left[r]:
            version[r] += 1
            heapq.heappush(heap, (end, self.seq, r, version[r]))
            self.seq += 1
        else:
            version[r] += 1  # done: nothing of it in the heap is current
        for q in f.wakes[kind][s]:
            if left[q] and clock[q] <= end:
                # It may be waiting for this: let it decide again now, knowing when it lands.
                version[q] += 1
                heapq.heappush(heap, (t if t >= clock[q] else clock[q], self.seq, q, version[q]))
                self.seq += 1
        return end + self.work[r]

    def _plan(self) -> ListPlan:
        return _plan_of(self.facts, self.steps, self.starts)


def _plan_of(
    facts: Facts,
    steps_of: list[list[_Slot]],
    starts_of: list[list[float]],
    named: list[list[Step]] | None = None,
) -> ListPlan:
    """The plan of these steps and starts; ``named``: the same steps as :data:`Step`."""
    duration, sized = facts.duration, facts.sized

    def took(k: int, s: int, i: int) -> float:
        return duration[k][s] if sized is None else sized.times[k][s][i]

    spans = []
    for steps, starts in zip(steps_of, starts_of, strict=True):
        busy = sum(took(k, s, i) for k, s, i in steps)
        k, s, i = steps[-1]
        end = starts[-1] + took(k, s, i)
        spans.append((end - starts[0], busy, end))
    makespan = max(end for _, _, end in spans)
    span, busy, _ = max(spans)  # the longest span (the busiest among equal ones)
    steady = (span - busy) / span if span > 0 else 0.0
    if named is None:
        named = [[(_TIMED[k], s, i) for k, s, i in rank] for rank in steps_of]
    return ListPlan(named, starts_of, makespan, steady)
