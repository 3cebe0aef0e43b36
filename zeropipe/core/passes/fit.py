"""Memory passes: insert recompute, activation offload and weight offload; fit a memory limit.

Each pass takes a valid schedule and returns one (compute-only in, compute-only
out; a lowered schedule is stripped, rewritten and lowered again).  Where the
inserted actions go, on the rank that owns the stage::

    checkpoint   F(s,i) ...  R(s,i) X  B(s,i)     R one compute action X ahead of the
                                                  backward: it needs no gradient, so it
                                                  runs while the rank waits for one
    offload      F(s,i) OFFLOAD(s,i) ... RELOAD(s,i) X  B(s,i)   (or ... R(s,i))
                                                  the copy back overlaps X
    weights      RELOAD(s) X  [s's compute ...]  OFFLOAD(s)       X: the previous stage's
                                                  last action, so the next stage's weights
                                                  arrive while it runs (prefetch)

``fit_memory`` rewrites a schedule so that its simulated peak fits a per-rank
limit: it greedily checkpoints or offloads the (stage, microbatch) that buys
the most memory for the least simulated time, keeps the fastest fitting
variant, and explains its choice; when nothing fits it says which limit would.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, Graph, keep_overlaps
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import COMPUTE_KINDS, Action, Kind, Schedule
from zeropipe.core.memory import initial_memory, memory_deltas, per_rank
from zeropipe.core.passes.lower import lower
from zeropipe.core.simulate import simulate

__all__ = [
    "Fit",
    "LimitTooLow",
    "checkpoint",
    "fit_memory",
    "offload",
    "offload_weights",
    "smallest_limit",
]

Pair = tuple[int, int]
Which = Iterable[Pair] | Callable[[int, int], bool] | None


# --- the insertion passes -----------------------------------------------------------------


def checkpoint(schedule: Schedule, which: Which = None, *, ahead: int = 0) -> Schedule:
    """Checkpoint the chosen (stage, microbatch) pairs: their F keeps only its inputs, R redoes it.

    ``which``: pairs, a predicate ``(stage, microbatch) -> bool`` or ``None``
    for all.  R goes ``ahead`` compute actions before the backward (0: right
    before it), never before its F, its RELOAD or a weight copy of its stage.
    """
    return _rewrite(schedule, {p: ahead for p in _select(schedule, which)}, {})


def offload(schedule: Schedule, which: Which = None, *, prefetch: int = 1) -> Schedule:
    """Offload the chosen pairs' saved activations after F and reload them before use.

    RELOAD goes ``prefetch`` compute actions before the consumer (R if the pair
    is checkpointed, else its backward), so the copy overlaps them.
    """
    return _rewrite(schedule, {}, {p: prefetch for p in _select(schedule, which)})


def offload_weights(
    schedule: Schedule, stages: Iterable[int] | None = None, *, prefetch: int = 1
) -> Schedule:
    """Keep the weights of ``stages`` (default: all) on the host except while they compute.

    On each rank every run of consecutive compute actions of a stage gets a
    RELOAD ``prefetch`` compute actions before it and an OFFLOAD right after
    it; runs closer than that are merged (reloading would not let go of anything).
    """
    lowered = schedule.is_lowered
    base = schedule.compute_only()
    chosen = set(range(base.num_stages) if stages is None else stages)
    bad = sorted(s for s in chosen if not 0 <= s < base.num_stages)
    if bad:
        raise ScheduleError(f"offload_weights: no stage(s) {bad} in this schedule", rule="range")
    have = {a.stage for acts in base.actions for a in acts if a.is_weight_copy}
    if have & chosen:
        raise ScheduleError(
            f"stage(s) {sorted(have & chosen)} already have weight OFFLOAD/RELOAD actions",
            rule="duplicate",
        )
    out = [_weight_copies(acts, chosen, prefetch) for acts in base.actions]
    result = keep_overlaps(base.replace_actions(out))
    return lower(result) if lowered else result


def _weight_copies(acts: Sequence[Action], chosen: set[int], prefetch: int) -> list[Action]:
    compute = [k for k, a in enumerate(acts) if a.kind in COMPUTE_KINDS]
    # Runs of one stage in the order of compute actions: [stage, first, last] (indices
    # into `compute`), merged when the gap between them is too short to be worth it.
    runs: list[list[int]] = []
    last_run: dict[int, list[int]] = {}
    for n, k in enumerate(compute):
        s = acts[k].stage
        if s not in chosen:
            continue
        prev = last_run.get(s)
        if prev is not None and n - prev[2] - 1 <= prefetch:
            prev[2] = n
            continue
        run = [s, n, n]
        runs.append(run)
        last_run[s] = run
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for s, first, last in runs:
        at = max(first - prefetch, 0)
        # Not before this stage's previous OFFLOAD (which sits right after its previous run).
        prev_end = max((r[2] for r in runs if r[0] == s and r[2] < first), default=-1)
        at = max(at, prev_end + 1)
        before.setdefault(compute[at], []).append(Action(Kind.RELOAD, s))
        after.setdefault(compute[last], []).append(Action(Kind.OFFLOAD, s))
    out: list[Action] = []
    for k, a in enumerate(acts):
        out.extend(before.get(k, ()))
        out.append(a)
        out.extend(after.get(k, ()))
    return out


def _select(schedule: Schedule, which: Which) -> list[Pair]:
    routes = [schedule.route(i) for i in range(schedule.microbatches)]
    pairs = [
        (s, i)
        for s in range(schedule.num_stages)
        for i, route in enumerate(routes)
        if route[0] <= s <= route[-1]  # off its route a microbatch has nothing to keep
    ]
    if which is None:
        return pairs
    if callable(which):
        return [p for p in pairs if which(*p)]
    chosen = [(int(s), int(i)) for s, i in which]
    bad = [p for p in chosen if p not in set(pairs)]
    if bad:
        raise ScheduleError(
            f"no (stage, microbatch) {bad[0]} in a schedule of {schedule.num_stages} stages "
            f"and {schedule.microbatches} microbatches (on that microbatch's route)",
            rule="range",
        )
    return chosen


def _rewrite(
    schedule: Schedule, recompute: Mapping[Pair, int], offloads: Mapping[Pair, int]
) -> Schedule:
    """Insert R (``ahead`` per pair) and OFFLOAD/RELOAD (``prefetch`` per pair)."""
    lowered = schedule.is_lowered
    base = schedule.compute_only()
    deps = Dependencies(base)
    for pairs in (recompute, offloads):
        for ahead in pairs.values():
            if ahead < 0:
                raise ScheduleError(f"ahead/prefetch must be >= 0, got {ahead}")
    new_r = {p: ahead for p, ahead in recompute.items() if not deps.checkpointed(*p)}
    new_o = {p: prefetch for p, prefetch in offloads.items() if not deps.offloaded(*p)}
    # The rules of the schedule as it will be: where each new action goes follows from them.
    planned = deps.with_actions(
        [Action(Kind.R, s, i) for s, i in new_r]
        + [Action(kind, s, i) for s, i in new_o for kind in (Kind.OFFLOAD, Kind.RELOAD)]
    )
    out: list[list[Action]] = []
    for acts in base.actions:
        lst = list(acts)
        stages = {a.stage for a in lst}
        for s, i in new_o:
            if s in stages:
                off = Action(Kind.OFFLOAD, s, i)
                needs = planned.upstream(off)
                lst.insert(1 + max(k for k, a in enumerate(lst) if a in needs), off)  # after F
        for (s, i), ahead in new_r.items():
            if s in stages:
                r = Action(Kind.R, s, i)
                _insert_before(lst, r, planned.backward(s, i), ahead, planned.upstream(r))
        for (s, i), prefetch in new_o.items():
            if s in stages:
                back = Action(Kind.RELOAD, s, i)
                reader = planned.saved_reader(s, i)
                _insert_before(lst, back, reader, prefetch, planned.upstream(back))
        out.append(lst)
    result = keep_overlaps(base.replace_actions(out))
    return lower(result) if lowered else result


def _floor(lst: Sequence[Action], new: Action, needs: frozenset[Action]) -> int:
    """The first place ``new`` may go: after what it needs (``needs``, from the dependency
    model) and after every weight copy of its stage, so that it does not land outside
    the stage's weight residency."""
    floor = 0
    for k, a in enumerate(lst):
        if a in needs or (a.is_weight_copy and a.stage == new.stage):
            floor = k + 1
    return floor


def _insert_before(
    lst: list[Action], new: Action, consumer: Action, ahead: int, needs: frozenset[Action]
) -> None:
    """Put ``new`` ``ahead`` compute actions before ``consumer``, but after what it needs."""
    at = lst.index(consumer)
    floor = _floor(lst[:at], new, needs)
    k, seen = at, 0
    while seen < ahead and k > floor:
        k -= 1
        if lst[k].kind in COMPUTE_KINDS:
            seen += 1
    if seen < ahead:
        k = floor
    lst.insert(max(k, floor), new)


# --- fitting a memory limit ---------------------------------------------------------------


class LimitTooLow(ScheduleError):
    """No rewrite fits the limit.  ``smallest``: per rank, the smallest limit that fits."""

    def __init__(self, message: str, smallest: list[float]) -> None:
        super().__init__(message, rule="memory")
        self.smallest = smallest


@dataclass
class Fit:
    """What :func:`fit_memory` chose: the schedule, per pair the actions added, and why."""

    schedule: Schedule
    recompute: dict[Pair, int]  # pair -> ahead
    offload: dict[Pair, int]  # pair -> prefetch
    peaks: list[float]
    limits: list[float]
    makespan: float
    base_makespan: float
    base_peaks: list[float]
    unit: str
    tried: list[str] = field(default_factory=list)

    def explain(self) -> str:
        """A few lines: what was inserted, the peaks before and after, the time it costs."""
        lines = [
            f"fit_memory: {self.schedule.name}, limit "
            + _fmt_list(self.limits, self.unit)
            + f"; natural peak {_fmt_list(self.base_peaks, self.unit)}",
        ]
        if not self.recompute and not self.offload:
            lines.append("  fits as it is: nothing inserted")
        else:
            if self.recompute:
                lines.append(
                    f"  recompute {len(self.recompute)} (stage, mb): {_fmt_pairs(self.recompute)}"
                )
            if self.offload:
                lines.append(
                    f"  offload {len(self.offload)} (stage, mb): {_fmt_pairs(self.offload)}"
                )
            slow = self.makespan / self.base_makespan if self.base_makespan > 0 else 1.0
            lines.append(
                f"  peak {_fmt_list(self.peaks, self.unit)}; simulated makespan "
                f"{self.makespan:.4g} vs {self.base_makespan:.4g} ({slow:.3f}x)"
            )
        if self.tried:
            lines.append("  why: fastest fitting of " + "; ".join(self.tried))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def fit_memory(
    schedule: Schedule,
    limit: float | Sequence[float],
    costs: CostModel | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> Fit:
    """Rewrite ``schedule`` with R and/or OFFLOAD/RELOAD so that every rank's peak fits ``limit``.

    ``limit`` is one number or one per rank, in the unit of ``costs`` (default:
    uniform costs, i.e. microbatches of one rank's layers; bytes with
    :func:`zeropipe.runtime.memory.manager.measured_costs`).  Strategies tried: greedy
    mixes of recompute and offload, recompute only and offload only, each
    adding the pair with the least simulated-time cost per unit of memory over
    the limit it removes; the fitting result with the smallest simulated
    makespan wins.  ``log`` (e.g. ``print``) receives the explanation.  Raises
    :class:`LimitTooLow` (a ``ScheduleError(rule="memory")``) naming the smallest
    limit that would fit (also :func:`smallest_limit`).
    """
    lowered = schedule.is_lowered
    base = schedule.compute_only()
    costs = _default_costs(base, costs)
    limits = per_rank(limit, base.num_ranks, "limit")
    ev = _Evaluator(base, costs, limits)
    natural = ev.evaluate({}, {})
    best: _Eval | None = natural if natural.fits else None
    tried: list[str] = []
    floor = ev.evaluate({p: 0 for p in ev.pairs}, {p: 0 for p in ev.pairs})
    if best is None and floor.fits:
        strategies = {
            "recompute + offload": (True, True),
            "recompute only": (True, False),
            "offload only": (False, True),
        }
        for name, (use_r, use_o) in strategies.items():
            found = ev.greedy(use_r, use_o)
            if found is None:
                tried.append(f"{name}: does not fit")
                continue
            tried.append(f"{name}: makespan {found.makespan:.4g} with {found.size} action(s)")
            if best is None or (found.makespan, found.size) < (best.makespan - 1e-9, best.size):
                best = found
    if best is None:
        raise LimitTooLow(
            f"{schedule.name}: no recompute/offload plan fits a limit of "
            f"{_fmt_list(limits, costs.unit)}; the smallest limit that fits is "
            f"{_fmt_list(floor.peaks, costs.unit)} (max {max(floor.peaks):.6g}: everything "
            f"recomputed and "
            f"offloaded; natural peak {_fmt_list(natural.peaks, costs.unit)})",
            floor.peaks,
        )
    out = best.schedule
    fit = Fit(
        schedule=lower(out) if lowered else out,
        recompute=dict(best.recompute),
        offload=dict(best.offload),
        peaks=best.peaks,
        limits=limits,
        makespan=best.makespan,
        base_makespan=natural.makespan,
        base_peaks=natural.peaks,
        unit=costs.unit,
        tried=tried,
    )
    if log is not None:
        log(fit.explain())
    return fit


def smallest_limit(schedule: Schedule, costs: CostModel | None = None) -> list[float]:
    """Per rank, the lowest peak any rewrite reaches: everything recomputed and offloaded."""
    base = schedule.compute_only()
    costs = _default_costs(base, costs)
    ev = _Evaluator(base, costs, [math.inf] * base.num_ranks)
    return ev.evaluate({p: 0 for p in ev.pairs}, {p: 0 for p in ev.pairs}).peaks


def _default_costs(base: Schedule, costs: CostModel | None) -> CostModel:
    return (costs or CostModel.uniform_for(base)).for_stages(base.num_stages)


class _Eval:
    """One candidate rewrite: its schedule, memory figures, and (on demand) simulated makespan."""

    def __init__(
        self,
        schedule: Schedule,
        deps: Dependencies,
        costs: CostModel,
        recompute: dict[Pair, int],
        offload: dict[Pair, int],
        limits: list[float],
    ) -> None:
        self.schedule, self.deps, self.costs = schedule, deps, costs
        self.recompute, self.offload = recompute, offload
        self.peaks: list[float] = []
        self.excess = 0.0  # area over the limit: overshoot summed over ranks and steps
        self.live: set[Pair] = set()  # pairs holding memory at some step over the limit
        for r, (start, deltas) in enumerate(
            zip(initial_memory(schedule, costs), memory_deltas(schedule, costs, deps), strict=True)
        ):
            level = peak = start
            held: dict[Pair, float] = {}
            for a, d in zip(schedule.actions[r], deltas, strict=True):
                level += d
                peak = max(peak, level)
                if a.microbatch is not None:
                    pair = (a.stage, a.microbatch)
                    held[pair] = held.get(pair, 0.0) + d
                over = level - limits[r]
                if over > _EPS * max(1.0, abs(limits[r])):
                    self.excess += over
                    self.live.update(p for p, h in held.items() if h > _EPS)
            self.peaks.append(peak)
        self.fits = self.excess == 0.0
        self._makespan: float | None = None

    @property
    def makespan(self) -> float:
        if self._makespan is None:
            graph = Graph(self.schedule, self.deps)  # built by construction: no full validation
            self._makespan = simulate(self.schedule, self.costs, graph=graph).makespan
        return self._makespan

    @property
    def size(self) -> int:
        return len(self.recompute) + len(self.offload)


_EPS = 1e-9
_Move = tuple[str, Pair, int]  # ("R" or "O", pair, ahead or prefetch)


class _Evaluator:
    """Rewrites the base schedule for a choice of pairs and scores the result."""

    def __init__(self, base: Schedule, costs: CostModel, limits: list[float]) -> None:
        self.base = base
        self.costs = costs
        self.limits = limits
        deps = Dependencies(base)
        self.pairs = [
            (s, i)
            for s in range(base.num_stages)
            for i in range(base.microbatches)
            if deps.visits(s, i) and not deps.checkpointed(s, i) and not deps.offloaded(s, i)
        ]
        self._cache: dict[
            tuple[frozenset[tuple[Pair, int]], frozenset[tuple[Pair, int]]], _Eval
        ] = {}

    def evaluate(self, recompute: dict[Pair, int], offloads: dict[Pair, int]) -> _Eval:
        key = (frozenset(recompute.items()), frozenset(offloads.items()))
        hit = self._cache.get(key)
        if hit is None:
            sched = _rewrite(self.base, recompute, offloads)
            hit = _Eval(
                sched, Dependencies(sched), self.costs, dict(recompute), dict(offloads), self.limits
            )
            self._cache[key] = hit
        return hit

    def greedy(self, use_r: bool, use_o: bool) -> _Eval | None:
        """Add (or tighten) one pair at a time, cheapest time per unit of excess removed.

        Lazy: scores from earlier rounds are kept in a heap and only the top one
        is re-scored against the current choice; it is taken if it still beats
        the next stale score.  When every score is stale-infinite, all are redone.
        """
        current = self.evaluate({}, {})
        kinds = [k for k, use in (("R", use_r), ("O", use_o)) if use]
        moves = [(k, pair, param) for pair in self.pairs for k in kinds for param in (1, 0)]
        heap: list[tuple[tuple[float, float], int, _Move]] = []
        for n, move in enumerate(moves):
            heapq.heappush(heap, (self._score(current, move), n, move))
        counter = len(moves)
        while not current.fits:
            taken = False
            while heap:
                _, _, move = heapq.heappop(heap)
                score = self._score(current, move)
                if math.isinf(score[0]):
                    continue  # no gain now; redone if everything stalls
                if not heap or score <= heap[0][0]:
                    current = self._apply(current, move)
                    taken = True
                    break
                counter += 1
                heapq.heappush(heap, (score, counter, move))
            if not taken:
                rescored = [(self._score(current, m), n, m) for n, m in enumerate(moves)]
                heap = [entry for entry in rescored if not math.isinf(entry[0][0])]
                if not heap:
                    return None
                heapq.heapify(heap)
        return self._prune(current)

    def _apply(self, current: _Eval, move: _Move) -> _Eval:
        kind, pair, param = move
        r2, o2 = dict(current.recompute), dict(current.offload)
        (r2 if kind == "R" else o2)[pair] = param
        return self.evaluate(r2, o2)

    def _score(self, current: _Eval, move: _Move) -> tuple[float, float]:
        """(simulated time added per unit of excess removed, -excess removed); inf if useless."""
        kind, pair, param = move
        chosen = current.recompute if kind == "R" else current.offload
        if chosen.get(pair, 2) <= param or pair not in current.live:
            return (math.inf, 0.0)
        cand = self._apply(current, move)
        gain = current.excess - cand.excess
        if gain <= _EPS:
            return (math.inf, 0.0)
        return (max(cand.makespan - current.makespan, 0.0) / gain, -gain)

    def _prune(self, found: _Eval) -> _Eval:
        """Drop additions the limit no longer needs (greedy steps can make earlier ones moot)."""
        while True:
            best: _Eval | None = None
            for what, pair in [("R", p) for p in found.recompute] + [
                ("O", p) for p in found.offload
            ]:
                r2, o2 = dict(found.recompute), dict(found.offload)
                (r2 if what == "R" else o2).pop(pair)
                cand = self.evaluate(r2, o2)
                better = best is None or cand.makespan < best.makespan
                if cand.fits and cand.makespan <= found.makespan + 1e-12 and better:
                    best = cand
            if best is None:
                return found
            found = best


def _fmt_list(values: Sequence[float], unit: str) -> str:
    units = unit if unit.endswith("s") else f"{unit}(s)"
    if len(set(values)) == 1:
        return f"{values[0]:.4g} {units} per rank"
    return "[" + ", ".join(f"{v:.4g}" for v in values) + f"] {units}"


def _fmt_pairs(pairs: Mapping[Pair, int]) -> str:
    by_stage: dict[int, list[int]] = {}
    for s, i in sorted(pairs):
        by_stage.setdefault(s, []).append(i)
    return ", ".join(f"stage {s} mb {','.join(map(str, mbs))}" for s, mbs in by_stage.items())
