"""Context parallelism for split Hugging Face models: each stage's sequence sharded over "cp".

``zeropipe.parallelize(stages, cp_mesh=mesh["cp"])`` gives the Llama-family stages that
``zeropipe.split`` made (Llama, Mistral, Qwen2, Qwen3) a :class:`SequenceShards`: every cp
rank runs the same stages on its share of every row's tokens.  The sequence of ``t``
tokens is cut into ``2 x cp`` chunks and cp rank ``i`` holds chunks ``i`` and
``2 x cp - 1 - i`` (causal load balancing: an early chunk, which attends to little, with a
late one, which attends to much)::

    cp = 2, t = 8:   tokens   0 1 | 2 3 | 4 5 | 6 7
                     chunk      0     1     2     3
                     rank 0 holds chunks 0 and 3: tokens 0 1 6 7
                     rank 1 holds chunks 1 and 2: tokens 2 3 4 5

The first stage takes the whole batch (every cp rank gets the same ``input_ids`` and
optional ``position_ids``) and keeps its tokens; from there every activation that crosses
stages is the rank's tokens only, with their global position ids beside them, so the rotary
positions are the sequence's own.  Layers other than attention act on each token alone and
need nothing.  Attention runs the rank's queries against the whole sequence's keys and
values: an all-gather of both over the cp group (:class:`_GatherSequence`, whose backward
sums every rank's key and value gradients back to the rank that owns the tokens), under a
mask written from the global token indices: causal, the sliding window where a layer has one,
and, for packed rows, the documents that restarting position ids mark (as transformers
masks them in one process).  It is an attention function registered with transformers'
``AttentionInterface`` under :data:`ATTENTION_NAME`, which each sharded attention module's
own copy of the config names, and which calls the implementation the model was built with
("eager" or "sdpa") on the gathered keys and values: the models' own modules run unchanged.

The forward's collectives (keys and values, the position ids) go on the cp group and the
backward's (the key and value gradients) on a second group of the same members, so an
overlapped pair's two halves (DualPipeV) never interleave theirs.  An all-gather holds every
rank's keys and values at once; a ring that passes them around (each block computed while
the next arrives) is not written.

The loss follows the shards: ``causal_lm_loss`` shifts the labels on the whole sequence,
then keeps the rank's tokens (:meth:`zeropipe.adapters.loss.CausalLMLoss.context_parallel`),
and counts only those; summed over dp x cp, as the pipeline sums counts and gradients over
its replicas, the loss and gradients are the whole batch's.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError

__all__ = ["ATTENTION_NAME", "SequenceShards", "context_parallel", "shard_indices"]

# The name the attention function is registered under in transformers' AttentionInterface.
ATTENTION_NAME = "zeropipe_context_parallel"
# The attention implementations the function can call on gathered keys and values: both
# take a dense mask (flash attention takes none; flex attention a block mask).
_IMPLEMENTATIONS = ("eager", "sdpa")


def shard_indices(length: int, rank: int, size: int, device: torch.device | None = None) -> Tensor:
    """The global indices of cp rank ``rank``'s tokens in a sequence of ``length``: chunks
    ``rank`` and ``2 x size - 1 - rank`` of ``2 x size`` equal chunks, in that order."""
    if length % (2 * size):
        raise PipelineError(
            f"context parallelism over {size} cp ranks cuts each sequence into {2 * size} equal "
            f"chunks (an early and a late one per rank), but the sequence has {length} tokens: "
            f"use a sequence length divisible by {2 * size}"
        )
    chunk = length // (2 * size)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    late = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([early, late])


@dataclass(frozen=True)
class SequenceShards:
    """One cp rank's share of every sequence, and how its stages' attention sees the rest.

    ``group``: the cp group (the forward's collectives); ``back_group``: a second group of
    the same members (the backward's); ``implementation``: the attention the model was
    built with, run on the gathered keys and values.
    """

    group: Any
    back_group: Any
    rank: int
    size: int
    implementation: str

    def local(
        self, x: Tensor, pad: Tensor | None, pos: Tensor | None, first: bool
    ) -> tuple[Tensor, Tensor]:
        """A stage's input as this rank's tokens and their global position ids: the first
        stage keeps its tokens of the whole batch (positions ``0..t-1`` unless given);
        later stages get them so from the stage before."""
        if pad is not None:
            raise PipelineError(
                "context parallelism takes no attention_mask (padding): pack the documents "
                "into full rows and mark them with position_ids that restart at each one"
            )
        if first:
            length = x.shape[1]
            keep = shard_indices(length, self.rank, self.size, x.device)
            whole = pos if pos is not None else torch.arange(length, device=x.device)[None]
            return x[:, keep], whole.expand(x.shape[0], length)[:, keep]
        if pos is None:
            raise PipelineError(
                "a context-parallel stage after the first needs the position ids of its tokens "
                "beside the hidden states: every stage of the model must be context-parallel"
            )
        return x, pos

    def token_order(self, length: int, device: torch.device) -> Tensor:
        """Where each token of a sequence of ``length`` is among the ranks' tokens gathered
        rank by rank: the gathered keys and values put back in token order, so that
        attention sums over them in the order the unsharded model does (eager attention's
        softmax runs in float32)."""
        gathered = torch.cat(
            [shard_indices(length, r, self.size, device) for r in range(self.size)]
        )
        return torch.argsort(gathered)

    def mask(self, kind: str, config: Any, h: Tensor, pos: Tensor, pad: Tensor | None) -> Tensor:
        """The mask of this rank's queries against the whole sequence's keys, in token
        order, for attention of ``kind``; bool for sdpa, the additive float mask for eager
        attention.  ``[batch, 1, local, whole]``, or ``[1, 1, local, whole]`` when no row
        is packed (attention keeps a dense mask: its memory grows as local x whole)."""
        length = h.shape[1] * self.size
        query = shard_indices(length, self.rank, self.size, h.device)
        keys = torch.arange(length, device=h.device)
        # the whole rows' position ids, in token order
        positions = _gather_plain(pos, self.group)[:, self.token_order(length, pos.device)]
        # A document starts where the position ids do not go up by one (transformers' rule).
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        document = starts.cumsum(-1)
        allowed = keys[None, :] <= query[:, None]
        if kind == "sliding_attention" and getattr(config, "sliding_window", None) is not None:
            allowed = allowed & (keys[None, :] > query[:, None] - int(config.sliding_window))
        if starts[:, 1:].any():  # packed rows: each row its own documents
            same = document[:, query][:, :, None] == document[:, None, :]
            mask = (allowed[None] & same)[:, None]
        else:  # one document a row: one mask the rows share, [1, 1, local, whole]
            mask = allowed[None, None]
        if self.implementation == "sdpa":
            return mask
        return torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill(
            ~mask, torch.finfo(h.dtype).min
        )


def context_parallel(stages: object, cp_mesh: Any) -> Callable[[], None]:
    """Check that ``stages`` can be sharded over ``cp_mesh`` (a 1-D ``DeviceMesh``,
    ``mesh["cp"]``), and return what does it: give every Llama-family decoder stage its
    :class:`SequenceShards` and route its attention modules to the context-parallel
    attention.  Nothing changes until it is called (``parallelize`` runs every check of
    every plan first)."""
    group, ranks = _cp_group(cp_mesh)
    modules = _decoder_stages(stages)
    implementation = _implementation(modules)
    attentions = [
        (layer.self_attn, _original_attention(layer.self_attn, implementation))
        for stage in modules
        for layer in stage.layers
    ]
    return lambda: _shard(modules, attentions, group, ranks, implementation)


def _shard(
    modules: list[Any],
    attentions: list[tuple[Any, Callable[..., Any]]],
    group: Any,
    ranks: list[int],
    implementation: str,
) -> None:
    back_group = dist.new_group(ranks, use_local_synchronization=True)
    me = ranks.index(dist.get_rank())
    shards = SequenceShards(group, back_group, me, len(ranks), implementation)
    _register()
    for stage in modules:
        stage.context_parallel = shards
    for attention, function in attentions:
        attention.config = copy.copy(attention.config)  # this module's own: the model's stays
        attention.config._attn_implementation = ATTENTION_NAME
        attention.context_parallel = shards
        attention.attention_function = function


def _cp_group(cp_mesh: Any) -> tuple[Any, list[int]]:
    """The cp group and its members (global ranks) of ``cp_mesh``, checked to be 1-D."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
        what = f"a {cp_mesh.ndim}-D mesh" if isinstance(cp_mesh, DeviceMesh) else type(cp_mesh)
        raise PipelineError(
            f"zeropipe.parallelize: cp_mesh must be a 1-D DeviceMesh, the 'cp' dimension of the "
            f"pipeline's mesh (mesh['cp']), got {getattr(what, '__name__', what)}"
        )
    ranks = [int(r) for r in cp_mesh.mesh.flatten().tolist()]
    return cp_mesh.get_group(), ranks


def _decoder_stages(stages: object) -> list[Any]:
    """The stages to shard: the Llama-family stages of zeropipe.split (MoE stages refused)."""
    from zeropipe.adapters.hf import LlamaStage

    given = [stages] if isinstance(stages, nn.Module) else list(stages)  # type: ignore[call-overload]
    wrong = [type(s).__name__ for s in given if type(s) is not LlamaStage]
    if not given or wrong:
        raise PipelineError(
            f"zeropipe.parallelize(cp_mesh=) shards the stages zeropipe.split makes of a "
            f"Llama, Mistral, Qwen2 or Qwen3 model; got {', '.join(wrong) or 'no stages'} "
            f"(a whole model: split it first, then parallelize the stages; mixtures of experts "
            f"are not context-parallel yet)"
        )
    already = [s for s in given if getattr(s, "context_parallel", None) is not None]
    if already:
        raise PipelineError(
            "zeropipe.parallelize(cp_mesh=): these stages are context-parallel already; "
            "apply it once"
        )
    return given


def _implementation(stages: Sequence[Any]) -> str:
    names = {str(getattr(s.config, "_attn_implementation", None) or "eager") for s in stages}
    bad = sorted(names - set(_IMPLEMENTATIONS))
    if bad:
        raise PipelineError(
            f"zeropipe.parallelize(cp_mesh=): the model's attention is {', '.join(bad)}, but "
            f"context parallelism runs {' or '.join(_IMPLEMENTATIONS)} attention on the gathered "
            f"keys and values: build the model with attn_implementation='sdpa' (or 'eager')"
        )
    return names.pop()


def _original_attention(module: nn.Module, implementation: str) -> Callable[..., Any]:
    """The attention function the module would call: sdpa's, or its model's eager one."""
    if implementation == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if eager is None:
        raise PipelineError(
            f"zeropipe.parallelize(cp_mesh=): {type(module).__name__}'s module has no "
            f"eager_attention_forward; build the model with attn_implementation='sdpa'"
        )
    return eager


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, **kwargs: Any
) -> tuple[Tensor, Any]:
    """This rank's queries ``[b, heads, local, d]`` against every rank's keys and values,
    gathered along the sequence (dim 2), by the model's own attention implementation."""
    shards: SequenceShards = module.context_parallel  # type: ignore[assignment]
    both = _GatherSequence.apply(torch.stack([key, value]), shards)
    order = shards.token_order(both.shape[3], both.device)
    key, value = both.index_select(3, order).unbind(0)
    attend: Callable[..., tuple[Tensor, Any]] = module.attention_function  # type: ignore[assignment]
    return attend(module, query, key, value, mask, **kwargs)


class _GatherSequence(torch.autograd.Function):
    """Every cp rank's keys and values ``[2, b, heads, local, d]`` side by side along the
    sequence (dim 3, rank by rank); the backward sums each rank's part of the gradient
    over the ranks and keeps this rank's (on the second group)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shards: SequenceShards) -> Tensor:
        ctx.shards = shards
        return _gather_plain(x, shards.group, dim=3)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        shards: SequenceShards = ctx.shards
        parts = [g.contiguous() for g in grad.chunk(shards.size, dim=3)]
        if str(dist.get_backend(shards.back_group)) == "nccl":
            mine = torch.empty_like(parts[shards.rank])
            dist.reduce_scatter(mine, parts, group=shards.back_group)
            return mine, None
        whole = grad.contiguous()  # gloo has no reduce-scatter: sum everything, keep ours
        dist.all_reduce(whole, group=shards.back_group)
        return whole.chunk(shards.size, dim=3)[shards.rank].contiguous(), None


def _gather_plain(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """``x`` of every rank of ``group``, concatenated along ``dim`` in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
