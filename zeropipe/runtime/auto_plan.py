"""``Pipeline(..., schedule="auto")``: search a schedule from given or profiled costs.

With ``costs`` (a :class:`~zeropipe.costs.CostModel`, e.g. saved by
``zeropipe profile``) the search runs at once.  Without, the model is
profiled layer by layer on one microbatch of ``sample``, balanced into stages
for each candidate chunk count, and searched
(:func:`zeropipe.balance.plan`).  Profiles differ slightly between
processes, so in a distributed pipeline rank 0 plans and broadcasts the
schedule as *text* with the balance (every rank still profiles: measuring the
wire between ranks 0 and 1 needs both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from zeropipe.costs import CostModel
from zeropipe.errors import PipelineError
from zeropipe.ir import Schedule

__all__ = ["AutoPlan", "resolve_auto"]

AutoPlan = tuple[Schedule, list[int] | None, str]


def resolve_auto(
    stages: nn.Sequential | Sequence[nn.Module],
    ranks: int,
    microbatches: int,
    *,
    costs: CostModel | None,
    sample: tuple[Tensor | Sequence[Tensor], Tensor | None] | None,
    loss_fn: Callable[..., Tensor] | None,
    memory_limit: float | None,
    distributed: bool,
) -> AutoPlan:
    """The schedule, the layers-per-stage balance (None: keep the given cut), the explanation."""
    from zeropipe.schedules.auto import auto_schedule

    if costs is not None:
        schedule, why = auto_schedule(costs, ranks, microbatches, memory_limit)
        return schedule, None, why
    if sample is None:
        raise PipelineError(
            "schedule='auto' needs costs= (a CostModel, e.g. from `zeropipe profile`) or "
            "sample=(inputs, target) to profile the model on"
        )
    if not isinstance(stages, nn.Sequential):
        raise PipelineError(
            "schedule='auto' without costs= profiles an nn.Sequential; pass costs= for stage lists"
        )
    import torch.distributed as dist

    # Every rank profiles (the wire measurement between ranks 0 and 1 is
    # collective), but only rank 0's plan is used, so all ranks agree.
    message: list[object] = [_plan(stages, ranks, microbatches, sample, loss_fn, memory_limit)]
    if distributed:
        dist.broadcast_object_list(message, src=0)
    text, balance, why = cast(tuple[str, list[int], str], message[0])
    return Schedule.from_text(text), balance, why


def _plan(
    model: nn.Sequential,
    ranks: int,
    microbatches: int,
    sample: tuple[Tensor | Sequence[Tensor], Tensor | None],
    loss_fn: Callable[..., Tensor] | None,
    memory_limit: float | None,
) -> tuple[str, list[int], str]:
    from zeropipe.balance import plan

    inputs, target = sample
    first = (
        torch.tensor_split(inputs, microbatches)[0]
        if isinstance(inputs, Tensor)
        else [torch.tensor_split(t, microbatches)[0] for t in inputs]
    )
    tgt = None if target is None else torch.tensor_split(target, microbatches)[0]
    result = plan(
        model, first, ranks, microbatches, target=tgt, loss_fn=loss_fn, memory_limit=memory_limit
    )
    return result.schedule.to_text(), list(result.balance), result.explanation
