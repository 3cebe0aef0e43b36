"""GradMemory: weight-gradient memory is reused only when nothing else can see it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.gradcheck import assert_same_gradients, batch_for, mlp, reference
from zeropipe import build_schedule
from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions


def _cycle(memory: GradMemory, p: nn.Parameter) -> int:
    """Take memory for p's gradient, install it, and return its address."""
    buf = memory.take(p)
    p.grad = buf
    return buf.data_ptr()


def test_kept_memory_is_reused_once_grad_is_none() -> None:
    memory = GradMemory()
    p = nn.Parameter(torch.zeros(64, 32))
    first = _cycle(memory, p)
    p.grad = None
    assert _cycle(memory, p) == first
    assert len(memory) == 1 and memory.nbytes == p.numel() * p.element_size()


def test_a_held_reference_or_view_is_never_overwritten() -> None:
    memory = GradMemory()
    p = nn.Parameter(torch.zeros(64, 32))
    _cycle(memory, p)
    held = p.grad
    assert held is not None
    p.grad = None
    assert _cycle(memory, p) != held.data_ptr()  # the user's tensor is left alone
    view = p.grad.view(-1)
    p.grad = None
    assert _cycle(memory, p) != view.data_ptr()
    in_list = [p.grad]
    p.grad = None
    assert _cycle(memory, p) != in_list[0].data_ptr()


def test_a_changed_parameter_gets_fresh_memory() -> None:
    memory = GradMemory()
    p = nn.Parameter(torch.zeros(8, 4))
    _cycle(memory, p)
    p.grad = None
    p.data = torch.zeros(8, 4, dtype=torch.float64)
    buf = memory.take(p)
    assert buf.dtype == torch.float64 and buf.shape == p.shape
    memory.clear()
    assert len(memory) == 0


def test_pipeline_steps_reuse_gradient_memory_and_stay_exact() -> None:
    model = mlp()
    x, y = batch_for(model, batch=8)
    _, ref = reference(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(model, build_schedule("zb-h1", ranks=2, microbatches=4), loss_fn=F.mse_loss)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    pipe.step(x, y)
    addresses = [_address(p) for p in weights]
    held = weights[0].grad  # a gradient the user keeps must survive the next step
    assert held is not None
    before = held.clone()
    for p in model.parameters():
        p.grad = None
    pipe.step(x * 2, y)  # a different batch, so that an overwrite would show
    assert torch.equal(held, before)
    reused = [_address(p) == a for p, a in zip(weights, addresses, strict=True)]
    assert reused == [False] + [True] * (len(weights) - 1)
    for p in model.parameters():
        p.grad = None
    pipe.step(x, y)
    assert_same_gradients(model.named_parameters(), ref)


def _address(p: nn.Parameter) -> int:
    assert p.grad is not None
    return p.grad.data_ptr()


def test_keep_grad_memory_off_allocates_every_step() -> None:
    model = mlp()
    x, y = batch_for(model, batch=8)
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=2, microbatches=4),
        loss_fn=F.mse_loss,
        options=RuntimeOptions(keep_grad_memory=False),
    )
    pipe.step(x, y)
    assert pipe.grad_memory is None
    # zb-h1: W writes these small weights' gradients (under 1f1b they stay plain linears)
    on = Pipeline(mlp(), build_schedule("zb-h1", ranks=2, microbatches=4), loss_fn=F.mse_loss)
    on.step(*batch_for(model, batch=8))
    assert on.grad_memory is not None and len(on.grad_memory) > 0
    on.release_grad_memory()
    assert len(on.grad_memory) == 0
