"""Plan a training run at cluster scale: which pipeline depth, data-parallel degree,
tensor-parallel degree, microbatch size, chunks, schedule and memory plan give the
shortest simulated step.

For ``gpus`` accelerators and a model of ``layers`` layers, :func:`search` enumerates::

    cp    each of cp_options dividing gpus       (default 1: no context parallelism)
    tp    each of tp_options dividing gpus / cp  (default 1: no tensor parallelism)
    pp    a divisor of gpus / (tp x cp), pp <= layers   dp = gpus / (pp x tp x cp)
    ep    each of ep_options dividing dp         (default 1: experts on every replica)
    mbs   global_batch divisible by dp x mbs     m    = global_batch / (dp x mbs)
    schedule x chunks (stages = pp x chunks <= layers), as the generator accepts
                                             (dualpipe: pp stages, each also run as a copy
                                             on another rank: its weights held twice)

prices each configuration with the cost model ``costs_for(config)`` returns (seconds
and bytes; one GPU's, the ``tp`` GPUs of a stage alike), builds the schedule with
:func:`zeropipe.core.passes.build.build_schedule` (with the data-parallel gradient all-reduce
when dp > 1) and simulates it.  Where the peak
memory exceeds the limit, recompute and then activation offload are added
(:func:`zeropipe.planning.plan_memory.plan_memory`); what still does not fit is ranked after everything that does.

A cluster-sized grid holds schedules of tens of thousands of actions, so most
configurations are never simulated: :func:`lower_bound` gives, without building
anything, a step time no schedule on that placement can beat (the busiest rank's
compute, plus the forward chain before its first action and what must follow its
last).  Configurations are priced in order of that bound and dropped once the bound
cannot enter the current top ``top``; the ranking is the one an exhaustive search
would give (``prune=False`` is that search).  ``auto`` is the exception: its search
is too slow to run everywhere, so it is tried only for the ``auto_runs``
configurations with the best bounds that could still enter the top, after the named
schedules (the notes say when that cut anything).

No torch here: this is core.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Graph
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.cluster_costs import (
    Candidate,
    Config,
    CostFactory,
    Layout,
    Ranking,
    ScheduleCosts,
    divisors,
    fixed_costs,
    layout_grid,
    layouts,
    schedule_cut,
    spec_costs,
)
from zeropipe.planning.plan_memory import GiB, MemoryPlan, plan_memory
from zeropipe.planning.step_bound import Shape, lower_bound

# Config, Candidate, Ranking, the cost factories, the layouts and GiB are re-exported: with
# search they are what a caller needs.
__all__ = [
    "Candidate",
    "Config",
    "CostFactory",
    "GiB",
    "Ranking",
    "ScheduleCosts",
    "divisors",
    "fixed_costs",
    "layouts",
    "lower_bound",
    "schedule_cut",
    "search",
    "spec_costs",
]


# -- the search ---------------------------------------------------------------------------


@dataclass
class _Job:
    config: Config
    schedule: str
    shape: Shape
    bound: float
    may_fit: bool  # False: its weights alone exceed the limit

    def order(self) -> tuple[bool, float]:
        return (not self.may_fit, self.bound)


@dataclass(frozen=True)
class _Workload:
    """What one step trains, for its tokens per second and MFU: ``global_batch`` samples
    of ``seq`` tokens and ``flops_per_sample`` FLOPs each, on ``gpus`` accelerators of
    ``peak_flops`` FLOP/s (a figure of 0 or less: not known)."""

    global_batch: int
    seq: int
    flops_per_sample: float
    gpus: int
    peak_flops: float

    def tokens_per_second(self, step: float) -> float:
        """Tokens a step of ``step`` seconds trains per second (NaN when not known)."""
        return self.global_batch * self.seq / step if self.seq > 0 and step > 0 else math.nan

    def mfu(self, step: float) -> float:
        """The model's FLOPs per step over what the accelerators could do in ``step``
        seconds (NaN when not known)."""
        denominator = step * self.gpus * self.peak_flops
        if self.flops_per_sample > 0 and denominator > 0:
            return self.flops_per_sample * self.global_batch / denominator
        return math.nan


class _Search:
    """One search's state: cost models and probes cached, the top list, the counts."""

    def __init__(
        self,
        costs_for: CostFactory,
        costs_for_schedule: ScheduleCosts | None,
        memory: float | None,
        top: int,
        layers: int,
        workload: _Workload,
        prune: bool,
        ep_options: Sequence[int] = (1,),
    ) -> None:
        self.costs_for, self.costs_for_schedule = costs_for, costs_for_schedule
        self.limit = math.inf if memory is None else float(memory)
        self.top, self.layers, self.workload = top, layers, workload
        self.ep_options = ep_options
        # Bounds from costs_for do not hold for the cuts costs_for_schedule prices.
        self.prune = prune and costs_for_schedule is None
        self._costs: dict[Config, CostModel] = {}
        self._probes: dict[tuple[str, int, int], Shape] = {}
        self.ranking = Ranking([])
        self._refusals: dict[str, tuple[int, str]] = {}  # schedule -> how many, the first why
        self._priced: set[str] = set()  # schedules with a priced candidate

    def refuse(self, config: Config, name: str, exc: ScheduleError, count: bool = True) -> None:
        """Count ``config`` as refused by generator ``name``, keeping its first reason."""
        self.ranking.refused += count
        if count:
            n, why = self._refusals.get(name, (0, ""))
            first = str(exc).splitlines()[0]
            where = f"pp {config.pp}, {config.microbatches} microbatches"
            self._refusals[name] = (n + 1, why or f"{where}: {first}")

    def finish(self, start: float) -> list[str]:
        """Close the ranking: its seconds since ``start`` and the refusal notes, returned."""
        self.ranking.seconds = time.perf_counter() - start
        refused = self.refusal_notes()
        self.ranking.notes += refused
        return refused

    def refusal_notes(self) -> list[str]:
        """One line per schedule its generator refused with none of its configurations
        priced: how many, and the first refusal's configuration and reason."""
        return [
            f"{name}: {n} configuration(s) refused, none priced; e.g. {why}"
            for name, (n, why) in self._refusals.items()
            if name not in self._priced
        ]

    def costs(self, config: Config) -> CostModel:
        if config not in self._costs:
            self._costs[config] = self.costs_for(config)
        return self._costs[config]

    def run_costs(self, config: Config, schedule: Schedule) -> tuple[CostModel, CostModel]:
        """The cost models ``schedule`` runs under: as it is, and recomputing (a stage
        that copies another, as dualpipe's do, costs what its original costs)."""
        ckpt = replace(config, recompute=True)
        if self.costs_for_schedule is None:
            return self.costs(config).with_copies(schedule), self.costs(ckpt).with_copies(schedule)
        return self.costs_for_schedule(config, schedule), self.costs_for_schedule(ckpt, schedule)

    def probe(self, name: str, pp: int, chunks: int, m: int) -> Shape:
        """:meth:`Shape.probe`, kept per generator, depth and chunks once found (it does
        not depend on the microbatch count); raises the generator's refusal."""
        key = (name, pp, chunks)
        if key not in self._probes:
            self._probes[key] = Shape.probe(name, pp, chunks, m)
        return self._probes[key]

    def threshold(self) -> tuple[bool, float] | None:
        """The key a new candidate must beat to enter the top (None: the top is not full)."""
        cands = self.ranking.candidates
        if len(cands) < self.top:
            return None
        worst = cands[-1]
        return (not worst.fits, worst.step_time)

    def beaten(self, may_fit: bool, bound: float) -> bool:
        worst = self.threshold()
        if worst is None:
            return False
        # Strictly worse only: a tie is priced, so pruning never changes the order.
        return (not may_fit, bound) > (worst[0], worst[1] * (1 + 1e-9))

    def add(self, cand: Candidate) -> None:
        cands = self.ranking.candidates
        cands.append(cand)
        cands.sort(key=Candidate.key)
        del cands[self.top :]

    def candidate(
        self, config: Config, name: str, sched: Schedule, memory: MemoryPlan, costs: CostModel
    ) -> Candidate:
        built = build_schedule(memory.final(), reduce_grad=config.dp * config.cp > 1)
        timeline = simulate(built, costs, graph=Graph(built))
        step = timeline.makespan
        self._priced.add(name)
        return Candidate(
            pp=config.pp,
            dp=config.dp,
            microbatch_size=config.microbatch_size,
            microbatches=config.microbatches,
            chunks=sched.chunks_per_rank,
            schedule=name,
            memory_plan=memory.plan,
            step_time=step,
            tokens_per_second=self.workload.tokens_per_second(step),
            mfu=self.workload.mfu(step),
            bubble=timeline.bubble_rate,
            peak_memory=max(timeline.peak_memory),
            fits=memory.fits,
            tp=config.tp,
            timeline=timeline,
            ep=config.ep,
            cp=config.cp,
        )

    def price(self, job: _Job) -> Candidate | None:
        """Build, fit and simulate one job; None if it is refused or its refined bound
        (recompute included) cannot enter the top."""
        config = job.config
        try:
            base = generate(job.schedule, config.pp, config.microbatches, config.chunks)
        except ScheduleError as exc:
            self.refuse(config, job.schedule, exc)
            return None
        natural, ckpt = self.run_costs(config, base)
        memory = plan_memory(base, natural, ckpt, self.limit)
        costs = ckpt if any(memory.recomputed) else natural
        bound = job.bound
        if any(memory.recomputed):
            bound = job.shape.bound(ckpt, config.microbatches, recomputed=memory.recomputed)
        # Now that its plan is known (recompute costs time; what does not fit ranks
        # after all that does), it may no longer be able to enter the top.
        if self.beaten(memory.fits, bound):
            self.ranking.pruned += 1
            return None
        self.ranking.priced += 1
        return self.candidate(config, job.schedule, base, memory, costs)

    def price_auto(self, config: Config, auto_budget: float) -> Candidate | None:
        from zeropipe.core.schedules.auto import search as auto_search  # registers "auto"

        def costs_of(stages: int) -> CostModel:
            return self.costs(replace(config, stages=stages))

        try:
            found = auto_search(
                costs_of,
                config.pp,
                config.microbatches,
                None,
                max_chunks=2 if 2 * config.pp <= self.layers else 1,
                recompute=False,
                time_budget=auto_budget,
            )
        except ScheduleError:
            self.ranking.refused += 1
            return None
        base = found.schedule.compute_only()
        stages = replace(config, stages=base.num_stages - len(base.copies))
        natural, ckpt = self.run_costs(stages, base)
        memory = plan_memory(base, natural, ckpt, self.limit)
        self.ranking.priced += 1
        costs = ckpt if any(memory.recomputed) else natural
        return self.candidate(stages, "auto", base, memory, costs)


def _jobs(
    state: _Search,
    grid: Sequence[Layout],
    schedules: Sequence[str],
    microbatch_sizes: Sequence[int],
    chunks: Sequence[int],
    *,
    count: bool = True,
) -> Iterator[_Job]:
    """Every (configuration, named schedule) the grid of (pp, dp, tp, cp) holds, with its bound;
    ``count``: add them to the ranking's considered and refused."""
    global_batch = state.workload.global_batch
    for pp, dp, tp, cp, ep in _with_ep(grid, state.ep_options):
        for mbs in microbatch_sizes:
            if global_batch % (dp * mbs):
                continue
            m = global_batch // (dp * mbs)
            for name in schedules:
                if name == "auto":
                    continue
                gen = GENERATORS[name]
                for v in chunks if gen.takes_chunks else (gen.default_chunks,):
                    state.ranking.considered += count
                    if pp * v > state.layers:
                        state.ranking.refused += count
                        continue
                    config = Config(pp, dp, mbs, m, pp * v, tp=tp, ep=ep, cp=cp)
                    try:
                        shape = state.probe(name, pp, v, m)
                    except ScheduleError as exc:
                        state.refuse(config, name, exc, count)
                        continue
                    try:
                        costs = state.costs(config).with_copies(shape.sample)
                    except ScheduleError:
                        state.ranking.refused += count
                        continue
                    weights = [0.0] * pp  # per rank, a copy's (dualpipe) included
                    for s, r in enumerate(shape.placement):
                        weights[r] += costs.stages[s].weights
                    may_fit = max(weights) <= state.limit
                    yield _Job(config, name, shape, shape.bound(costs, m), may_fit)


def _with_ep(
    grid: Sequence[Layout], ep_options: Sequence[int]
) -> Iterator[tuple[int, int, int, int, int]]:
    """The grid's (pp, dp, tp, cp) with each expert-parallel degree that divides dp."""
    for pp, dp, tp, cp in grid:
        for ep in ep_options:
            if dp % ep == 0:
                yield pp, dp, tp, cp, ep


def search(
    *,
    gpus: int,
    layers: int,
    global_batch: int,
    costs_for: CostFactory,
    memory: float | None,
    schedules: Sequence[str],
    microbatch_sizes: Sequence[int],
    flops_per_sample: float,
    peak_flops: float,
    seq: int,
    progress: Callable[[str], None] | None = None,
    top: int = 10,
    chunks: Sequence[int] = (2,),
    pp_options: Sequence[int] | None = None,
    dp_options: Sequence[int] | None = None,
    tp_options: Sequence[int] = (1,),
    ep_options: Sequence[int] = (1,),
    cp_options: Sequence[int] = (1,),
    prune: bool = True,
    auto_runs: int = 3,
    auto_budget: float = 2.0,
    costs_for_schedule: ScheduleCosts | None = None,
) -> Ranking:
    """Rank the ways to run a model on ``gpus`` accelerators by simulated step time.

    Args:
        layers: the model's layers; no stage count above it is considered.
        global_batch: samples (sequences) per step, over all replicas.
        costs_for: the cost model of a :class:`Config` (times in seconds).  It sets
            ``dp`` / ``dp_latency`` / ``dp_bandwidth`` so the all-reduce is priced.
        memory: per-rank limit in the cost model's memory unit (None: no limit).
        schedules: generator names; ``"auto"`` runs :func:`zeropipe.core.schedules.auto.search`
            for the ``auto_runs`` best configurations that could enter the top
            (each within ``auto_budget`` seconds of list scheduling).
        microbatch_sizes: samples per microbatch to try.
        flops_per_sample, peak_flops: for MFU (``flops_per_sample x global_batch /
            (step_time x gpus x peak_flops)``); 0 gives NaN.
        seq: tokens per sample, for tokens per second (0 gives NaN).
        progress: called with a line about every second of work.
        top: how many candidates to return.
        chunks: chunks per rank for generators that take any (interleaved).
        pp_options, dp_options: pipeline depths and data-parallel degrees to consider
            (default: every one that divides the GPUs).
        tp_options: tensor-parallel degrees to consider (default 1: none); the cost
            factory refuses (:class:`ScheduleError`, counted as refused) those the model
            or the node cannot take.  ``gpus`` = pp x dp x tp.
        ep_options: expert-parallel degrees to consider for a mixture of experts (default
            1): the routed experts sharded over ep of the dp replicas (ep inside dp, as
            Megatron-LM and torchtitan lay it out); those not dividing dp are skipped,
            those the model cannot take are refused by the cost factory.
        cp_options: context-parallel degrees (default 1): each sequence over cp GPUs, the
            batch over dp only (``gpus`` = pp x dp x tp x cp); refused as tp is.
        prune: False prices every configuration (slow; the ranking is the same).
        costs_for_schedule: when given, each schedule is priced under the cost model
            it returns for it (e.g. :func:`schedule_cut`: its own cut of measured
            layers) rather than ``costs_for``'s, which then only orders the work.
            Bounds from ``costs_for`` do not hold for other cuts: nothing is pruned.

    Returns:
        a :class:`Ranking`: fitting candidates first, each group by step time.

    Raises:
        ScheduleError: bad arguments, an unknown schedule, or nothing to price.
    """
    start = time.perf_counter()
    _check_arguments(gpus, layers, global_batch, top, schedules, microbatch_sizes)
    grid = layout_grid(gpus, layers, pp_options, dp_options, tp_options, ep_options, cp_options)
    workload = _Workload(global_batch, seq, flops_per_sample, gpus, peak_flops)
    state = _Search(costs_for, costs_for_schedule, memory, top, layers, workload, prune, ep_options)
    named = sorted(_jobs(state, grid, schedules, microbatch_sizes, chunks), key=_Job.order)
    report = _Progress(state.ranking, progress)
    _price_named(state, named, report)
    if "auto" in schedules:
        _search_auto(state, grid, microbatch_sizes, auto_runs, auto_budget, report)
    refused = state.finish(start)
    if not state.ranking.candidates:
        raise _nothing_to_price(gpus, layers, global_batch, microbatch_sizes, grid, refused)
    return state.ranking


def _check_arguments(
    gpus: int,
    layers: int,
    global_batch: int,
    top: int,
    schedules: Sequence[str],
    microbatch_sizes: Sequence[int],
) -> None:
    """Refuse what :func:`search` cannot take, naming the argument and its value."""
    for name, value in (("gpus", gpus), ("layers", layers), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a whole number >= 1, got {value!r}")
    if top < 1:
        raise ScheduleError(f"top must be >= 1, got {top}")
    if "auto" in schedules:
        from zeropipe.core.schedules import auto  # noqa: F401  (registers "auto" for the check)
    unknown = [s for s in schedules if s not in GENERATORS]
    if unknown:
        raise ScheduleError(
            f"unknown schedule(s) {', '.join(unknown)}; known: {', '.join(sorted(GENERATORS))}"
        )
    if not microbatch_sizes or min(microbatch_sizes) < 1:
        raise ScheduleError(f"microbatch sizes must be >= 1, got {list(microbatch_sizes)}")


class _Progress:
    """Tells ``progress`` (when given) how the search goes, at most once a second."""

    def __init__(self, ranking: Ranking, progress: Callable[[str], None] | None) -> None:
        self.ranking, self.progress = ranking, progress
        self.last = time.perf_counter()

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.progress is None or now - self.last < 1.0:
            return
        self.last = now
        ranking, best = self.ranking, self.ranking.best
        so_far = (
            f"best {best.step_time:.4g} s ({best.schedule}, pp {best.pp} tp {best.tp})"
            if best
            else "-"
        )
        self.progress(
            f"{done}/{total} {what}; {ranking.priced} priced, {ranking.pruned} pruned; {so_far}"
        )


def _price_named(state: _Search, jobs: list[_Job], report: _Progress) -> None:
    """Price the named schedules' jobs, given in order of their bounds, into the top; with
    pruning, stop at the first whose bound cannot enter it."""
    for n, job in enumerate(jobs):
        if state.prune and state.beaten(job.may_fit, job.bound):
            # Jobs come in bound order and the bar only drops: none after this can enter.
            state.ranking.pruned += len(jobs) - n
            break
        c = job.config
        report(
            f"pricing pp {c.pp} dp {c.dp} tp {c.tp} mbs {c.microbatch_size} {job.schedule}",
            n,
            len(jobs),
        )
        cand = state.price(job) if state.prune else _price_unpruned(state, job)
        if cand is not None:
            state.add(cand)


def _price_unpruned(state: _Search, job: _Job) -> Candidate | None:
    saved, state.top = state.top, 1 << 30  # nothing is ever beaten
    try:
        return state.price(job)
    finally:
        state.top = saved


def _search_auto(
    state: _Search,
    grid: Sequence[Layout],
    microbatch_sizes: Sequence[int],
    runs: int,
    budget: float,
    report: _Progress,
) -> None:
    """Run auto for the ``runs`` configurations (one chunk) with the best bounds, each
    within ``budget`` seconds.  A configuration's bound is the least, with backward split,
    of the placements auto may choose (one chunk, interleaved or V with two, dualpipe's
    two directions), which are priced like the named schedules that use them."""
    groups: dict[Config, list[_Job]] = {}
    placements = ("1f1b", "interleaved-1f1b", "zbv", "dualpipe")
    for job in _jobs(state, grid, placements, microbatch_sizes, (2,), count=False):
        groups.setdefault(replace(job.config, stages=job.config.pp), []).append(job)
    order = []
    for config, jobs in groups.items():
        bound = min(
            j.shape.bound(
                state.costs(j.config).with_copies(j.shape.sample), config.microbatches, split=True
            )
            for j in jobs
        )
        may_fit = any(j.may_fit for j in jobs)
        order.append(_Job(config, "auto", jobs[0].shape, bound, may_fit))
    order.sort(key=_Job.order)
    state.ranking.considered += len(order)
    tried = skipped = 0
    for job in order:
        if state.prune and state.beaten(job.may_fit, job.bound):
            state.ranking.pruned += 1
            continue
        if tried >= runs:
            skipped += 1
            continue
        tried += 1
        report(f"auto on pp {job.config.pp} mbs {job.config.microbatch_size}", tried, runs)
        cand = state.price_auto(job.config, budget)
        if cand is not None:
            state.add(cand)
    if skipped:
        state.ranking.notes.append(
            f"auto ran for the {tried} configuration(s) with the best bounds; {skipped} other(s) "
            f"that might have entered the top were not searched (auto_runs={runs})"
        )


def _nothing_to_price(
    gpus: int,
    layers: int,
    batch: int,
    sizes: Sequence[int],
    grid: Sequence[Layout],
    refused: Sequence[str],
) -> ScheduleError:
    """Why nothing was priced: the generators' refusals when they said why, else the grid."""
    if refused:
        return ScheduleError("nothing to price: " + "; ".join(refused))
    if not grid:
        return ScheduleError(
            f"no configuration to price for {gpus} GPU(s) and {layers} layers: no pp x dp x tp "
            f"= {gpus} / cp with pp <= {layers} among the pp, dp, tp and cp options given; give "
            f"options whose product can be {gpus}"
        )
    least = min(layout[1] for layout in grid)
    return ScheduleError(
        f"no configuration to price for {gpus} GPU(s), {layers} layers and a global batch of "
        f"{batch}: the batch must split into dp replicas x microbatches of size {list(sizes)}, "
        f"with dp = gpus / (pp x tp x cp), pp <= {layers} (so dp >= {least} here); make the global "
        f"batch a multiple of {least} x a microbatch size, or use fewer GPUs"
    )
