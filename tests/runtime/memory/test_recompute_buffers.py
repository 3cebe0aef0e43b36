"""Recompute (R) leaves module buffers as one forward per microbatch would: BatchNorm, counters.

A checkpointed F runs the stage's forward once and R runs it again; layers
that update buffers in their forward (BatchNorm's running statistics, a call
counter) must see one update per microbatch, like the plain model run
microbatch by microbatch in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.ir import Kind
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules import generate
from zeropipe.runtime.memory.manager import kept_buffers
from zeropipe.runtime.pipeline import Pipeline

M = 4  # microbatches
STEPS = 2


class _Counter(nn.Module):
    """Counts its forwards in a buffer, in place (a side effect autograd is told about)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),  # cumulative average: reads num_batches_tracked
        _Counter(),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (
        torch.randn(4 * M, 4, dtype=torch.float64, generator=g),
        torch.randn(4 * M, 3, dtype=torch.float64, generator=g),
    )


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference() -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """The plain model, microbatch by microbatch in order: buffers and gradients per step."""
    model = _model()
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        for xi, yi in zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True):
            (F.mse_loss(model(xi), yi) * (len(xi) / len(x))).backward()
        out.append((_buffers(model), _grads(model)))
    return out


def _pipelined(name: str, recompute: bool) -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    schedule = generate(name, 2, M)
    if recompute:
        schedule = checkpoint(schedule)
        recomputes = sum(a.kind is Kind.R for acts in schedule.actions for a in acts)
        assert recomputes == schedule.num_stages * M
    model = _model()
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        pipe.step(x, y)
        out.append((_buffers(model), _grads(model)))
    return out


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_recompute_updates_buffers_once_per_microbatch(name: str) -> None:
    ref = _reference()
    plain = _pipelined(name, recompute=False)
    recomputed = _pipelined(name, recompute=True)
    for step, (want_buffers, want_grads) in enumerate(ref):
        assert want_buffers["5.calls"].item() == M * (step + 1)
        assert want_buffers["4.num_batches_tracked"].item() == M * (step + 1)
        for what, run in (("without R", plain), ("with R", recomputed)):
            got_buffers, got_grads = run[step]
            assert got_buffers.keys() == want_buffers.keys()
            for n, want in want_buffers.items():
                torch.testing.assert_close(
                    got_buffers[n], want, rtol=0, atol=1e-12, msg=f"{what}, step {step}: {n}"
                )
            assert got_grads.keys() == want_grads.keys()
            for n, want in want_grads.items():
                torch.testing.assert_close(
                    got_grads[n], want, rtol=0, atol=1e-12, msg=f"{what}, step {step}: {n}"
                )


def test_kept_buffers_restores_values_objects_and_leaves_autograd_versions_alone() -> None:
    bn = nn.BatchNorm1d(3).double()
    counter = _Counter()
    model = nn.Sequential(bn, counter)
    before = _buffers(model)
    original = counter.calls
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with kept_buffers(model):
        y = model(x)  # BatchNorm saves its running statistics for backward
        counter.calls = torch.tensor(7)  # a forward may also rebind a buffer
    assert counter.calls is original
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    y.sum().backward()  # restoring did not count as an in-place change of a saved tensor
    assert x.grad is not None


def test_kept_buffers_without_buffers_is_a_no_op() -> None:
    lin = nn.Linear(2, 2)
    with kept_buffers(lin):
        out = lin(torch.ones(1, 2))
    assert out.shape == (1, 2)
