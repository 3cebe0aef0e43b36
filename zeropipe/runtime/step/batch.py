"""A step's batch cut into microbatches, and what the step's boundary shapes follow."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.runtime.step.stage import as_tuple

__all__ = ["forward_only", "split_batch", "split_step", "split_target", "step_signature"]


def split_batch(inputs: tuple[Tensor, ...], m: int) -> tuple[list[tuple[Tensor, ...]], list[int]]:
    """``inputs`` cut into ``m`` microbatches along dim 0, and the microbatches' row counts."""
    for k, t in enumerate(inputs):
        if t.dim() == 0:
            name = "the input" if len(inputs) == 1 else f"input {k}"
            raise PipelineError(
                f"{name} is 0-dimensional (a scalar); the batch is cut into microbatches along "
                f"dim 0, so give it a batch dimension (e.g. x.reshape(1) or x.unsqueeze(0))"
            )
    batch = len(inputs[0])
    if any(len(t) != batch for t in inputs):
        raise PipelineError(f"inputs disagree on the batch size: {[len(t) for t in inputs]}")
    if batch < m:
        raise PipelineError(
            f"a batch of {batch} cannot be cut into {m} microbatches; use a larger batch"
        )
    parts = [torch.tensor_split(t, m, dim=0) for t in inputs]
    micro = [tuple(p[i] for p in parts) for i in range(m)]
    return micro, [len(mb[0]) for mb in micro]


def split_target(target: Tensor, m: int, sizes: list[int]) -> list[Tensor]:
    """``target`` cut like the inputs: one row per input row."""
    if not isinstance(target, Tensor):
        raise PipelineError(f"target must be a tensor, got {type(target).__name__}")
    if target.dim() == 0:
        raise PipelineError(
            "the target is 0-dimensional (a scalar); it is cut into microbatches along dim 0 "
            "like the inputs, so give it one row per input row (e.g. y.reshape(1))"
        )
    targets = list(torch.tensor_split(target, m, dim=0))
    if [len(t) for t in targets] != sizes:
        raise PipelineError(f"target has {len(target)} rows but inputs have {sum(sizes)}")
    return targets


def split_step(
    inputs: Tensor | Sequence[Tensor], target: Tensor | None, m: int, device: torch.device | None
) -> tuple[list[tuple[Tensor, ...]], list[int], list[Tensor] | None]:
    """A step's inputs and target, on ``device`` (when given), cut into ``m`` microbatches."""
    if device is not None:  # the caller's batch, on the device the stages compute on
        inputs = tuple(t.to(device) for t in as_tuple(inputs, "inputs"))
        if isinstance(target, Tensor):
            target = target.to(device)
    micro_inputs, sizes = split_batch(as_tuple(inputs, "inputs"), m)
    targets = None if target is None else split_target(target, m, sizes)
    return micro_inputs, sizes, targets


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards and their transfers: what ``eval_step`` runs."""
    # Weight copies stay: an offloaded stage must still have its weights to run F.
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return schedule.replace_actions(
        [[a for a in acts if a.kind in keep or a.is_weight_copy] for acts in schedule.actions]
    )


def step_signature(
    micro_inputs: list[tuple[Tensor, ...]], target: Tensor | None
) -> tuple[object, ...]:
    """The shapes and dtypes of a step's microbatches and target (what boundary shapes follow)."""
    first, last = micro_inputs[0], micro_inputs[-1]
    meta = tuple((t.dtype, tuple(t.shape)) for t in (*first, *last))
    return (meta, None if target is None else (target.dtype, tuple(target.shape)))
