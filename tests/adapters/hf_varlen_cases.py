"""Microbatches of different lengths through a split Hugging Face Llama: dict batches of
packed rows (``input_ids`` + ``position_ids`` restarting at each document), each microbatch
its own rows and length, given as ``zeropipe.Microbatches``.

Shared by the local test (every generator) and the 2-process launch (both point-to-point
protocols; ``distributed_cases`` runs in each rank).  The reference is the unsplit model
run on the same microbatches: their summed token losses over the tokens the whole set
counts, one backward.  float64, eager attention, no dropout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases
from tests.gradcheck import worst_errors

# Per step, each microbatch's rows and length (every row holds two documents), then the
# first step's shapes again.
SHAPES = (((2, 9), (1, 14), (3, 5), (1, 6)), ((1, 7), (2, 12), (2, 4), (1, 10)))
STEPS = (0, 1, 0)
M = len(SHAPES[0])


def microbatches(step: int) -> zeropipe.Microbatches:
    """Packed rows of two documents each, labels -100 at each document's start."""
    g = torch.Generator().manual_seed(300 + step)
    inputs, targets = [], []
    for rows, seq in SHAPES[step]:
        ids = torch.randint(0, 64, (rows, seq), generator=g)
        firsts = torch.randint(1, seq, (rows,), generator=g).tolist()
        pos = torch.stack([torch.cat([torch.arange(n), torch.arange(seq - n)]) for n in firsts])
        inputs.append({"input_ids": ids, "position_ids": pos})
        targets.append(ids.masked_fill(pos == 0, -100))
    return zeropipe.Microbatches(inputs=inputs, targets=targets)


def reference(model: nn.Module, batches: zeropipe.Microbatches) -> tuple[float, dict[str, Tensor]]:
    """The unsplit model's loss and gradients over the microbatches."""
    fn = zeropipe.causal_lm_loss
    assert batches.targets is not None
    total = sum(fn.count(t) for t in batches.targets)
    model.zero_grad(set_to_none=True)
    sums = [
        fn.sum_and_count(model(**x, use_cache=False).logits, t)[0]
        for x, t in zip(batches.inputs, batches.targets, strict=True)
    ]
    loss = torch.stack(sums).sum() / total
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def errors(
    schedule: str, *, local: bool = True, options: zeropipe.RuntimeOptions | None = None
) -> dict[str, float]:
    """Largest loss and gradient differences from the unsplit Llama over ``STEPS``, and how
    many gradients were compared (this process's parameters only)."""
    model = hf_cases.build("llama", tied=True)
    refs = {step: reference(model, microbatches(step)) for step in set(STEPS)}
    built = zeropipe.build_schedule(schedule, ranks=2, microbatches=M)
    cut = built.num_stages - len(built.copies)  # a copy runs its original's module
    stages = zeropipe.split(model, cut, balance=[4 // cut] * cut)  # 4 decoder layers
    pipe = zeropipe.Pipeline(
        stages,
        built,
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local" if local else None,
        options=options,
    )
    steps = [(functools.partial(pipe.step, microbatches(step)), refs[step]) for step in STEPS]
    return worst_errors(pipe, model, steps, schedule)


def distributed_cases(rank: int, world: int) -> dict[str, Any]:
    """The Llama under 1f1b over both point-to-point protocols, in this rank."""
    torch.set_num_threads(1)
    return {
        p2p: errors("1f1b", local=False, options=zeropipe.RuntimeOptions(p2p=p2p, timeout=60.0))
        for p2p in ("tagged", "ordered")
    }
