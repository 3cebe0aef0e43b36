"""A full backward (B) that produces the stage-input gradient first and sends it at once.

In a B action the gradient w.r.t. the stage input is what the upstream rank
waits for; parameter-only work (weight transposes, side branches such as a
bias or norm that feeds nothing else) can run after it.  Two mechanisms:

1. priority: the nodes on paths from the outputs to the input leaves get
   early sequence numbers (:func:`zeropipe.autograd.priority.prioritize_toward`),
   so among ready nodes the engine runs those first;
2. early post: a post-accumulate-grad hook on the input leaves calls
   ``on_ready`` the moment every input gradient exists -- still inside
   ``backward`` -- so the SEND_B is posted while the remaining parameter work runs.

::

    outputs --> ... --> Linear1 --> x (stage input)      x.grad ready -> on_ready(x.grad) -> isend
                 \\--> weight-only nodes                  run after, overlapping the send
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from zeropipe.autograd.priority import prioritize_toward

__all__ = ["backward_input_first"]


def backward_input_first(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    on_ready: Callable[[tuple[Tensor, ...]], None],
    *,
    prioritized: bool = True,
    run: Callable[[list[Tensor], list[Tensor | None]], None] | None = None,
) -> bool:
    """Backward of ``roots``; ``on_ready(input grads)`` as soon as they all exist.

    Returns whether ``on_ready`` was called (it is not when some input gets no
    gradient at all; the caller then sends zeros itself after backward).
    ``run(roots, grads)`` is the backward to run (default: plain autograd; the
    runtime passes a split stash's input backward).
    """
    leaves = [t for t in inputs if t.requires_grad and t.grad_fn is None]
    if not roots:
        return False
    if prioritized and leaves:
        prioritize_toward(list(roots), leaves)
    waiting = {id(t) for t in leaves}
    fired = False

    def hook(t: Tensor) -> None:
        nonlocal fired
        waiting.discard(id(t))
        if not waiting and not fired:
            fired = True
            on_ready(tuple(x.grad for x in leaves if x.grad is not None))

    handles = [t.register_post_accumulate_grad_hook(hook) for t in leaves]
    try:
        (run or torch.autograd.backward)(list(roots), list(grads))
    finally:
        for h in handles:
            h.remove()
    return fired and len(leaves) == len(inputs)
