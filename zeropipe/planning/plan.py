"""Planning: from a model to the schedule and the cut to run it with.

    model ──profile each layer──► layer costs ──balance (per chunk count)──► stage costs
                                                                                │
    Plan(schedule, balance, costs, explanation) ◄──────── auto search ◄─────────┘

Profiling is :mod:`zeropipe.planning.profiling`; the cut is the pure
:func:`zeropipe.planning.balance.balance`; the search is
:func:`zeropipe.core.schedules.auto.search`.  This module joins them, and adds the
two things that need the runtime: the runtime's own cost per action (it runs
a tiny :class:`~zeropipe.runtime.pipeline.Pipeline`), and, in a distributed
job, agreement -- every process profiles (measuring the wire between ranks 0 and
1 takes both), but only process 0's plan is used, broadcast as text to every
process of the job, so all ranks, replicas and tensor-parallel peers run the
same schedule with the same cut::

    plan = zeropipe.auto_plan(model, ranks=2, microbatches=8, sample=(x, y), loss_fn=F.mse_loss)
    pipe = zeropipe.Pipeline(model, plan.schedule, loss_fn=F.mse_loss, balance=plan.balance)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from zeropipe.autograd.split_backward import prepare_split
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.schedules.auto import auto_schedule, search
from zeropipe.planning.balance import balance, stage_costs
from zeropipe.planning.profiling import (
    Sample,
    StageProbe,
    profile_stages,
    sample_parts,
    synchronize,
)
from zeropipe.runtime.pipeline import Pipeline

__all__ = [
    "Plan",
    "auto_plan",
    "balance_by_time",
    "layer_costs",
    "plan_model",
    "profile",
    "runtime_overhead",
]

LossFn = Callable[..., Tensor]


@dataclass
class Plan:
    """A schedule for a model, the cut that goes with it, its cost model, and why.

    ``balance`` is the layers per stage of an ``nn.Sequential`` (pass it to
    :class:`~zeropipe.runtime.pipeline.Pipeline`), or ``None`` when the plan
    was searched under given costs and keeps the caller's cut.
    """

    schedule: Schedule
    balance: list[int] | None
    costs: CostModel
    explanation: str


def profile(
    stages: Sequence[nn.Module],
    sample: Sample,
    *,
    target: Tensor | None = None,
    loss_fn: LossFn | None = None,
    warmup: int = 2,
    repeat: int = 7,
    threads: int | None = 1,
    weights: bool = False,
    process_group: Any | None = None,
) -> CostModel:
    """Every stage's costs (:func:`zeropipe.planning.profiling.profile_stages`) and the runtime's overhead.

    ``sample`` is one microbatch as :func:`auto_plan` takes its batch:
    ``(inputs, target)`` with ``loss_fn=`` -- ``inputs`` a tensor, or a tuple of
    the first stage's positional inputs -- so ``profile(stages, (x, y),
    loss_fn=F.mse_loss)`` scores the last stage's output against ``y``.  The
    inputs alone also do, with ``target=`` given apart or without a loss (the
    last stage's backward then starts from a gradient of ones).  A sample the
    first stage's forward cannot take is a one-line :class:`PipelineError`.

    ``overhead`` is what the runtime's bookkeeping adds to each compute action
    (:func:`runtime_overhead`); the simulator charges it, so schedules of many
    small actions are not taken for free.
    """
    costs = profile_stages(
        stages,
        sample,
        target=target,
        loss_fn=loss_fn,
        warmup=warmup,
        repeat=repeat,
        threads=threads,
        weights=weights,
        process_group=process_group,
    )
    device = torch.device(str(costs.meta["device"]))
    return replace(costs, overhead=runtime_overhead(device, warmup, repeat, threads))


def runtime_overhead(
    device: torch.device, warmup: int = 2, repeat: int = 7, threads: int | None = 1
) -> float:
    """Seconds the runtime adds to each compute action beyond the stage's own work.

    A one-stage pipeline of a near-empty layer runs ``m`` microbatches (2m
    actions); what its fastest step takes beyond the same layer's fastest F, I and W
    measured bare is the runtime's bookkeeping, per action.
    """
    m = 8
    layer = nn.Linear(1, 1).to(device)
    x = torch.zeros(m, 1, device=device)
    loss_fn = torch.nn.functional.mse_loss
    old_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        pipe = Pipeline([layer], "1f1b", loss_fn=loss_fn, microbatches=m, mesh="local")
        prepare_split(layer)  # the probe times F, I and W apart
        probe = StageProbe(layer, (x[:1],), (loss_fn, x[:1]), set(), device, last=True)
        steps = []
        # The bare layer's repetitions interleave with the pipeline's, so that load on a
        # shared machine shifts both alike instead of one median.
        for rep in range(warmup + repeat):
            synchronize(device)
            t0 = time.perf_counter()
            pipe.step(x, x)
            synchronize(device)
            if rep >= warmup:
                steps.append(time.perf_counter() - t0)
            layer.zero_grad(set_to_none=True)
            probe.run(timed=rep >= warmup)
    finally:
        torch.set_num_threads(old_threads)
    # The fastest of each: load on a shared machine only ever adds time, and a median of a
    # few steps against medians of the bare layer could swallow the bookkeeping whole.
    bare = sum(min(probe.times[k]) for k in ("F", "I", "W"))
    per_action = (min(steps) - m * bare) / (2 * m)
    return max(per_action, 0.0)


def layer_costs(
    model: nn.Sequential,
    sample: Sample,
    *,
    target: Tensor | None = None,
    loss_fn: LossFn | None = None,
    **options: Any,
) -> CostModel:
    """Profile every layer of ``model`` as its own stage (see :func:`profile`)."""
    return profile(list(model.children()), sample, target=target, loss_fn=loss_fn, **options)


def balance_by_time(
    model: nn.Sequential,
    sample: Sample,
    parts: int,
    *,
    target: Tensor | None = None,
    loss_fn: LossFn | None = None,
    memory_limit: float | None = None,
    **options: Any,
) -> list[int]:
    """Profile each layer (forward + full backward) and :func:`balance` the model into ``parts``.

    ``memory_limit`` caps each stage's activation bytes per microbatch.
    """
    costs = layer_costs(model, sample, target=target, loss_fn=loss_fn, **options)
    times = [c.F + c.time(Kind.B) for c in costs.stages]
    memory = [c.act for c in costs.stages] if memory_limit is not None else None
    return balance(times, parts, memory=memory, memory_limit=memory_limit)


def plan_model(
    model: nn.Sequential,
    sample: Sample,
    ranks: int,
    microbatches: int,
    *,
    target: Tensor | None = None,
    loss_fn: LossFn | None = None,
    memory_limit: float | Sequence[float] | None = None,
    layers: CostModel | None = None,
    max_chunks: int = 2,
    **options: Any,
) -> Plan:
    """Profile ``model`` layer by layer, then search schedules, each cut balanced for its stages.

    For every chunk count ``v`` the search considers, the model is balanced
    into ``ranks * v`` stages by measured forward + backward time and the
    stages' costs are the sums of their layers'.  ``layers`` skips the
    profiling (per-layer costs measured before); ``memory_limit`` is in bytes
    of activations per rank; ``options`` go to :func:`profile`.
    """
    if layers is None:
        layers = layer_costs(model, sample, target=target, loss_fn=loss_fn, **options)
    times = [c.F + c.time(Kind.B) for c in layers.stages]
    n = len(layers.stages)
    cuts: dict[int, list[int]] = {}

    def costs(num_stages: int) -> CostModel | None:
        if num_stages > n:
            return None  # a stage needs at least one layer
        cuts[num_stages] = cut = balance(times, num_stages)
        return stage_costs(layers, cut)

    if n < ranks:
        raise PipelineError(f"the model has {n} layer(s), too few for {ranks} ranks")
    most = max(1, min(max_chunks, n // ranks))
    result = search(costs, ranks, microbatches, memory_limit, max_chunks=most)
    cut = cuts[result.schedule.num_stages - len(result.schedule.copies)]  # dualpipe: copies
    return Plan(result.schedule, cut, result.costs, result.explanation + f"; cut {cut}")


def auto_plan(
    model: nn.Sequential | Sequence[nn.Module],
    ranks: int,
    microbatches: int,
    *,
    costs: CostModel | None = None,
    sample: Sample | None = None,
    loss_fn: LossFn | None = None,
    memory_limit: float | None = None,
    process_group: Any | None = None,
) -> Plan:
    """The schedule (and cut) the auto search picks for ``model``.

    With ``costs`` (a :class:`~zeropipe.core.costs.CostModel`, e.g. saved by
    ``zeropipe profile``) the search runs at once and the cut is the caller's
    (``balance=None``).  Otherwise the model (an ``nn.Sequential``) is
    profiled layer by layer on the first microbatch of ``sample`` and balanced
    for each candidate chunk count (:func:`plan_model`).  ``sample`` is the
    batch as :func:`profile` takes a microbatch: ``(inputs, target)`` with
    ``loss_fn=`` (``inputs`` a tensor or a tuple of the first stage's inputs),
    or the inputs alone (``(inputs, None)`` or ``inputs``) without a loss.
    ``memory_limit`` is per rank, in the cost model's unit.

    When torch.distributed is initialised with more than one process, call this
    on every process of the job: each profiles (``process_group``: the pipeline's
    group, whose ranks 0 and 1 measure the wire), process 0's plan is broadcast to
    every process (replicas and tensor-parallel peers included), and every process
    returns the same plan.
    """
    if ranks < 1 or microbatches < 1:
        raise PipelineError(f"ranks and microbatches must be >= 1, got {ranks}, {microbatches}")
    if costs is not None:
        schedule, why = auto_schedule(costs, ranks, microbatches, memory_limit)
        return Plan(schedule, None, costs, why)
    if sample is None:
        raise PipelineError(
            "auto_plan needs costs= (a CostModel, e.g. from `zeropipe profile`) or "
            "sample=(inputs, target) to profile the model on"
        )
    if not isinstance(model, nn.Sequential):
        raise PipelineError(
            "auto_plan without costs= profiles an nn.Sequential layer by layer; "
            "pass costs= for a list of stage modules"
        )
    inputs, target = sample_parts(sample, loss_fn=loss_fn)
    first = tuple(torch.tensor_split(t, microbatches)[0] for t in inputs)
    tgt = None if target is None else torch.tensor_split(target, microbatches)[0]
    result = plan_model(
        model,
        first,
        ranks,
        microbatches,
        target=tgt,
        loss_fn=loss_fn,
        memory_limit=memory_limit,
        process_group=process_group,
    )
    if not _several_processes(None):
        return result
    # Profiles differ slightly between processes: process 0's plan is everyone's, over the
    # whole job and not only this pipeline's group, because the pipelines of other replicas
    # and of the other ranks of a tensor-parallel group must run the same schedule and cut
    # (tensor-parallel peers running different ones would pair up the wrong collectives).
    message: list[object] = [
        (result.schedule.to_text(), result.balance, result.explanation, result.costs)
    ]
    torch.distributed.broadcast_object_list(message, src=0)
    text, cut, why, planned = cast(tuple[str, list[int], str, CostModel], message[0])
    return Plan(Schedule.from_text(text), cut, planned, why)


def _several_processes(group: Any | None) -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
