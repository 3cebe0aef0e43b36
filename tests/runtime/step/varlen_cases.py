"""Microbatches of different lengths: the cases the local tests and the 2-rank launch share.

Each case hands a pipeline its microbatches already made (``zeropipe.Microbatches``), each
its own rows and sequence length, and compares the step's loss and gradients with the
unsplit model run on the same sequences: its loss summed over the microbatches and divided
by what the whole set counts (tokens, or elements), then one backward.  Three steps: two
with different shapes, then the first's again (shapes remembered per signature).

* ``mlp``: the reference residual MLP on ``[rows, seq, width]`` inputs, ``nn.MSELoss()``
  (a mean over elements, weighted by each microbatch's element count);
* ``gpt``: the reference token model (tied head), ``zeropipe.causal_lm_loss`` with some
  labels ignored (a mean over counted tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import mlp, token_model, worst_errors

# Per step, each microbatch's (rows, sequence length): lengths and rows differ.
SHAPES = (
    ((2, 5), (1, 9), (3, 2), (1, 7)),
    ((1, 3), (2, 6), (2, 4), (1, 11)),
)
STEPS = (0, 1, 0)  # the third step repeats the first step's shapes
M = len(SHAPES[0])


def _gpt_batches(step: int, vocab: int = 11) -> zeropipe.Microbatches:
    g = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, vocab, shape, generator=g) for shape in SHAPES[step]]
    labels = [t.clone() for t in ids]
    labels[1][0, :2] = -100  # ignored tokens: microbatches count differently
    return zeropipe.Microbatches(inputs=ids, targets=labels)


def _mlp_batches(step: int, width: int = 8) -> zeropipe.Microbatches:
    g = torch.Generator().manual_seed(200 + step)
    xs = [torch.randn(*shape, width, generator=g, dtype=torch.float64) for shape in SHAPES[step]]
    ys = [torch.randn(*shape, width, generator=g, dtype=torch.float64) for shape in SHAPES[step]]
    return zeropipe.Microbatches(inputs=xs, targets=ys)


def _gpt_reference_loss(model: nn.Module, batches: zeropipe.Microbatches) -> Tensor:
    fn = zeropipe.causal_lm_loss
    assert batches.targets is not None
    total = sum(fn.count(t) for t in batches.targets)
    pairs = zip(batches.inputs, batches.targets, strict=True)
    return torch.stack([fn.sum_and_count(model(x), t)[0] for x, t in pairs]).sum() / total


def _mlp_reference_loss(model: nn.Module, batches: zeropipe.Microbatches) -> Tensor:
    assert batches.targets is not None
    total = sum(t.numel() for t in batches.targets)
    fn = nn.MSELoss(reduction="sum")
    pairs = zip(batches.inputs, batches.targets, strict=True)
    return torch.stack([fn(model(x), t) for x, t in pairs]).sum() / total


Case = tuple[
    Callable[[], nn.Sequential],
    Callable[[int], zeropipe.Microbatches],
    Callable[[nn.Module, zeropipe.Microbatches], Tensor],
    Any,
]
MODELS: dict[str, Case] = {
    "mlp": (lambda: mlp(layers=8), _mlp_batches, _mlp_reference_loss, nn.MSELoss()),
    "gpt": (
        lambda: token_model(layers=8),
        _gpt_batches,
        _gpt_reference_loss,
        zeropipe.causal_lm_loss,
    ),
}


def reference(
    model: nn.Module, batches: zeropipe.Microbatches, loss_of: Callable[..., Tensor]
) -> tuple[float, dict[str, Tensor]]:
    """The unsplit model's loss and gradients over the microbatches (``.grad`` left empty)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, batches)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def errors(
    model_name: str,
    schedule: zeropipe.Schedule | str,
    *,
    mesh: Any = "local",
    options: zeropipe.RuntimeOptions | None = None,
) -> dict[str, float]:
    """Largest loss and gradient differences from the unsplit model over ``STEPS``, and
    how many gradients were compared (this process's parameters only)."""
    build, batches_for, loss_of, loss_fn = MODELS[model_name]
    model = build()
    refs = {step: reference(model, batches_for(step), loss_of) for step in set(STEPS)}
    if isinstance(schedule, str):
        schedule = zeropipe.build_schedule(schedule, ranks=2, microbatches=M)
    pipe = zeropipe.Pipeline(model, schedule, loss_fn=loss_fn, mesh=mesh, options=options)
    steps = [(functools.partial(pipe.step, batches_for(step)), refs[step]) for step in STEPS]
    return worst_errors(pipe, model, steps, model_name)


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Both models (the GPT, whose tied head crosses ranks, also under zbv), over both
    point-to-point protocols, in this rank."""
    from dataclasses import replace

    from tests.runtime.dist_cases import OPTIONS

    out: dict[str, Any] = {}
    for p2p in ("tagged", "ordered"):
        for model_name, name in (("mlp", "1f1b"), ("gpt", "1f1b"), ("gpt", "zbv")):
            schedule = zeropipe.build_schedule(name, ranks=world, microbatches=M)
            out[f"{model_name}/{name}/{p2p}"] = errors(
                model_name, schedule, mesh=None, options=replace(OPTIONS, p2p=p2p)
            )
    return out
