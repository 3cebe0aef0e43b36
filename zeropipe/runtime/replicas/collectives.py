"""What the ranks of a distributed pipeline do together at the end of a step.

Collectives run only after :func:`barrier` says every rank finished its
schedule, because a collective that a failed peer never joins cannot be
cancelled, while the barrier's point-to-point receives are waited on like
any other (bounded, watching for failed peers)::

    start_step:   the barrier's receives posted (gloo; NCCL posts them in the barrier)
    finish_step:  sends done -> barrier (carries the loss to every rank, and each rank's
                  step number and batch fingerprint, checked by every rank that hears them)
    after it:     all_reduce of the gradients of parameters shared across ranks
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeropipe.base.storage import local_tensor
from zeropipe.runtime.transport.endpoint import Endpoint, Label
from zeropipe.runtime.transport.wire import DTYPES, dtype_code

__all__ = ["Heard", "all_reduce", "barrier", "flatten", "grad_norm", "post_barrier", "unflatten"]


Heard = list[tuple[Tensor, Any, Label]]
"""A barrier's receives, posted: per round, (buffer, work, what it is and its source rank)."""

# A barrier's token: [loss known?, loss as float64, its dtype code, step, fingerprint].
_TOKEN = 5


def post_barrier(endpoint: Endpoint, tag: Callable[[int], int], device: torch.device) -> Heard:
    """Post the receives of the next :func:`barrier` (not batched), one per round.

    Posted when the step starts, a round's message from a peer that finished
    first is already here when this rank reaches the barrier: the rank that
    ends the step last then pays no round trip for it (over gloo, a message
    whose receive is not yet posted waits for the receiver's notice).
    """
    rank, w = endpoint.rank, endpoint.world
    heard: Heard = []
    for k in range((w - 1).bit_length()):
        src = (rank - (1 << k)) % w
        what = f"the end-of-step barrier (round {k}) from rank {src}"
        buf = torch.empty(_TOKEN, dtype=torch.float64, device=device)
        heard.append((buf, endpoint.recv(buf, src, tag(k), what), (what, src)))
    return heard


def barrier(
    endpoint: Endpoint,
    loss: Tensor | None,
    tag: Callable[[int], int],
    device: torch.device,
    *,
    batched: bool = False,
    heard: Heard | None = None,
) -> Tensor | None:
    """Every rank finished this step's schedule (so the collectives after it will be joined).

    A dissemination barrier of point-to-point messages: in round k each rank
    tells rank r + 2^k what it knows and hears from rank r - 2^k, so after
    ceil(log2 W) rounds each has heard, through the others, from all.  What
    travels is the step's loss, known at first only to the rank that owns
    the last stage, so the loss reaches every rank with no collective of its
    own.  The receives are waited on by the pool's threads like any other:
    they wake the caller as soon as the message lands (a barrier polled
    through the store woke up to a poll interval late, on the step's
    critical path), and a peer that dies leaves only a daemon thread
    behind, where a collective could not be given up.

    Each token also carries its sender's step number and batch fingerprint
    (when ``endpoint`` has an :class:`~zeropipe.runtime.transport.wire.Agreement`):
    every rank checks those it hears against its own, at no cost of its own.
    The rank that hears a mismatch fails, and the others hear of it.

    ``tag(k)`` is the tag of round k; returns the loss (None if no rank had one).
    ``batched``: each round's send and receive are one ``batch_isend_irecv``,
    issued only after the round before completed, for backends that match
    messages in issue order and let a posted receive hold back later
    operations (NCCL); otherwise every round's receive is posted up front:
    ``heard``, if :func:`post_barrier` posted them already, or here.
    """
    rank, w = endpoint.rank, endpoint.world
    rounds = (w - 1).bit_length()
    agreement = endpoint.agreement
    stamp = (0, 0) if agreement is None else (agreement.stamp.step, agreement.stamp.fingerprint)
    # The loss as float64 is exact for every floating dtype; the fingerprint has 48 bits.
    known = torch.tensor([0.0, 0.0, 0.0, *stamp], dtype=torch.float64, device=device)
    have = loss is not None
    if loss is not None:
        code = dtype_code(loss.dtype)
        assert code is not None  # the caller checked
        known[0], known[1], known[2] = (1.0, loss.detach().double().reshape(()), code)
    if batched:
        for k in range(rounds):
            src, dst = (rank - (1 << k)) % w, (rank + (1 << k)) % w
            buf = torch.empty(_TOKEN, dtype=torch.float64, device=device)
            ops = [
                dist.P2POp(
                    dist.isend, known.clone(), endpoint.global_rank(dst), endpoint.group, tag(k)
                ),
                dist.P2POp(dist.irecv, buf, endpoint.global_rank(src), endpoint.group, tag(k)),
            ]
            what = f"the end-of-step barrier (round {k}) with ranks {dst} and {src}"
            works = endpoint.call(partial(dist.batch_isend_irecv, ops), what, src)
            endpoint.wait(endpoint.pending(works, [(what, src)] * len(works)))
            if _heard_from(endpoint, src, buf) and not have:
                known, have = buf, True
        return _shared_loss(loss, known)
    if heard is None:
        heard = post_barrier(endpoint, tag, device)
    told: list[Any] = []
    labels: list[Label] = []
    for k, (buf, work, label) in enumerate(heard):
        dst = (rank + (1 << k)) % w
        what = f"the end-of-step barrier (round {k}) to rank {dst}"
        token = known.clone()  # in flight while ``known`` may still change
        told.append(endpoint.send(token, dst, tag(k), what))
        labels.append((what, dst))
        endpoint.wait(endpoint.pending([work], [label]))
        if _heard_from(endpoint, int(label[1] or 0), buf) and not have:
            known, have = buf, True
    if told:
        endpoint.wait(endpoint.pending(told, labels))
    return _shared_loss(loss, known)


def _heard_from(endpoint: Endpoint, src: int, buf: Tensor) -> bool:
    """Check the token ``src`` sent against this rank's step; whether it carries the loss."""
    words = buf.tolist()  # one copy of the token to the host
    if endpoint.agreement is not None:
        endpoint.agreement.check(src, int(words[3]), int(words[4]))
    return bool(words[0] > 0)


def _shared_loss(loss: Tensor | None, known: Tensor) -> Tensor | None:
    if loss is not None or known[0] == 0:
        return loss
    return known[1].to(DTYPES[int(known[2].item())])


def flatten(tensors: Sequence[Tensor]) -> list[tuple[list[Tensor], Tensor]]:
    """``tensors`` grouped by (dtype, device), each group with one flat copy of it.

    A DTensor (a tensor-parallel gradient) takes part as its local shard: the
    peers of a data-parallel or pipeline group hold the same shard of it.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in map(local_tensor, tensors):
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(ts, torch.cat([t.reshape(-1) for t in ts])) for ts in groups.values()]


def unflatten(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy ``flat`` back into ``tensors``, the group it was made from by :func:`flatten`."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce(
    endpoint: Endpoint,
    tensors: Sequence[Tensor],
    what: str = "the all-reduce of shared parameters' gradients",
) -> None:
    """Sum ``tensors`` over the group in place, one flat all-reduce per (dtype, device)."""
    for ts, flat in flatten(tensors):
        work = endpoint.call(
            partial(dist.all_reduce, flat, group=endpoint.group, async_op=True), what
        )
        endpoint.wait(endpoint.pending([work], [(what, None)]))
        unflatten(ts, flat)


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
