"""Expert parallelism: a mixture's experts sharded over an "ep" group, tokens sent to them.

``zeropipe.parallelize(stages_or_model, ep_mesh=mesh["dp"])`` shards the experts of
Qwen3-MoE, Mixtral and DeepSeek-V3 (transformers' ``Qwen3MoeExperts``,
``MixtralExperts``, ``DeepseekV3Experts``: fused ``gate_up_proj [E, 2I, H]``, the
gate and up halves concatenated, and ``down_proj [E, H, I]``).  Each of the ``ep``
ranks holds ``E / ep`` whole experts: both parameters become DTensors ``Shard(0)``
over the 1-D ``ep_mesh``, so they keep their names and a DCP checkpoint reshards
them to another layout by itself (torchtitan's layout).  The module's forward
becomes a dispatch and combine (one subclass per experts class)::

    rows (token, k) sorted by expert (stable)          counts [ep, E/ep] per destination
        |  all_to_all of the counts: each owner learns how many rows of each of its
        |  experts every source rank sends
        v
    all_to_all of the rows (uneven splits, every row kept: dropless)
        v
    local experts on their rows (linear, gate, linear), grouped by local expert
        v
    all_to_all back (the splits swapped) -> times the routing weight
        v
    index_add_ into the output in the sorted order (each token's experts added in
    expert order, as the eager forward adds them)

The local experts run as transformers' eager loop does (one pair of matmuls per
expert), whatever ``experts_implementation`` the model was built with; the row
counts are read on the host (``all_to_all_single`` takes its splits as lists), one
synchronisation per layer and direction on an accelerator.

Both row exchanges are differentiable (:class:`AllToAll`: its backward is the
same exchange of the gradient with the splits swapped), so each rank's expert
gradient sums the contributions of every rank's tokens, and the non-expert
gradients are each rank's own, as without expert parallelism.  A rank may send
or receive no rows at all.  Every rank of the group must run its experts'
forward and backward in the same order (as the replicas of a pipeline do).

Two process groups with the same members carry the exchanges: the forward's (the
counts, the dispatch, the combine) on the ep mesh's group, the backward's on a
second one made for it (:func:`backward_group`).  Each rank then issues the
forwards' collectives in one order on the first and the backwards' in one order on
the second, even when an overlapped pair runs a forward and a backward at once on
two threads; the modules say so (``collectives_split_by_direction``), and such a
pair runs at once (:func:`zeropipe.runtime.step.pairs.communicates_inside`).  A
forward recomputed inside a backward issues forward exchanges from the backward's
thread: Hugging Face's gradient checkpointing is found and its pairs run one half
after the other; ``torch.utils.checkpoint`` called around experts by the model
itself needs ``RuntimeOptions(overlap=False)``.

Refused (:class:`~zeropipe.core.errors.PipelineError`, nothing changed): other
expert layouts (biases, transposed or interleaved weights, no gate, a norm after
each expert: gpt-oss and others), an expert count the group does not divide,
experts already sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError

__all__ = [
    "EP_EXPERTS",
    "AllToAll",
    "ExpertParallel",
    "backward_group",
    "ep_size",
    "experts_of",
    "parallelized_roots",
    "shard_experts",
]

# The transformers experts classes whose layout the expert-parallel forward computes.
EP_EXPERTS = ("Qwen3MoeExperts", "MixtralExperts", "DeepseekV3Experts")
# The layout those classes declare (transformers' use_experts_implementation flags).
_LAYOUT = {
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_gate": True,
    "has_post_expert_norm": False,
}


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits on ``group``; backward: the
    gradient's exchange with the splits swapped, on ``backward_group`` (same members;
    ``None``: ``group``)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        send: list[int],
        receive: list[int],
        group: Any,
        backward_group: Any = None,
    ) -> Tensor:
        ctx.send, ctx.receive = send, receive
        ctx.group = group if backward_group is None else backward_group
        return _exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None, None


def _exchange(rows: Tensor, send: list[int], receive: list[int], group: Any) -> Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
    return out


class ExpertParallel(nn.Module):
    """The forward of an experts module whose experts are sharded over an "ep" group.

    Mixed into a subclass of the module's own class (its ``__class__`` is swapped),
    so everything else of the module stays as transformers wrote it.  ``ep_group``
    (the forward's exchanges), ``ep_backward_group`` (the backward's: same members)
    and ``ep_size`` are set by :func:`shard_experts`.
    """

    # Its forward's collectives go on one group, its backward's on another: a pair
    # running a forward and a backward at once keeps each group's order on every rank
    # (zeropipe.runtime.step.pairs.communicates_inside reads this).
    collectives_split_by_direction = True

    num_experts: int
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Any
    ep_group: Any
    ep_backward_group: Any
    ep_size: int

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        experts, local = self.num_experts, self.num_experts // self.ep_size
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        kept = (flat < experts).nonzero().squeeze(-1)  # transformers' "no expert" is E
        order = kept[torch.argsort(flat[kept], stable=True)]
        sent_counts = torch.bincount(flat[order], minlength=experts).view(self.ep_size, local)
        got_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(got_counts, sent_counts, group=self.ep_group)
        send, receive = sent_counts.sum(1).tolist(), got_counts.sum(1).tolist()
        tokens = order // k
        groups = self.ep_group, self.ep_backward_group
        rows = AllToAll.apply(hidden[tokens], send, receive, *groups)
        done = self._local_experts(rows, got_counts)
        back = AllToAll.apply(done, receive, send, *groups)
        weights = top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(hidden)
        return out.index_add_(0, tokens, (back * weights.unsqueeze(-1)).to(out.dtype))

    def _local_experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Each local expert on its rows; ``counts[s, e]``: rows of local expert ``e`` from
        source rank ``s``, laid out source by source, expert by expert within each."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        flat = counts.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().reshape(-1).tolist()
        sizes = counts.t().reshape(-1).tolist()  # expert by expert, source by source within
        ranges = [
            torch.arange(b, b + n, device=rows.device) for b, n in zip(starts, sizes, strict=True)
        ]
        perm = torch.cat([*ranges, torch.zeros(0, dtype=torch.long, device=rows.device)])
        outs = []
        # Every local expert runs, on no rows too: its gradient is then zeros, as the
        # whole model's is for an expert no token chose.
        for e, piece in enumerate(rows[perm].split(counts.sum(0).tolist())):
            h = nn.functional.linear(piece, gate_up[e])
            outs.append(nn.functional.linear(self._apply_gate(h), down[e]))  # type: ignore[operator]
        grouped = torch.cat(outs)
        return grouped.new_empty(grouped.shape).index_copy(0, perm, grouped)


def _local(p: Tensor) -> Tensor:
    """A DTensor parameter's shard on this rank (differentiable), a plain tensor as is."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


# -- what is sharded ----------------------------------------------------------------------
def _experts_class(module: nn.Module) -> str | None:
    """The transformers experts class ``module`` is (or derives from), if any."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__.endswith("Experts"):
            return cls.__name__
    return None


def parallelized_roots(given: object) -> list[nn.Module]:
    """What ``zeropipe.parallelize`` was given, as modules to walk: the model, or its stages."""
    if isinstance(given, nn.Module):
        return [given]
    if isinstance(given, Sequence) and given and all(isinstance(s, nn.Module) for s in given):
        return list(given)
    raise PipelineError(
        f"zeropipe.parallelize takes a Hugging Face causal LM or the list of stage modules "
        f"zeropipe.split made of one, got {type(given).__name__}"
    )


def experts_of(given: object, size: int) -> list[nn.Module]:
    """The experts modules of a model or of its stages, each once, checked for ``size`` ranks.

    Refuses what :func:`shard_experts` cannot shard (module docstring).
    """
    roots = parallelized_roots(given)
    found: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            name = _experts_class(module)
            if name is not None:
                _check_experts(module, name, size)
                found.setdefault(id(module), module)
    if not found:
        what = ", ".join(dict.fromkeys(type(r).__name__ for r in roots))
        raise PipelineError(
            f"zeropipe.parallelize(ep_mesh=): {what} holds no mixture-of-experts layer; expert "
            f"parallelism shards the experts of {', '.join(EP_EXPERTS)}"
        )
    return list(found.values())


def _check_experts(module: nn.Module, name: str, size: int) -> None:
    if isinstance(module, ExpertParallel):
        raise PipelineError(
            f"zeropipe.parallelize(ep_mesh=): a {name} is sharded over 'ep' already; apply "
            f"expert parallelism once, to the model or to its stages"
        )
    layout = {flag: getattr(module, flag, None) for flag in _LAYOUT}
    if name not in EP_EXPERTS or layout != _LAYOUT:
        odd = {f: v for f, v in layout.items() if v != _LAYOUT[f]}
        raise PipelineError(
            f"zeropipe.parallelize(ep_mesh=): {name} has an expert layout the expert-parallel "
            f"forward does not compute ({odd or 'another class'}); it shards the fused "
            f"gate_up_proj [E, 2I, H] / down_proj [E, H, I] experts of {', '.join(EP_EXPERTS)}"
        )
    experts = int(getattr(module, "num_experts", 0))
    if experts % size:
        fits = [d for d in range(1, experts + 1) if experts % d == 0]
        raise PipelineError(
            f"zeropipe.parallelize(ep_mesh=): a {name} has {experts} experts, which the {size} "
            f"'ep' ranks cannot hold evenly: use an ep size dividing {experts} "
            f"({', '.join(map(str, fits))})"
        )


def ep_size(ep_mesh: Any) -> int:
    """The size of a 1-D "ep" mesh; anything else refused."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        what = (
            f"a {ep_mesh.ndim}-D mesh"
            if isinstance(ep_mesh, DeviceMesh)
            else type(ep_mesh).__name__
        )
        raise PipelineError(
            f"zeropipe.parallelize: ep_mesh must be a 1-D DeviceMesh (the dimension the experts "
            f"are sharded over: mesh['dp'] for experts inside the data-parallel replicas), got "
            f"{what}"
        )
    return int(ep_mesh.size())


def shard_experts(modules: Sequence[nn.Module], ep_mesh: Any) -> None:
    """Shard each experts module of ``modules`` (from :func:`experts_of`) over ``ep_mesh``.

    Every rank passes the same full parameters (built from the same seed); each
    keeps its ``E / ep`` experts, scattered from the mesh's first rank.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ep_mesh.get_group()
    backward = backward_group(group)
    for module in modules:
        cls: Any = type(module)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            sharded = distribute_tensor(full.detach(), ep_mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        module.__class__ = _parallel_class(cls)
        parallel: Any = module
        parallel.ep_group = group
        parallel.ep_backward_group = backward
        parallel.ep_size = int(ep_mesh.size())


def backward_group(group: Any) -> Any:
    """A second process group with ``group``'s members, for the backward's exchanges.

    Made by those members alone (``use_local_synchronization``): the other ranks of the
    world need not call it, so each replica's ep group makes its own, at the point of
    the program where it shards its experts (every member at the same point, as
    ``distribute_tensor`` asks already), on the default group's backend.
    """
    return dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)


@functools.cache
def _parallel_class(cls: type) -> type:
    """``cls`` with the expert-parallel forward, one class per experts class."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {"__module__": __name__})
