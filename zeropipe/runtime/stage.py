"""A pipeline stage: the user's module, how it is seeded, and its per-microbatch state.

A stage is built either from a hand-made module (seeded per stage) or from a
slice of an ``nn.Sequential`` (seeded per layer, by the layer's index in the
whole model, so the same model cut into 2 or 4 stages draws the same dropout
masks).  Between its forward and its backward a microbatch's state holds::

    inputs   leaves fed to the module (float ones require grad)
    outputs  what the module returned (with graph), or the weighted loss on the last stage
    stash    deferred weight-gradient work between I and W (split backward)
    saved    what autograd saved for the backward, counted and movable (runtime.memory)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeropipe.autograd.split import WeightGradStash
from zeropipe.errors import PipelineError
from zeropipe.runtime.rng import seeded

if TYPE_CHECKING:
    from zeropipe.runtime.offload import SavedActivations

__all__ = ["MicrobatchState", "Stage", "as_tuple", "split_sequential"]


def as_tuple(value: object, what: str) -> tuple[Tensor, ...]:
    """A stage's inputs/outputs as a tuple of tensors, or a clear error."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if not isinstance(item, Tensor):
            raise PipelineError(
                f"{what} must be a tensor or a tuple of tensors, got {type(item).__name__}"
            )
    return tuple(items)


@dataclass
class MicrobatchState:
    """What one stage keeps for one microbatch between its actions."""

    inputs: tuple[Tensor, ...] = ()
    outputs: tuple[Tensor, ...] = ()
    loss: Tensor | None = None  # last stage: weighted loss, the root of backward
    stash: WeightGradStash | None = None
    saved: SavedActivations | None = None  # None after a checkpointed F, or after the backward
    input_grads: tuple[Tensor, ...] | None = None
    sent_early: bool = False  # SEND_B already posted from inside B
    seen: set[str] = field(default_factory=set)


class Stage:
    """One stage of the model: ``module`` plus the seeding keys of its layers."""

    def __init__(self, index: int, module: nn.Module, layer_keys: Sequence[int] | None) -> None:
        self.index = index
        self.module = module
        # One key per child layer (Sequential slice) or None: one key for the stage.
        self.layer_keys = tuple(layer_keys) if layer_keys is not None else None
        self.state: dict[int, MicrobatchState] = {}

    def forward(
        self, inputs: tuple[Tensor, ...], seed: int, step: int, mb: int, device: torch.device
    ) -> tuple[Tensor, ...]:
        if self.layer_keys is None:
            seeded(seed, step, mb, self.index, device)
            return as_tuple(self.module(*inputs), f"stage {self.index}'s output")
        value: tuple[Tensor, ...] = inputs
        for key, layer in zip(self.layer_keys, self.module.children(), strict=True):
            seeded(seed, step, mb, 1_000_003 + key, device)
            value = as_tuple(layer(*value), f"layer {key}'s output")
        return value

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())


def split_sequential(
    model: nn.Sequential, num_stages: int, balance: Sequence[int] | None
) -> list[Stage]:
    """Cut ``model`` into ``num_stages`` consecutive slices (``balance`` = layers per stage)."""
    layers = list(model.children())
    if balance is None:
        if len(layers) < num_stages:
            raise PipelineError(
                f"the nn.Sequential has {len(layers)} layer(s), too few for {num_stages} stages; "
                f"use fewer stages (ranks x chunks) or a deeper model"
            )
        base, extra = divmod(len(layers), num_stages)
        balance = [base + (1 if s < extra else 0) for s in range(num_stages)]
    balance = list(balance)
    if len(balance) != num_stages or sum(balance) != len(layers) or min(balance) < 1:
        raise PipelineError(
            f"balance {balance} must give {num_stages} positive layer counts summing to the "
            f"model's {len(layers)} layers"
        )
    stages, start = [], 0
    for s, count in enumerate(balance):
        keys = list(range(start, start + count))
        stages.append(Stage(s, nn.Sequential(*layers[start : start + count]), keys))
        start += count
    return stages


def detach_for_stage(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Received or handed-over tensors as leaves of this stage's graph (no copy)."""
    return tuple(
        t.detach().requires_grad_(True)
        if torch.is_floating_point(t) or t.is_complex()
        else t.detach()
        for t in tensors
    )
