"""Discrete-event execution of a schedule under a cost model.

Each rank runs its list in order on four lanes::

    compute  F B I W R          one at a time, in list order
    copy     OFFLOAD RELOAD     a side stream: overlaps compute, one copy at a time
    comm     SEND_* RECV_*      posted instantly; the wire is modelled on the edge
    reduce   REDUCE_GRAD        posted on compute (``overhead``), then the all-reduce
                                runs on the rank's data-parallel link, one at a time
                                in posting order, while the rank computes on

A REDUCE_GRAD's event is the all-reduce itself, from when the link takes it
to when it ends, so a picture shows it beside the compute that follows; the
step ends with the last compute or the last reduction, whichever is later
(``makespan``), and the bubble rates count compute only.  An overlapped pair
(``Schedule.overlaps``) starts when the inputs of both its actions are ready
and takes ``CostModel.overlapped_time``: its forward's event is as long as the
forward, its backward's is shortened by what the overlap hides.  A schedule whose
stages copy others (dualpipe) ends with the sum of the copies' gradients across
its ranks, after every rank's last action (``Timeline.tail``,
``CostModel.copies_sum_time``): part of the makespan, idle for the bubble rates.

An action starts when (a) the action before it on its rank has been issued,
(b) its lane is free and (c) every dependency from :mod:`zeropipe.core.deps` has
finished; a cross-rank dependency also pays the wire time, counted from when
both the send and (in a lowered schedule) the receive have been posted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.deps import Graph
from zeropipe.core.errors import ScheduleError
from zeropipe.core.gc_pause import paused_gc
from zeropipe.core.ir import COMM_KINDS, COMPUTE_KINDS, COPY_KINDS, KINDS, Action, Kind, Schedule
from zeropipe.core.memory import peak_memory
from zeropipe.core.passes.fuse import fused_weights
from zeropipe.core.passes.lower import lower
from zeropipe.core.validate import validate

__all__ = ["Event", "Timeline", "simulate"]


@dataclass(frozen=True, slots=True)
class Event:
    """One action as it ran (or would run): ``[start, end)`` on ``rank``.

    ``wait`` is the part of it, from ``start``, that a measured action spent
    blocked for its data (a received tensor) before computing: the action's
    work runs ``[ready, end)``, and the wait counts as idle in the bubble rates.
    Simulated events start when their data is ready, so theirs is 0.
    """

    rank: int
    step: int
    action: Action
    start: float
    end: float
    wait: float = 0.0

    @property
    def ready(self) -> float:
        """When the action's data had arrived and its work began."""
        return self.start + self.wait

    @property
    def work(self) -> float:
        """Time spent working: the event's length less its wait."""
        return self.end - self.start - self.wait

    @property
    def lane(self) -> str:
        kind = self.action.kind
        if kind in COMPUTE_KINDS:
            return "compute"
        if kind in COPY_KINDS:
            return "copy"
        return "reduce" if kind is Kind.REDUCE_GRAD else "comm"


@dataclass
class Timeline:
    """Every action's start and end on every rank, plus the summary figures."""

    schedule: Schedule
    events: list[list[Event]]  # per rank, in program order
    peak_memory: list[float]
    memory_unit: str = "microbatch"
    measured: bool = False
    meta: dict[str, object] = field(default_factory=dict)
    # After every rank's last action, every rank in it: the sum of a schedule's copies'
    # gradients across ranks (dualpipe), no action of its own.
    tail: float = 0.0

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    def _compute(self, rank: int) -> list[Event]:
        return [e for e in self.events[rank] if e.lane == "compute"]

    @property
    def start(self) -> float:
        return min((e.start for evs in self.events for e in evs), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for evs in self.events for e in evs), default=0.0) + self.tail

    @property
    def makespan(self) -> float:
        """First start to last end over all ranks."""
        return self.end - self.start

    def busy(self, rank: int) -> float:
        """Time ``rank`` spends computing (copies and comms overlap it; waits are idle).

        The union of its compute actions' ``[ready, end)``: the two halves of an
        overlapped pair that ran at once count their shared time once.
        """
        total, reach = 0.0, -math.inf
        for ready, end in sorted((e.ready, e.end) for e in self._compute(rank)):
            if end > reach:
                total += end - max(ready, reach)
                reach = end
        return total

    def reductions(self, rank: int) -> list[Event]:
        """``rank``'s gradient all-reduces (REDUCE_GRAD), each from start to end."""
        return [e for e in self.events[rank] if e.lane == "reduce"]

    @property
    def compute_end(self) -> float:
        """When the last compute action ends (the makespan may end later, on a reduction)."""
        return max((e.end for evs in self.events for e in evs if e.lane == "compute"), default=0.0)

    def span(self, rank: int) -> float:
        evs = self._compute(rank)
        # From when its first work began: a wait before it is warm-up, as in a simulated span.
        return max(e.end for e in evs) - min(e.ready for e in evs) if evs else 0.0

    @property
    def bubble_rate(self) -> float:
        """1 - total busy time / (ranks x makespan)."""
        total = sum(self.busy(r) for r in range(self.num_ranks))
        return 1.0 - total / (self.num_ranks * self.makespan) if self.makespan > 0 else 0.0

    @property
    def steady_bubble_rate(self) -> float:
        """Idle share of the rank with the longest span, first start to last end.

        This is the zero-bubble paper's figure: the cost per step once
        consecutive steps overlap, so warm-up and cool-down of different ranks
        do not both count.
        """
        rank = max(range(self.num_ranks), key=self.span)
        span = self.span(rank)
        return (span - self.busy(rank)) / span if span > 0 else 0.0

    def bubble(self, rank: int) -> float:
        """Idle compute time of ``rank`` within the makespan."""
        return self.makespan - self.busy(rank)

    def summary(self) -> dict[str, object]:
        s = self.schedule
        return {
            "schedule": s.name,
            "ranks": s.num_ranks,
            "stages": s.num_stages,
            "microbatches": s.microbatches,
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "steady_bubble_rate": self.steady_bubble_rate,
            "peak_memory": list(self.peak_memory),
            "memory_unit": self.memory_unit,
        }


def simulate(
    schedule: Schedule, costs: CostModel | None = None, *, graph: Graph | None = None
) -> Timeline:
    """Run ``schedule`` under ``costs`` (default: unit times, one chunk's share each).

    The schedule is validated first unless its ``graph`` (from ``validate``) is given.

    When the costs price posting a send or receive (``post`` > 0), a schedule
    without SEND/RECV actions that spans several ranks is simulated as the
    runtime runs it: lowered by :func:`zeropipe.core.passes.lower.lower` (the default
    placement of ``Pipeline(recv_ahead=None)``), so that every post it will
    make is paid.  The timeline's ``schedule`` is then the lowered one.
    """
    costs = (costs or CostModel.uniform_for(schedule)).for_stages(
        schedule.num_stages, schedule.microbatches
    )
    with paused_gc():
        graph = graph or validate(schedule)
        if costs.post > 0 and schedule.num_ranks > 1 and not schedule.is_lowered:
            # Lowering a valid schedule gives a valid one: its graph needs no second validation.
            schedule = lower(schedule)
            graph = Graph(schedule)
        return _run(schedule, costs, graph)


# Lanes of the module docstring, by ``Action.kind_no``.
_COMPUTE, _COPY, _REDUCE, _COMM = range(4)
_LANE = [
    _COMPUTE
    if k in COMPUTE_KINDS
    else _COPY
    if k in COPY_KINDS
    else _REDUCE
    if k is Kind.REDUCE_GRAD
    else _COMM
    for k in KINDS
]


def _run(schedule: Schedule, costs: CostModel, graph: Graph) -> Timeline:
    """The event loop over the graph's nodes (see :class:`zeropipe.core.deps.Graph`)."""
    acts = graph.actions
    total = len(acts)
    first, rank_of, waits, transfers = graph.first, graph.rank_of, graph.waits, graph.transfers
    duration = _durations(schedule, costs, graph)
    wire = [costs.transfer_time(s) for s in range(schedule.num_stages)]
    # Microbatches of their own sizes: each one's boundary bytes (CostModel.microbatch_scale).
    sized = bool(costs.microbatch_scale)
    start = [0.0] * total
    end = [0.0] * total
    # When each action was issued: its start, but for REDUCE_GRAD its post, which is
    # what the next action on the rank waits for (the all-reduce runs on).
    issued = [0.0] * total
    ranks = len(first)
    compute_free, copy_free, link_free = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
    for n in graph.node_order:  # program order within a rank is respected by the graph
        a = acts[n]
        r = rank_of[n]
        t = issued[n - 1] if n != first[r] else 0.0
        for d in waits[n]:
            ready = end[d]
            if ready > t:
                t = ready
        incoming = transfers.get(n)
        if incoming is not None:
            stage = a.stage
            for src, via in incoming:
                ready = end[src]
                if via >= 0 and start[via] > ready:
                    ready = start[via]
                src_stage = acts[src].stage
                lower = src_stage if src_stage < stage else stage
                ready += costs.transfer_time(lower, a.microbatch) if sized else wire[lower]
                if ready > t:
                    t = ready
        took = duration[n]
        lane = _LANE[a.kind_no]
        if lane == _REDUCE:
            if compute_free[r] > t:
                t = compute_free[r]
            compute_free[r] = posted = t + took
            issued[n] = t
            t = posted if posted >= link_free[r] else link_free[r]
            took = costs.reduce_time(a.stage)
            link_free[r] = t + took
            start[n], end[n] = t, t + took
            continue
        # A post that costs time runs on the rank's one thread, like compute.
        if lane == _COMPUTE or (took > 0 and lane == _COMM):
            if compute_free[r] > t:
                t = compute_free[r]
            compute_free[r] = t + took
        elif lane == _COPY:
            if copy_free[r] > t:
                t = copy_free[r]
            copy_free[r] = t + took
        start[n], end[n], issued[n] = t, t + took, t
    finish = max(end, default=0.0)
    if not math.isfinite(finish):
        # Every figure is finite (CostModel checks), but their sums can still overflow.
        raise ScheduleError(
            f"the simulated times add up past the largest float ({finish}): the costs are "
            f"too large to simulate; scale them down (e.g. seconds, not nanoseconds)",
            rule="costs",
        )
    events = [
        [Event(r, k, a, start[lo + k], end[lo + k]) for k, a in enumerate(rank_acts)]
        for r, (lo, rank_acts) in enumerate(zip(first, schedule.actions, strict=True))
    ]
    peaks = [p for p, _ in peak_memory(schedule, costs, graph.deps)]
    meta: dict[str, object] = {}
    if "time_unit" in costs.meta:
        meta["time_unit"] = costs.meta["time_unit"]
    tail = costs.copies_sum_time(schedule)
    return Timeline(schedule, events, peaks, memory_unit=costs.unit, meta=meta, tail=tail)


def _durations(schedule: Schedule, costs: CostModel, graph: Graph) -> list[float]:
    """How long each node occupies its lane (for REDUCE_GRAD: its post)."""
    if costs.microbatch_scale:  # each microbatch its own size: priced one by one
        out = [costs.time(a) for a in graph.actions]
    else:
        table: dict[int, float] = {}  # stage << 5 | no microbatch << 4 | kind_no -> time
        out = []
        for a in graph.actions:
            key = (a.stage << 5) | ((a.microbatch is None) << 4) | a.kind_no
            took = table.get(key)
            if took is None:
                took = table[key] = costs.time(a)
            out.append(took)
    # W run together with the next W of their stage; found only when some stage prices it.
    if any(c.W_fused is not None for c in costs.stages):
        for r, k in _steps_of(schedule, fused_weights(schedule)):
            a = schedule.actions[r][k]
            c = costs.stages[a.stage]
            out[graph.first[r] + k] += (c.fused_w - c.W) * costs.scale(a.microbatch)
    for r in range(schedule.num_ranks):
        for k in schedule.overlapped(r):  # the pair's backward: less what is hidden
            first, second = schedule.actions[r][k], schedule.actions[r][k + 1]
            out[graph.first[r] + k + 1] = costs.overlapped_time(first, second) - costs.time(first)
    return out


def _steps_of(schedule: Schedule, actions: frozenset[Action]) -> list[tuple[int, int]]:
    return [
        (r, k)
        for r, rank_acts in enumerate(schedule.actions)
        for k, a in enumerate(rank_acts)
        if a in actions
    ]


def costs_from_timeline(timeline: Timeline) -> CostModel:
    """A cost model whose per-stage times are the medians measured in ``timeline``.

    Simulating the schedule under it gives the *planned* timeline to set
    beside the measured one: what the schedule would look like if every
    action took its typical time and nothing else got in the way.  Sends and
    receives take their median measured post time (``post``).  An action's
    time is its work, without its wait for data (``Event.wait``).  A transfer
    takes the median measured latency (:func:`transfer_latency`).
    """
    durations: dict[tuple[int, str], list[float]] = {}
    posts: list[float] = []
    fused = fused_weights(timeline.schedule)
    groups: dict[int, list[tuple[float, int]]] = {}  # stage -> (time of a W group, its size)
    for evs in timeline.events:
        deferred, size = 0.0, 0  # W deferred into the next one: ~0 each, run with it
        for e in evs:
            took = e.work  # its wait for data is the schedule's to simulate, not its own
            if e.lane != "compute":
                if e.action.kind in COMM_KINDS:
                    posts.append(took)
            elif e.action in fused:
                deferred, size = deferred + took, size + 1
            elif size:
                groups.setdefault(e.action.stage, []).append((deferred + took, size + 1))
                deferred, size = 0.0, 0
            else:
                durations.setdefault((e.action.stage, e.action.kind.value), []).append(took)

    def med(stage: int, kind: str, default: float) -> float:
        values = durations.get((stage, kind))
        return median(values) if values else default

    stages = []
    for s in range(timeline.schedule.num_stages):
        f = med(s, "F", 0.0)
        b = med(s, "B", 0.0)
        i = med(s, "I", b / 2)
        w_fused = None
        if s in groups:
            # W run in groups: with lone W to compare against, a fused W costs the
            # group's time beyond one lone W, shared out; with none, both are the
            # group's time per W (which the simulator adds back up to the group's).
            if (s, "W") in durations:
                lone = median(durations[(s, "W")])
                w_fused = median(max(t - lone, 0.0) / (k - 1) for t, k in groups[s])
            else:
                durations[(s, "W")] = [t / k for t, k in groups[s]]
                w_fused = median(durations[(s, "W")])
        w = med(s, "W", b / 2)
        stages.append(
            StageCost(F=f, I=i, W=w, B=b if (s, "B") in durations else None, W_fused=w_fused)
        )
    return CostModel(
        tuple(stages),
        post=median(posts) if posts else 0.0,
        latency=transfer_latency(timeline),
        meta={"source": "measured medians", "time_unit": "s"},
    )


# A consumer's data comes from this send: F(s) from SEND_F(s-1), I/B(s) from SEND_B(s+1).
_FED_BY = {Kind.F: (Kind.SEND_F, -1), Kind.I: (Kind.SEND_B, 1), Kind.B: (Kind.SEND_B, 1)}


def transfer_latency(timeline: Timeline) -> float:
    """The median time from a send's post to its data being ready for the consumer that
    waited for it, over the measured transfers a consumer waited for (0 if none did).

    A consumer that waited saw the data the moment it landed, so its ``ready``
    less the send's end is the transfer's latency; one that did not wait only
    bounds it.  The times of different ranks are compared, which holds on one
    machine (one clock); where most differences come out negative the clocks
    are not shared, and the latency is taken as 0.
    """
    sent: dict[tuple[Kind, int, int | None], float] = {}
    for evs in timeline.events:
        for e in evs:
            if e.action.kind in (Kind.SEND_F, Kind.SEND_B):
                sent[(e.action.kind, e.action.stage, e.action.microbatch)] = e.end
    gaps = []
    for evs in timeline.events:
        for e in evs:
            fed_by = _FED_BY.get(e.action.kind)
            if fed_by is None or e.wait <= 0:
                continue
            end = sent.get((fed_by[0], e.action.stage + fed_by[1], e.action.microbatch))
            if end is not None:
                gaps.append(e.ready - end)
    if not gaps or 2 * sum(g < 0 for g in gaps) > len(gaps):
        return 0.0
    return median(max(g, 0.0) for g in gaps)
