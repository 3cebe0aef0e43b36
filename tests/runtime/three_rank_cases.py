"""What the 3-process launch runs, launched once per test session (``results``).

Three is the world size whose end-of-step barrier has rounds that are not a power of two
(test_distributed.py: the loss reaches every rank, in its dtype, with the tied gradients
summed); the same processes first check zeropipe.base._compat's point-to-point posts over
a subgroup of two of them (tests/base/test_compat.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from tests.gradcheck import batch_for
from tests.runtime.dist_cases import LAUNCH_TIMEOUT, MODELS, guard, seeded
from zeropipe.base import _compat
from zeropipe.runtime.pipeline import Pipeline


def _p2p_in_a_subgroup(rank: int) -> list[bool]:
    """Ranks 1 and 2 of 3 exchange a float and a complex tensor over their own group."""
    group = dist.new_group([1, 2])
    if rank == 0:
        return []
    peer = 1 - dist.get_group_rank(group, rank)  # group ranks 0 and 1: the other one
    sent = [torch.arange(6.0).reshape(2, 3) + rank, torch.full((3,), 1 + 2j * rank)]
    got = [torch.empty(2, 3), torch.empty(3, dtype=torch.complex64)]
    works = [_compat.p2p_recv(group, t, peer, tag) for tag, t in enumerate(got)]
    works += [_compat.p2p_send(group, t, peer, tag) for tag, t in enumerate(sent)]
    for w in works:
        w.wait()
    other = 3 - rank
    return [
        torch.equal(got[0], torch.arange(6.0).reshape(2, 3) + other),
        torch.equal(got[1], torch.full((3,), 1 + 2j * other)),
    ]


def _tied_steps(world: int) -> dict[str, Any]:
    """Two 1f1b steps of the tied token model in float64, then in float32: per step the
    loss, its dtype and this rank's gradients."""
    out: dict[str, Any] = {}
    for dtype in (torch.float64, torch.float32):
        build, loss_fn = MODELS["tokens-tied"]
        model = build().to(dtype)
        m = 2 * world + 1
        x, y = batch_for(model, batch=2 * m + 1)
        pipe = Pipeline(model, "1f1b", microbatches=m, loss_fn=loss_fn, options=seeded(3))
        steps = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = pipe.step(x, y)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            steps.append({"loss": loss.item(), "dtype": str(loss.dtype), "grads": grads})
        out[str(dtype)] = steps
    return out


def cases(rank: int, world: int) -> dict[str, Any]:
    """Per rank: ``"p2p"`` (run first, in the fresh processes), then the tied steps under
    ``str(dtype)`` for float64 and float32."""
    out: dict[str, Any] = {"p2p": guard(lambda: _p2p_in_a_subgroup(rank))}
    out.update(_tied_steps(world))
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 3 processes, launched once per test session."""
    from zeropipe.runtime.launch import launch

    return launch(cases, 3, timeout=LAUNCH_TIMEOUT)
