"""Padded batches through a split Hugging Face model: the model's own loss and gradients.

Shared by the local tests and the 2-process launch (``distributed_cases`` runs in each
rank).  Two paddings, each with the attention its rows are well defined under:

* ``right``: trailing pads (eager attention), plus one row with a run of pads inside it,
  so that the mask changes the loss (trailing pads alone never reach a counted token);
* ``left``: leading pads (sdpa attention: under eager, transformers' own model gives NaN
  for a row whose first queries see no token at all).

Labels are ``-100`` on every pad (and, left, on the token a pad predicts).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases
from tests.gradcheck import worst_errors

ATTN = {"right": "eager", "left": "sdpa"}


def padded_batch(side: str, step: int = 0, seq: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, labels)``, six rows, some padded on ``side``."""
    ids, labels = hf_cases.batch(step, seq)
    mask = torch.ones_like(ids)
    if side == "right":
        mask[1, seq - 3 :] = 0
        mask[4, 3:] = 0
        mask[2, 2:4] = 0  # a hole: later tokens must not see these
    else:
        mask[1, :3] = 0
        mask[4, : seq - 2] = 0
    ids = ids.masked_fill(mask == 0, 0)  # a pad token id
    labels = labels.masked_fill(mask == 0, -100)
    if side == "left":
        # The first token after left pads is predicted from a pad, whose attention sees no
        # token: transformers' versions disagree there (GPT-2 before its move to
        # masking_utils attends to all keys), so that prediction is not counted.
        labels[1, 3] = labels[4, seq - 2] = -100
    return ids, mask, labels


def reference(
    model: nn.Module, ids: Tensor, mask: Tensor | None, labels: Tensor
) -> tuple[float, dict[str, Tensor]]:
    """The unsplit model's loss and gradients with ``attention_mask=mask``."""
    model.zero_grad(set_to_none=True)
    loss = zeropipe.causal_lm_loss(model(ids, attention_mask=mask).logits, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def errors(arch: str, side: str, schedule: str, local: bool = True) -> dict[str, float]:
    """Largest loss and gradient differences from the unsplit model's, over two steps
    (the second with a shorter sequence), and how far the unmasked loss is from it."""
    model = hf_cases.build(arch, tied=False, attn=ATTN[side])
    batches = [padded_batch(side, step, seq) for step, seq in hf_cases.STEPS]
    refs = [reference(model, ids, mask, labels) for ids, mask, labels in batches]
    ids, _, labels = batches[0]
    unmasked = reference(model, ids, None, labels)[0]
    chunks = 2 if schedule == "zbv" else 1
    stages = zeropipe.split(model, 2 * chunks, balance=[1, 1, 1, 1] if chunks == 2 else [2, 2])
    pipe = zeropipe.Pipeline(
        stages,
        zeropipe.build_schedule(schedule, ranks=2, microbatches=2),
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local" if local else None,
    )
    steps = [
        (functools.partial(pipe.step, (ids, mask), labels), ref)
        for (ids, mask, labels), ref in zip(batches, refs, strict=True)
    ]
    worst = worst_errors(pipe, model, steps, f"{arch} {side} {schedule}")
    return {**worst, "unmasked": abs(unmasked - refs[0][0])}


def distributed_cases(rank: int, world: int) -> dict[str, Any]:
    """Llama (left pads) and GPT-2 (right pads) under 1f1b, in this rank."""
    torch.set_num_threads(1)
    return {
        f"{arch} {side}": errors(arch, side, "1f1b", local=False)
        for arch, side in (("llama", "left"), ("gpt2", "right"))
    }
