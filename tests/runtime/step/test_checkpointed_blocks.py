"""Blocks checkpointed one by one inside their stages (``torch.utils.checkpoint`` around each,
as Hugging Face's gradient checkpointing and torchtitan's full activation checkpointing do):
what ``zeropipe plan --checkpoint-blocks`` prices runs, exact, under every generator.

The split schedules' I and W then both work on activations the block's recompute rebuilt
inside I; the stage-level R of ``fit.checkpoint`` can come on top of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from tests.gradcheck import assert_same_gradients, assert_same_loss, reference
from zeropipe import build_schedule
from zeropipe.core.ir import Kind
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.runtime.pipeline import Pipeline

WIDTH, BLOCKS, MICROBATCHES = 8, 8, 4


class Block(nn.Module):
    """A residual MLP block whose body is recomputed in its backward; ``runs`` counts the
    body's forwards (once in F, once more in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
        self.runs = 0
        self.body.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: object) -> None:
        self.runs += 1

    def forward(self, x: Tensor) -> Tensor:
        return x + torch_checkpoint(self.body, x, use_reentrant=False)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)]).double()


@pytest.mark.parametrize("name", sorted(set(GENERATORS) - {"auto"}))
def test_checkpointed_blocks_give_the_plain_models_gradients_on_every_generator(name: str) -> None:
    model = _model()
    x = torch.randn(16, WIDTH, dtype=torch.float64)
    y = torch.randn(16, WIDTH, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, F.mse_loss, MICROBATCHES)
    for block in model:
        assert isinstance(block, Block)
        block.runs = 0
    schedule = build_schedule(name, ranks=2, microbatches=MICROBATCHES)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    loss = pipe.step(x, y)
    assert loss is not None
    assert_same_loss(loss, ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    # Every block ran its body twice per microbatch: the forward and the rebuild.
    assert sum(b.runs for b in model if isinstance(b, Block)) == 2 * BLOCKS * MICROBATCHES
    if any(a.kind is Kind.W for acts in schedule.actions for a in acts):  # split I and W
        kinds = {e.action.kind for events in pipe.last_events for e in events}
        assert {Kind.I, Kind.W} <= kinds


def test_a_stage_recompute_on_top_of_checkpointed_blocks_stays_exact() -> None:
    # R rebuilds the stage's block inputs ahead of the gradient; each block's own
    # checkpoint still rebuilds its body in the backward.
    model = _model()
    x = torch.randn(16, WIDTH, dtype=torch.float64)
    y = torch.randn(16, WIDTH, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, F.mse_loss, MICROBATCHES)
    schedule = checkpoint(generate("zbv", 2, MICROBATCHES))
    assert any(a.kind is Kind.R for acts in schedule.actions for a in acts)
    pipe = Pipeline(model, build_schedule(schedule), loss_fn=F.mse_loss)
    loss = pipe.step(x, y)
    assert loss is not None
    assert_same_loss(loss, ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
