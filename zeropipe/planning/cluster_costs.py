"""What the cluster search prices and what it gives back: the layouts it enumerates
(:func:`layout_grid`: pp x dp x tp x cp), a :class:`Config` (one way to
run the model), the cost factories that price it, from specs (:func:`spec_costs`) or
from one measured cost model (:func:`fixed_costs`), and each priced configuration as a
:class:`Candidate` in the :class:`Ranking` the search returns.  No torch here: this is core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.simulate import Timeline
from zeropipe.planning.balance import balance, balance_schedule, stage_costs
from zeropipe.planning.pricing.transformer import Kernels
from zeropipe.planning.specs import (
    DEFAULT_GRAD_BYTES,
    DEFAULT_STATE_BYTES,
    HardwareSpec,
    ModelSpec,
    costs_from_spec,
)

__all__ = [
    "Candidate",
    "Config",
    "CostFactory",
    "Layout",
    "Ranking",
    "ScheduleCosts",
    "divisors",
    "fixed_costs",
    "layout_grid",
    "layouts",
    "schedule_cut",
    "spec_costs",
]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    gpus: int,
    layers: int,
    pp_options: Sequence[int] | None = None,
    dp_options: Sequence[int] | None = None,
    tp_options: Sequence[int] = (1,),
) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) with pp x dp x tp = ``gpus`` and pp <= ``layers`` that the
    options allow (None: any divisor)."""
    out = []
    for tp in tp_options:
        if gpus % tp:
            continue
        rest = gpus // tp
        for pp in pp_options or divisors(rest):
            dp = rest // pp
            if pp <= layers and rest % pp == 0 and (dp_options is None or dp in dp_options):
                out.append((pp, dp, tp))
    return out


#: A placement of the grid: (pp, dp, tp, cp).
Layout = tuple[int, int, int, int]


def layout_grid(
    gpus: int,
    layers: int,
    pp_options: Sequence[int] | None,
    dp_options: Sequence[int] | None,
    tp_options: Sequence[int],
    ep_options: Sequence[int],
    cp_options: Sequence[int],
) -> list[Layout]:
    """Every (pp, dp, tp, cp) with pp x dp x tp x cp = ``gpus`` the options allow, the options
    checked first (ep's too: the jobs pair each layout with the eps that divide its dp)."""
    _check_options(pp=pp_options, dp=dp_options, tp=tp_options, ep=ep_options, cp=cp_options)
    return [
        (pp, dp, tp, cp)
        for cp in cp_options
        if gpus % cp == 0
        for pp, dp, tp in layouts(gpus // cp, layers, pp_options, dp_options, tp_options)
    ]


def _check_options(**options: Sequence[int] | None) -> None:
    """Refuse an empty list of pp, dp, tp, ep or cp options, or one below 1 (None: any)."""
    for name, values in options.items():
        if values is not None and (not values or min(values) < 1):
            raise ScheduleError(f"{name} options must be whole numbers >= 1, got {values!r}")


@dataclass(frozen=True)
class Config:
    """One way to run the model: what a cost factory needs to price it."""

    pp: int
    dp: int
    microbatch_size: int
    microbatches: int
    stages: int  # pp x chunks: the model is cut into this many stages
    recompute: bool = False  # price R and what a checkpointed forward keeps
    tp: int = 1  # GPUs per stage (tensor parallel): pp x dp x tp GPUs in all
    ep: int = 1  # replicas sharing a stage's routed experts (expert parallel, inside dp)
    cp: int = 1  # GPUs sharing each sequence (context parallel): pp x dp x cp x tp GPUs

    @property
    def chunks(self) -> int:
        return self.stages // self.pp


CostFactory = Callable[[Config], CostModel]
# The cost model of a configuration as one schedule runs it (its own cut of the layers).
ScheduleCosts = Callable[[Config, Schedule], CostModel]


@dataclass(frozen=True)
class Candidate:
    """One configuration, priced.  Times in seconds, memory in the cost model's unit
    (bytes for a spec); ``tokens_per_second`` and ``mfu`` are NaN when not known.
    ``tp``: GPUs per stage (tensor parallel); pp x dp x tp GPUs in all; ``ep``: of the dp
    replicas, those sharing the routed experts of a mixture of experts; ``cp``: GPUs sharing
    each sequence (context parallel), pp x dp x cp x tp GPUs (each written only when above
    1)."""

    pp: int
    dp: int
    microbatch_size: int
    microbatches: int
    chunks: int
    schedule: str
    memory_plan: str
    step_time: float
    tokens_per_second: float
    mfu: float
    bubble: float
    peak_memory: float
    fits: bool
    tp: int = 1
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    ep: int = 1
    cp: int = 1

    def key(self) -> tuple[bool, float, float, int, int, int, int, int, str]:
        """Rank order: fitting first, then the shortest step (ties: less memory)."""
        return (
            not self.fits,
            self.step_time,
            self.peak_memory,
            self.pp,
            self.tp,
            self.ep,
            self.cp,
            self.chunks,
            self.schedule,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, timeline=None))
        del out["timeline"]
        for name in ("ep", "cp"):  # a plan without them reads as it always has
            if out[name] == 1:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        names = {f.name for f in fields(cls)} - {"timeline"}
        missing = sorted(names - set(data) - {"tp", "ep", "cp"})  # not written: 1
        if missing:
            raise ScheduleError(f"a plan candidate needs {', '.join(missing)}", rule="syntax")
        return cls(**{k: data[k] for k in names if k in data})


@dataclass
class Ranking:
    """What :func:`~zeropipe.planning.cluster.search` found, and how much of the grid it
    had to price."""

    candidates: list[Candidate]  # best first, at most ``top``
    considered: int = 0  # configurations enumerated (schedule x chunks included)
    refused: int = 0  # a generator or the cost model could not take them
    priced: int = 0  # built and simulated
    pruned: int = 0  # their lower bound could not enter the top
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def spec_costs(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    seq: int,
    dtype: str = "bf16",
    efficiency: float | None = None,
    shard_optimizer: bool = False,
    attention: str = "flash",
    dropout: bool = False,
    sequence_parallel: bool = True,
    tp_across_nodes: bool = False,
    grad_bytes: float = DEFAULT_GRAD_BYTES,
    fsdp: bool = False,
    kernels: Kernels | None = None,
    checkpoint_blocks: bool = False,
) -> CostFactory:
    """The cost factory :func:`~zeropipe.planning.cluster.search` takes, from a model and an
    accelerator spec: :func:`zeropipe.planning.specs.costs_from_spec` for each configuration
    (the one place the planner meets the specs).

    ``shard_optimizer``: the fp32 master weights and Adam moments (12 of the 18 bytes
    per parameter) are sharded over the data-parallel replicas (ZeRO-1, a distributed
    optimizer), so a rank keeps ``6 + 12 / dp`` bytes per parameter.  ``attention`` and
    ``dropout``: how the blocks run (:func:`zeropipe.planning.specs.price_stages`).  A
    configuration's ``tp`` GPUs per stage run with ``sequence_parallel`` or not, inside a
    node unless ``tp_across_nodes`` (:mod:`zeropipe.planning.pricing.tensor_parallel`);
    ``grad_bytes``: bytes per parameter the gradient all-reduce moves.

    A mixture of experts' routed experts are sharded over ``config.ep`` replicas; their
    sharded state is divided by the ``dp / ep`` replicas that hold the same experts.
    ``fsdp`` (FSDP, ZeRO-3) shards the weights, gradients and optimizer state alike
    (``18 / dp`` bytes per parameter, ``18 / (dp / ep)`` per expert weight); its gradients
    are reduce-scattered once a step (half an all-reduce's bytes) and its weights'
    all-gathers are taken as prefetched under compute (not priced).

    ``config.cp`` GPUs share each sequence (context parallel: ring attention,
    :mod:`zeropipe.planning.pricing.context_parallel`); gradients are reduced, and the
    optimizer or FSDP sharded, over the ``dp x cp`` ranks holding a stage.  ``kernels``: how
    attention, the linears and cp's ring run (:class:`~zeropipe.planning.pricing.transformer.Kernels`).
    ``checkpoint_blocks``: every block checkpointed on its own inside its stage
    (:mod:`zeropipe.planning.specs`); the planner's own recompute (R) still comes on top
    where memory needs it.
    """

    def costs_for(config: Config) -> CostModel:
        state, expert_state = _state_bytes(config, shard_optimizer=shard_optimizer, fsdp=fsdp)
        return costs_from_spec(
            model,
            hardware,
            stages=config.stages,
            seq=seq,
            microbatch_size=config.microbatch_size,
            dtype=dtype,
            efficiency=efficiency,
            recompute=config.recompute,
            pp=config.pp,
            dp=config.dp,
            state_bytes=state,
            attention=attention,
            dropout=dropout,
            tp=config.tp,
            sequence_parallel=sequence_parallel,
            tp_across_nodes=tp_across_nodes,
            grad_bytes=grad_bytes / 2 if fsdp else grad_bytes,
            ep=config.ep,
            expert_state_bytes=expert_state,
            cp=config.cp,
            kernels=kernels,
            checkpoint_blocks=checkpoint_blocks,
        )

    return costs_for


def _state_bytes(config: Config, *, shard_optimizer: bool, fsdp: bool) -> tuple[float, float]:
    """Bytes of weight, gradient and Adam state per parameter, and per routed-expert weight
    (sharded over the ``dp / ep`` replicas that hold the same experts)."""
    expert_replicas, group = config.dp // config.ep, config.dp * config.cp
    if fsdp:
        return DEFAULT_STATE_BYTES / group, DEFAULT_STATE_BYTES / expert_replicas
    if shard_optimizer:
        return 6.0 + 12.0 / group, 6.0 + 12.0 / expert_replicas
    return DEFAULT_STATE_BYTES, DEFAULT_STATE_BYTES


def fixed_costs(costs: CostModel) -> CostFactory:
    """A cost factory from one cost model (e.g. what ``zeropipe profile`` wrote).

    A configuration with as many stages gets it as it is (``dp`` set); one with fewer
    gets consecutive stages merged where the slowest group is fastest
    (:func:`zeropipe.planning.balance.balance`), one with a multiple gets each
    stage cut into equal parts (:meth:`StageCost.scaled`), so schedules with one and
    with two chunks per rank can be compared on the same measurement.
    """
    have = len(costs.stages)

    def costs_for(config: Config) -> CostModel:
        wider = {"tp": config.tp, "ep": config.ep, "cp": config.cp}
        what = ", ".join(f"{k} {v}" for k, v in wider.items() if v != 1)
        if what:
            raise ScheduleError(
                f"a measured cost model is one GPU per stage; it cannot price {what} "
                f"(measure the tensor-, expert- or context-parallel stages, or plan from specs)"
            )
        want = config.stages
        if want == have:
            stages = costs.stages
        elif want < have:
            # Consecutive stages merged, cut where the slowest group is fastest (as
            # `zeropipe bench --cut time` cuts measured layers), so that any count works.
            times = [s.F + s.time(Kind.B) for s in costs.stages]
            groups, start = [], 0
            for n in balance(times, want):
                groups.append(StageCost.merged(costs.stages[start : start + n]))
                start += n
            stages = tuple(groups)
        elif want % have == 0:
            k = want // have
            stages = tuple(s.scaled(1 / k) for s in costs.stages for _ in range(k))
        else:
            raise ScheduleError(
                f"the cost model has {have} stage(s); {want} cannot be made of them "
                f"(give fewer than {have}, or a multiple of {have})"
            )
        return replace(costs, stages=stages, dp=config.dp)

    return costs_for


def schedule_cut(costs: CostModel) -> ScheduleCosts:
    """Per schedule, ``costs``' layers cut where that schedule's simulated step is shortest
    (:func:`zeropipe.planning.balance.balance_schedule`), as ``zeropipe bench`` and
    ``Pipeline(balance=balance_schedule(...))`` cut them: a V or interleaved placement
    wants other cuts than one stage per rank.  Fewer layers than stages: as
    :func:`fixed_costs` (each layer cut into equal parts).  A schedule whose stages copy
    others (dualpipe): :func:`fixed_costs`' cut into its model stages, each copy costing
    what its original costs (:meth:`~zeropipe.core.costs.CostModel.with_copies`).
    """
    fallback = fixed_costs(costs)

    def costs_for(config: Config, schedule: Schedule) -> CostModel:
        if schedule.copies:
            return fallback(config).with_copies(schedule)
        if config.stages >= len(costs.stages):
            return fallback(config)
        cut = balance_schedule(costs, schedule)
        return replace(stage_costs(costs, cut), dp=config.dp)

    return costs_for
