"""The gradient sums a step makes beyond each stage's REDUCE_GRAD.

A parameter used by stages on several pipeline ranks (a tied embedding) has its
gradient summed across those ranks once the step is over, and, with replicas,
across the replicas too.  Gradients accumulated over earlier steps (no
``zero_grad`` between them) are set aside before the step, so the sums add
only this step's contributions, and added back afterwards, once.  Clipping takes
the norm over every rank's gradients, a shared parameter counted once.  A gradient
hook on a parameter used by several stages is refused: it would run on each stage's
part of the gradient.  A step comes here only when it has something for it: shared
parameters, replicas, a clip.

The step's loss too, when its microbatches' routes end on several ranks
(dualpipe: the down ones on the last rank, the up ones on the first): each of those
ranks holds its microbatches' share, and :func:`loss_over_route_ends` sums them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from zeropipe.base._compat import tensor_has_grad_hooks
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.parts import SplitParam
from zeropipe.runtime.replicas.data_parallel import Replicas
from zeropipe.runtime.step.stage import Stage

__all__ = [
    "add_back",
    "clip_grads",
    "counted_once",
    "grad_norm",
    "loss_over_route_ends",
    "reduce_shared",
    "refuse_split_hooks",
    "set_aside",
]


def set_aside(params: Sequence[nn.Parameter]) -> dict[int, Tensor]:
    """Take the gradients of earlier steps off ``params`` (to be given back by :func:`add_back`)."""
    earlier = {}
    for p in params:
        if p.grad is not None:
            earlier[id(p)] = p.grad
            p.grad = None
    return earlier


def add_back(params: Sequence[nn.Parameter], earlier: dict[int, Tensor]) -> None:
    """Add what :func:`set_aside` took to this step's gradients."""
    if not earlier:
        return
    for p in params:  # a shared parameter this rank does not own stays unset
        before = earlier.get(id(p))
        if before is not None and p.grad is not None:
            p.grad = before.add_(p.grad)


def reduce_shared(
    shared: Sequence[nn.Parameter],
    mine: Sequence[nn.Parameter],
    replicas: Replicas | None,
    across_ranks: Callable[[list[Tensor]], None] | None,
) -> None:
    """Sum the gradients that no REDUCE_GRAD summed: ``shared`` parameters.

    ``mine``: the parameters of the stages this process runs; ``across_ranks``: the
    transport's sum over the pipeline's ranks (None in one process, which already
    accumulated every stage's contribution).
    """
    if not shared:
        return
    owned = {id(p) for p in mine}
    if replicas is not None:
        # Used by stages on several pipeline ranks (or, in one process, several
        # schedule ranks): summed across replicas here, once the step is over.
        late = [p for p in shared if id(p) in owned and p.requires_grad]
        for p in late:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if late:
            replicas.sum_(
                [p.grad for p in late if p.grad is not None],
                "the data-parallel sum of shared parameters' gradients",
            )
    if across_ranks is None:
        return
    # Every rank holds the whole model, but only ranks running a stage that
    # uses a shared parameter own its gradient.  The others contribute a
    # fresh zero buffer and keep nothing: a .grad left on their copy would
    # never be zeroed by their optimizer and would leak into the next sum.
    grads = []
    for p in shared:
        if id(p) not in owned:
            grads.append(torch.zeros_like(p))
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    across_ranks(grads)


def counted_once(
    mine: Sequence[nn.Parameter], stages: Sequence[Stage], placement: Sequence[int], rank: int
) -> list[nn.Parameter]:
    """``mine``, a parameter shared by several ranks kept only on the lowest that holds it."""
    first: dict[int, int] = {}
    for stage in stages:
        for p in stage.parameters():
            r = placement[stage.index]
            first[id(p)] = min(first.get(id(p), r), r)
    return [p for p in mine if first[id(p)] == rank]


def clip_grads(
    params: Sequence[nn.Parameter],
    counted: Sequence[nn.Parameter],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    across_ranks: Callable[[Sequence[Tensor]], None] | None,
    num_ranks: int,
    rank: int,
) -> Tensor:
    """Scale ``params``' gradients so that the global norm of ``counted``'s is at most ``max_norm``."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise PipelineError(f"norm_type must be > 0 (or inf), got {norm_type}")
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    total = grad_norm(grads, norm_type, across_ranks, num_ranks, rank)
    if error_if_nonfinite and not torch.isfinite(total):
        raise PipelineError(
            f"the total norm of order {norm_type:g} of the gradients is {total.item()}; "
            f"pass error_if_nonfinite=False to scale them anyway"
        )
    coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
    if coef < 1.0:  # every copy of a shared parameter's gradient, counted once or not
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)
    return total


def refuse_split_hooks(split: Sequence[SplitParam]) -> None:
    """Refuse a gradient hook on a parameter used by several stages (``split``, from
    :func:`split_params`): each stage's backward accumulates its own part of the gradient,
    and the hook would run on each part, where torch runs it once on their sum.  Hooks may
    be registered after the pipeline is built, so this runs at each training step."""
    for p, name, used in split:
        if tensor_has_grad_hooks(p):
            which = ", ".join(map(str, used[:-1])) + f" and {used[-1]}"
            raise PipelineError(
                f"a gradient hook on parameter {name!r}, used by stages {which}, would run on "
                f"each stage's part of its gradient, not on their sum as in torch; remove the "
                f"hook and act on {name}.grad after pipe.step() (the summed gradient), or untie "
                f"the parameter (one copy per stage)"
            )


def loss_over_route_ends(
    own: Tensor | None,
    agreed: Tensor | None,
    sum_: Callable[[Sequence[Tensor]], None],
    device: torch.device,
) -> Tensor | None:
    """The step's loss summed over the ranks where microbatches' routes end.

    ``own``: this rank's share (None: no route ends here); ``agreed``: what the step's end
    gave every rank (one share, carrying the loss's dtype; None: no loss this step);
    ``sum_``: the in-place sum over the pipeline's ranks, which every rank calls.
    """
    if agreed is None:
        return None
    share = torch.zeros((), dtype=torch.float64, device=device)
    if own is not None:
        share += own.detach().to(device=device, dtype=torch.float64).reshape(())
    sum_([share])
    return share.to(agreed.dtype)


def grad_norm(
    grads: Sequence[Tensor],
    norm_type: float,
    sum_over_ranks: Callable[[Sequence[Tensor]], None] | None,
    ranks: int,
    rank: int,
) -> Tensor:
    """The norm of order ``norm_type`` of ``grads`` over every rank (a float64 CPU scalar).

    ``sum_over_ranks`` sums tensors in place over the pipeline's ranks (None:
    one process holds them all); ``rank`` is this process's among ``ranks``.
    """
    if norm_type == math.inf:
        maxima = [_whole(g.abs().max()).double() for g in grads if g.numel()]
        part = torch.stack(maxima).max().cpu() if maxima else torch.zeros((), dtype=torch.float64)
        if sum_over_ranks is None:
            return part
        spread = torch.zeros(ranks, dtype=torch.float64)  # the ranks' maxima side by side
        spread[rank] = part
        sum_over_ranks([spread])
        return spread.max()
    norms = [_whole(torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)) for g in grads]
    part = (
        torch.stack(norms).pow(norm_type).sum().cpu()
        if norms
        else torch.zeros((), dtype=torch.float64)
    )
    if sum_over_ranks is not None:
        sum_over_ranks([part])
    return part ** (1.0 / norm_type)


def _whole(t: Tensor) -> Tensor:
    """A plain tensor: a DTensor (a tensor-parallel or FSDP gradient's norm) gathered over its
    mesh, so that every rank of the mesh holds the whole parameter's norm."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
