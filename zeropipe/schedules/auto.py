"""``auto``: search for the schedule with the shortest simulated step under a cost model.

Named schedules assume equal stages and F = I = W; real models do not.  The
search takes the model as it is -- per-stage F, I, W, B, activation memory,
the wire -- and a per-rank memory limit, and times candidates of three kinds
with its own event loop (the simulator's rules, made fast)::

    list-scheduled   placements: looped with 1..v chunks per rank, V / zig-zag with an
                     even number; whenever a rank is free it picks among what is ready:
                       I (or B)  as soon as its gradient is there: critical path, frees memory
                       F         while the memory limit allows, keeping room for the deeper
                                 local stages' F (one at least, or the V starves; more with
                                 ``reserve``: their round trip over the rank's cycle)
                       W         into gaps the rank would otherwise idle through (a gap of
                                 at least ``gap`` x W), or when an F waits for W's memory
    re-timed named   each named schedule's F / I order, with its W placed anew as above
    named            each named schedule as it is, if it fits: auto is never worse

The best few by that timing are then validated (:func:`zeropipe.validate.validate`
with the memory limit) and simulated (:func:`zeropipe.simulate.simulate`): those
two are the ground truth; the winner has the shortest makespan, then the lowest
steady bubble.  Recompute and offload come in through
:func:`zeropipe.fit.fit_memory` applied to the best schedule found without a
limit: when nothing fits without them, or on request (``recompute=True``).

Costs: a :class:`~zeropipe.costs.CostModel` with ``p`` stages is read as "one
rank's worth of layers per stage" and is split evenly for ``v`` chunks per
rank (and one with ``p*v`` stages is merged for fewer chunks); pass a callable
``num_stages -> CostModel | None`` to give each cut its own (e.g. balanced)
costs, as :func:`zeropipe.balance.plan` does.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from zeropipe.costs import CostModel, StageCost, peak_memory, per_rank
from zeropipe.errors import ScheduleError
from zeropipe.ir import Action, Kind, Schedule
from zeropipe.schedules import GENERATORS, register
from zeropipe.simulate import Timeline, simulate
from zeropipe.validate import validate

__all__ = ["GENERATOR", "AutoResult", "Candidate", "Policy", "auto_schedule", "costs_for", "search"]

CostsLike = CostModel | Callable[[int], CostModel | None]
_EPS = 1e-9


# -- costs for a given number of stages -------------------------------------------------
def costs_for(costs: CostsLike, num_stages: int) -> CostModel | None:
    """``costs`` for a model cut into ``num_stages`` stages, or ``None`` if they do not say.

    A callable is asked (and may answer ``None``: no such cut).
    A model with ``n`` stages is split evenly (each stage into ``num_stages/n``
    equal parts: times and memory divided, boundary size kept) or merged
    (consecutive groups summed) when one count divides the other.
    """
    if not isinstance(costs, CostModel):
        made = costs(num_stages)
        return None if made is None else made.for_stages(num_stages)
    n = len(costs.stages)
    if n == num_stages:
        return costs
    if num_stages % n == 0:
        k = num_stages // n
        stages = tuple(_scaled(s, 1.0 / k) for s in costs.stages for _ in range(k))
        how = f"each of {n} stage(s) split into {k}"
    elif n % num_stages == 0:
        k = n // num_stages
        stages = tuple(_merged(costs.stages[g * k : (g + 1) * k]) for g in range(num_stages))
        how = f"{n} stages merged in groups of {k}"
    else:
        return None
    return replace(costs, stages=stages, meta={**costs.meta, "derived": how})


def _scaled(c: StageCost, f: float) -> StageCost:
    return StageCost(
        F=c.F * f,
        I=c.I * f,
        W=c.W * f,
        B=None if c.B is None else c.B * f,
        R=None if c.R is None else c.R * f,
        OFFLOAD=c.OFFLOAD * f,
        RELOAD=c.RELOAD * f,
        weight_copy=c.weight_copy * f,
        act=c.act * f,
        act_w=c.act_w * f,
        ckpt=c.ckpt * f,
        weights=c.weights * f,
        boundary_bytes=c.boundary_bytes,
    )


def _merged(group: Sequence[StageCost]) -> StageCost:
    def total(name: str) -> float:
        return float(sum(getattr(c, name) for c in group))

    return StageCost(
        F=total("F"),
        I=total("I"),
        W=total("W"),
        B=sum(c.time(Kind.B) for c in group),
        R=sum(c.time(Kind.R) for c in group),
        OFFLOAD=total("OFFLOAD"),
        RELOAD=total("RELOAD"),
        weight_copy=total("weight_copy"),
        act=total("act"),
        act_w=total("act_w"),
        ckpt=total("ckpt"),
        weights=total("weights"),
        boundary_bytes=group[-1].boundary_bytes,
    )


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
    dur = {
        F: [c.F for c in st],
        B: [c.time(B) for c in st],
        I: [c.I for c in st],
        W: [c.W for c in st],
    }
    act = [c.act for c in st]
    # What each kind gives back: B all, I all but what W still needs, W that part.
    frees = {B: act, I: [c.act - c.act_w for c in st], W: [c.act_w for c in st]}
    tF = dur[F]
    kind_b = I if policy.split else B
    tBk = dur[kind_b]
    cross = [placement[s] != placement[s + 1] for s in range(S - 1)] + [False]
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


# -- the search -----------------------------------------------------------------------------
@dataclass
class Candidate:
    """One schedule the search timed: ``source`` is ``"list"`` (list-scheduled) or ``"named"``.

    ``makespan`` and ``steady`` (steady bubble rate) come from the search's own
    event loop until the candidate is verified, then from the simulator, whose
    ``timeline`` is kept.
    """

    name: str
    source: str
    costs: CostModel
    makespan: float
    steady: float
    timeline: Timeline | None = None
    _shape: Schedule | None = field(default=None, repr=False)  # placement, microbatches
    _steps: list[list[Step]] | None = field(default=None, repr=False)

    @property
    def schedule(self) -> Schedule:
        """Built on first use: most candidates are only ever compared by their times."""
        assert self._shape is not None  # always set by search()
        if self._steps is not None:
            acts = [[Action(*step) for step in rank] for rank in self._steps]
            self._shape = Schedule(self._shape.placement, acts, self._shape.microbatches, "auto")
            self._steps = None
        return self._shape


@dataclass
class AutoResult:
    """What :func:`search` chose, with the cost model of its stages, and why."""

    schedule: Schedule
    costs: CostModel
    timeline: Timeline
    explanation: str
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0


def _policies(ranks: int, max_chunks: int, split_options: Sequence[bool]) -> list[Policy]:
    """The default grid of list-scheduler points, most promising first."""
    shapes = [("v", v) for v in range(2, max_chunks + 1, 2)]
    shapes += [("looped", v) for v in range(1, max_chunks + 1)]
    out = []
    for kind, v in shapes:
        if ranks == 1 and (kind == "v" or v > 1):
            continue
        for split in split_options:
            for reserve in (2.0, 1.0, 0.0) if kind == "v" or v > 1 else (0.0,):
                for gap in (0.0, 0.5, 1.0) if split else (0.0,):
                    for first in ("I", "F"):
                        out.append(Policy(kind, v, split, gap, first, True, reserve))
    return out


Limit = float | Sequence[float] | str | None


def _limits(memory_limit: Limit, ranks: int, m: int, costs: CostsLike) -> list[float]:
    if memory_limit is None:
        return [math.inf] * ranks
    if isinstance(memory_limit, str):
        return [_reference_peak(memory_limit, ranks, m, costs)] * ranks
    return per_rank(memory_limit, ranks)


def _reference_peak(name: str, ranks: int, m: int, costs: CostsLike) -> float:
    """The highest per-rank peak of the named schedule ``name`` under ``costs``."""
    gen = GENERATORS.get(name)
    if gen is None or name == "auto":
        known = ", ".join(sorted(set(GENERATORS) - {"auto"}))
        raise ScheduleError(
            f"memory_limit={name!r}: expected a number or a named schedule whose peak to "
            f"match ({known})",
            rule="unsupported",
        )
    sched = gen.build(ranks, m, gen.default_chunks)
    c = costs_for(costs, sched.num_stages)
    if c is None:
        raise ScheduleError(
            f"memory_limit={name!r}: the cost model has no figures for {name}'s "
            f"{sched.num_stages} stages",
            rule="unsupported",
        )
    return max(p for p, _ in peak_memory(sched, c))


def _named_schedules(
    ranks: int, m: int, costs: CostsLike, max_chunks: int
) -> list[tuple[str, Schedule, CostModel]]:
    """Every registered generator's schedules with at most ``max_chunks`` chunks per rank."""
    out = []
    for name, gen in sorted(GENERATORS.items()):
        if name == "auto":
            continue
        options = range(1, max_chunks + 1) if gen.takes_chunks else [gen.default_chunks]
        for v in (v for v in options if v <= max_chunks):
            try:
                sched = gen.build(ranks, m, v)
            except ScheduleError:
                continue  # this (ranks, m, chunks) is outside what the generator makes
            c = costs_for(costs, sched.num_stages)
            if c is not None:
                out.append((name if not gen.takes_chunks else f"{name} v={v}", sched, c))
    return out


def search(
    costs: CostsLike,
    ranks: int,
    microbatches: int,
    memory_limit: Limit = None,
    *,
    max_chunks: int = 2,
    policies: Sequence[Policy] | None = None,
    named: bool = True,
    verify: int = 3,
    time_budget: float = 40.0,
    recompute: bool | None = None,
) -> AutoResult:
    """Search for the schedule with the shortest simulated makespan that fits ``memory_limit``.

    Args:
        costs: a cost model (``ranks`` stages = one rank's worth each, or
            ``ranks * v`` stages) or a callable ``num_stages -> CostModel``.
        memory_limit: per rank (one number or one per rank), in the cost
            model's memory unit, weights included; the name of a schedule
            (``"1f1b"``): no more than its peak; ``None``: no limit.
        max_chunks: the most chunks (stages) per rank to consider.
        policies: list-scheduler points to try (default: a small grid).
        named: also consider every registered named generator: as it is if it
            fits, and as a template (its F / I order, with the W placed anew).
        verify: how many of the best list-scheduled candidates to validate and
            simulate for real (the named ones always are).
        time_budget: seconds after which no further list-scheduler run starts.
        recompute: also fit the best schedule found without a limit into the
            limit with recompute and offload (:func:`zeropipe.fit.fit_memory`,
            slow beyond a few hundred actions); ``None``: only when nothing
            fits without them.
    """
    if ranks < 1 or microbatches < 1 or max_chunks < 1:
        raise ScheduleError(
            f"ranks, microbatches and max_chunks must be >= 1, got {ranks}, {microbatches}, "
            f"{max_chunks}",
            rule="unsupported",
        )
    start = time.perf_counter()
    limits = _limits(memory_limit, ranks, microbatches, costs)
    base = costs_for(costs, ranks)
    split_options = [True]
    if base is None or any(c.time(Kind.B) < c.I + c.W - _EPS for c in base.stages):
        split_options.append(False)  # a fused backward is cheaper: try it too
    named_runs = _named_schedules(ranks, microbatches, costs, max_chunks) if named else []
    runs: list[tuple[str, str, Policy, Schedule, CostModel, list[list[Step]] | None]] = []
    for label, sched, c in named_runs:
        chunks = sched.num_stages // ranks
        # Exact replay: its makespan as simulated, and whether it fits.
        runs.append((label, "named", Policy("named", chunks), sched, c, _order(sched, True)))
    for label, sched, c in named_runs:
        # Its F / I order with the W placed by the list scheduler for these costs.
        template = _order(sched, keep_w=False)
        for gap in (0.0, 0.5, 1.0):
            policy = Policy("order", sched.num_stages // ranks, True, gap)
            runs.append((f"{label}'s F/I order, W placed anew", "list", policy, sched, c, template))
    for policy in policies if policies is not None else _policies(ranks, max_chunks, split_options):
        place = _placement(policy.placement, ranks, policy.chunks)
        derived = costs_for(costs, len(place))
        if derived is not None:
            shape = Schedule(place, [[] for _ in range(ranks)], microbatches, "auto")
            runs.append((policy.describe(), "list", policy, shape, derived, None))
    listed: list[Candidate] = []
    for label, source, policy, sched, c, order in runs:
        if source == "list" and listed and time.perf_counter() - start > time_budget:
            continue
        place = tuple(sched.placement)
        plan = _list_schedule(c, place, microbatches, policy, limits, order, source == "named")
        if plan is None:
            continue
        steps = plan.steps if source == "list" else None
        listed.append(Candidate(label, source, c, plan.makespan, plan.steady, None, sched, steps))
    listed.sort(key=lambda c: (round(c.makespan, 9), round(c.steady, 9), c.source != "named"))
    tried = listed[:verify]
    best_named = next((c for c in listed if c.source == "named"), None)
    if best_named is not None and all(c is not best_named for c in tried):
        tried.append(best_named)  # auto is never worse than a named schedule that fits
    scored = []
    for cand in tried:
        try:
            graph = validate(cand.schedule, memory_limit=limits, costs=cand.costs)
        except ScheduleError:
            continue  # a list-scheduler bug must not win; the ground truth decides
        cand.timeline = simulate(cand.schedule, cand.costs, graph=graph)
        cand.makespan = cand.timeline.makespan
        cand.steady = cand.timeline.steady_bubble_rate
        scored.append(cand)
    finite = any(math.isfinite(x) for x in limits)
    if finite and (recompute or (recompute is None and not scored)):
        try:
            scored.append(
                _fit(costs, ranks, microbatches, limits, max_chunks, policies, named, verify)
            )
        except ScheduleError:
            if not scored:
                raise  # fit_memory's error names the smallest limit that fits
    if not scored:
        raise ScheduleError(
            f"no schedule without recompute or offload fits a memory limit of "
            f"{_fmt_limits(limits)} per rank on {ranks} rank(s): each rank needs at least its "
            f"weights plus one microbatch's activations of all its stages "
            f"({_least_memory(costs, ranks):g} here); raise the limit or allow recompute",
            rule="memory",
        )
    scored.sort(key=lambda c: (round(c.makespan, 9), round(c.steady, 9), c.source != "named"))
    best = scored[0]
    assert best.timeline is not None  # set above for every scored candidate
    if best_named is None:
        versus = "no named schedule fits"
    elif best.source == "named":
        versus = "no list-scheduled candidate beat it"
    else:
        gain = 1 - best.makespan / best_named.makespan
        versus = f"best named {best_named.name}: {best_named.makespan:.5g}, -{gain:.1%}"
    how = best.name if best.source == "list" else f"the named schedule {best.name}"
    tl = best.timeline
    seconds = time.perf_counter() - start
    explanation = (
        f"auto: {how}; makespan {tl.makespan:.5g} ({versus}); steady bubble "
        f"{tl.steady_bubble_rate:.4f}; peak {max(tl.peak_memory):.4g} of limit "
        f"{_fmt_limits(limits)} {best.costs.unit}; {len(listed)} candidates fit, "
        f"{len(scored)} verified, {seconds:.2g} s"
    )
    sched = best.schedule if best.source == "list" else _renamed(best.schedule, "auto")
    return AutoResult(sched, best.costs, tl, explanation, listed, seconds)


def _fit(
    costs: CostsLike,
    ranks: int,
    m: int,
    limits: list[float],
    max_chunks: int,
    policies: Sequence[Policy] | None,
    named: bool,
    verify: int,
) -> Candidate:
    """The best schedule without a limit, made to fit ``limits`` by recompute and offload."""
    from zeropipe.fit import fit_memory  # the memory passes; only needed here

    free = search(
        costs, ranks, m, None, max_chunks=max_chunks, policies=policies, named=named,
        verify=verify, recompute=False,
    )  # fmt: skip
    fit = fit_memory(free.schedule, limits, free.costs)  # raises, naming what would fit
    sched = _renamed(fit.schedule, "auto")
    graph = validate(sched, memory_limit=limits, costs=free.costs)
    tl = simulate(sched, free.costs, graph=graph)
    actions = len(fit.recompute) + len(fit.offload)
    how = free.explanation.split(";")[0].removeprefix("auto: ")
    label = f"{how}, with {actions} recompute/offload pair(s) inserted by fit_memory"
    return Candidate(label, "list", free.costs, tl.makespan, tl.steady_bubble_rate, tl, sched)


def _renamed(schedule: Schedule, name: str) -> Schedule:
    return schedule.replace_actions(schedule.actions, name=name)


def _fmt_limits(limits: Sequence[float]) -> str:
    if len(set(limits)) == 1:
        return f"{limits[0]:g}"
    return "[" + ", ".join(f"{x:g}" for x in limits) + "]"


def _least_memory(costs: CostsLike, ranks: int) -> float:
    c = costs_for(costs, ranks)
    if c is None:
        return math.nan
    return max(c.stages[r].weights + c.stages[r].act for r in range(ranks))


def auto_schedule(
    costs: CostsLike,
    ranks: int,
    microbatches: int,
    memory_limit: Limit = None,
    **options: Any,
) -> tuple[Schedule, str]:
    """The best schedule :func:`search` finds and its one-line explanation.

    The schedule has ``ranks * v`` stages for the ``v`` it chose; simulate it
    with ``costs_for(costs, schedule.num_stages)`` (or use :func:`search`,
    whose result carries that cost model and the timeline).
    """
    result = search(costs, ranks, microbatches, memory_limit, **options)
    return result.schedule, result.explanation


@register(
    "auto",
    "searched: shortest simulated step under unit costs within 1F1B's peak memory, "
    "using at most `chunks` chunks per rank (zeropipe.schedules.auto.search for real costs)",
    default_chunks=2,
    takes_chunks=True,
)
def auto(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """``search`` under unit costs, within 1F1B's peak, with up to ``chunks`` chunks per rank."""
    return search(CostModel.uniform(ranks), ranks, microbatches, "1f1b", max_chunks=chunks).schedule


#: The registry entry, kept so that a registry reset can put it back.
GENERATOR = GENERATORS["auto"]
