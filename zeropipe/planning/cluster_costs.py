"""Where the cluster search's costs come from: a :class:`Config` (one way to run the
model) and the cost factories that price it, from specs (:func:`spec_costs`) or from
one measured cost model (:func:`fixed_costs`).  No torch here: this is core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.planning.balance import balance, balance_schedule, stage_costs
from zeropipe.planning.specs import (
    DEFAULT_GRAD_BYTES,
    DEFAULT_STATE_BYTES,
    HardwareSpec,
    ModelSpec,
    costs_from_spec,
)

__all__ = ["Config", "CostFactory", "ScheduleCosts", "fixed_costs", "schedule_cut", "spec_costs"]


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

    @property
    def chunks(self) -> int:
        return self.stages // self.pp


CostFactory = Callable[[Config], CostModel]
# The cost model of a configuration as one schedule runs it (its own cut of the layers).
ScheduleCosts = Callable[[Config, Schedule], CostModel]


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
) -> CostFactory:
    """The cost factory :func:`search` takes, from a model and an accelerator spec:
    :func:`zeropipe.planning.specs.costs_from_spec` for each configuration (the one place the planner
    meets the specs).

    ``shard_optimizer``: the fp32 master weights and Adam moments (12 of the 18 bytes
    per parameter) are sharded over the data-parallel replicas (ZeRO-1, a distributed
    optimizer), so a rank keeps ``6 + 12 / dp`` bytes per parameter.  ``attention`` and
    ``dropout``: how the blocks run (:func:`zeropipe.planning.specs.price_stages`).  A
    configuration's ``tp`` GPUs per stage run with ``sequence_parallel`` or not, inside a
    node unless ``tp_across_nodes`` (:mod:`zeropipe.planning.tensor_parallel`);
    ``grad_bytes``: bytes per parameter the gradient all-reduce moves.
    """

    def costs_for(config: Config) -> CostModel:
        state = 6.0 + 12.0 / config.dp if shard_optimizer else DEFAULT_STATE_BYTES
        return costs_from_spec(
            model, hardware, stages=config.stages, seq=seq,
            microbatch_size=config.microbatch_size, dtype=dtype, efficiency=efficiency,
            recompute=config.recompute, pp=config.pp, dp=config.dp, state_bytes=state,
            attention=attention, dropout=dropout, tp=config.tp,
            sequence_parallel=sequence_parallel, tp_across_nodes=tp_across_nodes,
            grad_bytes=grad_bytes,
        )  # fmt: skip

    return costs_for


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
        if config.tp != 1:
            raise ScheduleError(
                f"a measured cost model is one GPU per stage; it cannot price tp {config.tp} "
                f"(measure the tensor-parallel stages, or plan from specs)"
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
    :func:`fixed_costs` (each layer cut into equal parts).
    """
    fallback = fixed_costs(costs)

    def costs_for(config: Config, schedule: Schedule) -> CostModel:
        if config.stages >= len(costs.stages):
            return fallback(config)
        cut = balance_schedule(costs, schedule)
        return replace(stage_costs(costs, cut), dp=config.dp)

    return costs_for
