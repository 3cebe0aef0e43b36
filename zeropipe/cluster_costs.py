"""Where the cluster search's costs come from: a :class:`Config` (one way to run the
model) and the cost factories that price it, from specs (:func:`spec_costs`) or from
one measured cost model (:func:`fixed_costs`).  No torch here: this is core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from zeropipe.costs import CostModel, StageCost
from zeropipe.errors import ScheduleError
from zeropipe.specs import DEFAULT_STATE_BYTES, HardwareSpec, ModelSpec

__all__ = ["HOST_BANDWIDTH", "Config", "CostFactory", "fixed_costs", "spec_costs"]


@dataclass(frozen=True)
class Config:
    """One way to run the model: what a cost factory needs to price it."""

    pp: int
    dp: int
    microbatch_size: int
    microbatches: int
    stages: int  # pp x chunks: the model is cut into this many stages
    recompute: bool = False  # price R and what a checkpointed forward keeps

    @property
    def chunks(self) -> int:
        return self.stages // self.pp


CostFactory = Callable[[Config], CostModel]


#: bytes/s an activation offload moves to host memory and back (PCIe 5.0 x16 gives ~64
#: GB/s each way in theory; a pinned copy reaches about half).  The specs do not price
#: offload yet; without a figure it would be free and win every memory plan.
HOST_BANDWIDTH = 25e9


def spec_costs(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    seq: int,
    dtype: str = "bf16",
    efficiency: float | None = None,
    host_bandwidth: float = HOST_BANDWIDTH,
    shard_optimizer: bool = False,
) -> CostFactory:
    """The cost factory :func:`search` takes, from a model and an accelerator spec:
    :meth:`CostModel.from_spec` for each configuration (the one place the planner
    meets the specs), with activation offload priced at ``host_bandwidth``.

    ``shard_optimizer``: the fp32 master weights and Adam moments (12 of the 18 bytes
    per parameter) are sharded over the data-parallel replicas (ZeRO-1, a distributed
    optimizer), so a rank keeps ``6 + 12 / dp`` bytes per parameter.
    """

    def costs_for(config: Config) -> CostModel:
        state = 6.0 + 12.0 / config.dp if shard_optimizer else DEFAULT_STATE_BYTES
        costs = CostModel.from_spec(
            model, hardware, stages=config.stages, seq=seq,
            microbatch_size=config.microbatch_size, dtype=dtype, efficiency=efficiency,
            recompute=config.recompute, pp=config.pp, dp=config.dp, state_bytes=state,
        )  # fmt: skip
        copy = [s.act / host_bandwidth for s in costs.stages]
        stages = tuple(
            replace(s, OFFLOAD=t, RELOAD=t, weight_copy=s.weights / host_bandwidth)
            for s, t in zip(costs.stages, copy, strict=True)
        )
        # from_spec's times are seconds; saying so labels the plotted axis.
        return replace(costs, stages=stages, meta={**costs.meta, "time_unit": "s"})

    return costs_for


def fixed_costs(costs: CostModel) -> CostFactory:
    """A cost factory from one cost model (e.g. what ``zeropipe profile`` wrote).

    A configuration with as many stages gets it as it is (``dp`` set); one with a
    divisor of that many gets consecutive stages merged, one with a multiple gets each
    stage cut into equal parts (:meth:`StageCost.scaled`), so schedules with one and
    with two chunks per rank can be compared on the same measurement.
    """
    have = len(costs.stages)

    def costs_for(config: Config) -> CostModel:
        want = config.stages
        if want == have:
            stages = costs.stages
        elif want < have and have % want == 0:
            k = have // want
            stages = tuple(StageCost.merged(costs.stages[i : i + k]) for i in range(0, have, k))
        elif want % have == 0:
            k = want // have
            stages = tuple(s.scaled(1 / k) for s in costs.stages for _ in range(k))
        else:
            raise ScheduleError(
                f"the cost model has {have} stage(s); {want} cannot be made of them "
                f"(give a divisor or a multiple of {have})"
            )
        return replace(costs, stages=stages, dp=config.dp)

    return costs_for
