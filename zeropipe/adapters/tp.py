"""``zeropipe.parallelize(stages_or_model, tp_mesh, *, ep_mesh=, cp_mesh=)``: tensor, expert
and context parallelism.

Tensor parallelism is the standard plan on HF models; expert parallelism
(``ep_mesh=``) shards a mixture's experts (:mod:`zeropipe.adapters.ep`); context
parallelism (``cp_mesh=``) shards each sequence (:mod:`zeropipe.adapters.context_parallel`).

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stages = zeropipe.split(model, 4, balance=[1, 1, 1, 1])
    zeropipe.parallelize(stages, mesh["tp"])          # or the whole model, before split
    pipe = zeropipe.Pipeline(stages, "zbv", microbatches=8, loss_fn=zeropipe.causal_lm_loss,
                             mesh=mesh)

The plan (Megatron's, as torchtitan and transformers' own ``base_model_tp_plan`` give it),
per decoder layer of the Llama family (Llama, Mistral, Qwen2, Qwen3)::

    input_layernorm, post_attention_layernorm   replicated (plain tensors, full hidden states)
    q_proj, k_proj, v_proj                      ColwiseParallel: each rank its heads
    q_norm, k_norm (Qwen3)                      per head, on the rank's heads; weight a
                                                replicated DTensor whose gradient is summed
    o_proj                                      RowwiseParallel: all-reduce, plain output
    gate_proj, up_proj                          ColwiseParallel
    down_proj                                   RowwiseParallel

The mixtures of experts (Qwen3-MoE, Mixtral, DeepSeek-V3) get the same plan on
their attention and on their dense MLPs (Qwen3-MoE's ``mlp_only_layers``,
DeepSeek-V3's first dense layers and its shared experts).  Their sparse blocks
(the router and the experts) stay replicated over "tp": after attention's
row-wise all-reduce every rank holds the whole hidden states, so each routes the
same tokens to the same experts, and their gradients come out whole and equal
on every rank, as a replicated norm's do (no sum over "tp"; ``ep_mesh=`` may
shard those experts over the replicas).  DeepSeek-V3's latent attention (MLA)::

    q_a_proj, q_a_layernorm, kv_a_layernorm     replicated (the latent, before the heads)
    q_proj or q_b_proj, kv_b_proj               ColwiseParallel: each rank its heads
    kv_a_proj_with_mqa                          replicated; its rotary key part is one key
                                                every head reads, so its gradient (each
                                                rank's heads' share) is summed over "tp"
    o_proj                                      RowwiseParallel

Every module's input and output stays a plain tensor holding the full hidden
states (``use_local_output=True``), so the pipeline sends the same tensors as
without tensor parallelism and HF's attention, which reshapes with ``-1``
heads and keeps ``num_key_value_groups`` (a ratio tensor parallelism leaves
unchanged), runs on the rank's heads as it is; checked on transformers 5.24.
The embedding, the final norm and the LM head stay replicated, not
vocabulary-sharded: the pipeline's loss runs on whole logits, and a
vocabulary-parallel loss is not written yet.

``sequence_parallel=True`` also shards the residual stream inside each decoder
layer over the sequence (torch's ``SequenceParallel`` on its two norms, whose
weight gradients are summed over "tp"): a layer takes and returns the whole
hidden states (cut at its input, all-gathered at its output), so any cut into
stages works; the sequence length must be divisible by the tp size.  Dense
models only: a mixture's replicated sparse block would need the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeropipe.adapters.context_parallel import context_parallel
from zeropipe.adapters.ep import (
    ExpertParallel,
    ep_size,
    experts_of,
    parallelized_roots,
    shard_experts,
)
from zeropipe.adapters.hf import SUPPORTED, hf_family, is_hf_model
from zeropipe.core.errors import PipelineError

__all__ = ["TP_FAMILIES", "parallelize"]

# The model classes whose decoder layers carry the plan, and those layers' classes.
TP_FAMILIES = tuple(name for name, family in SUPPORTED.items() if family in ("llama", "moe"))
_LAYERS = tuple(name.replace("ForCausalLM", "DecoderLayer") for name in TP_FAMILIES)
# Attention's projections that make each rank's heads (MLA's q_b_proj and kv_b_proj too).
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
# Where a layer's dense MLP is: its MLP, or a mixture's shared experts.
_DENSE_MLPS = ("mlp", "mlp.shared_experts")
_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_SP_NORMS = ("input_layernorm", "post_attention_layernorm")


def parallelize(
    stages_or_model: nn.Module | Sequence[nn.Module],
    tp_mesh: Any = None,
    *,
    ep_mesh: Any = None,
    cp_mesh: Any = None,
    sequence_parallel: bool = False,
) -> nn.Module | list[nn.Module]:
    """Apply the tensor-parallel plan over ``tp_mesh`` to every decoder layer, and shard
    the experts of a mixture over ``ep_mesh`` (:mod:`zeropipe.adapters.ep`), in place.

    ``stages_or_model``: a supported Hugging Face causal LM (one of
    ``TP_FAMILIES``), or the stage modules ``zeropipe.split`` made of one.  The
    stages hold the model's own layers, so either order works: split, then
    parallelize the stages (every rank passes all of them, or only its own);
    or parallelize the model, then split it (a cut measured by split then runs
    on every rank, since the layers' collectives need all of "tp").  Returns
    what it was given.

    ``tp_mesh``: a 1-D ``DeviceMesh``, e.g. ``mesh["tp"]`` of the mesh the
    ``Pipeline`` gets.  Attention heads and key/value heads must both be
    divisible by its size.

    ``ep_mesh``: a 1-D ``DeviceMesh`` the experts of Qwen3-MoE, Mixtral or
    DeepSeek-V3 are sharded over, each rank holding ``experts / ep`` of them
    (``mesh["dp"]`` in a pipeline, or blocks of ep consecutive replicas of it: expert
    parallelism inside the data-parallel replicas, which then reduce expert gradients
    only over the replicas holding the same experts).  The experts count must be divisible by its size.
    With ``tp_mesh`` too, each tp rank of a replica holds the same experts and routes the
    same tokens, exchanged with the ranks of its own ep group (its tp position's).

    ``cp_mesh``: a 1-D ``DeviceMesh`` (``mesh["cp"]``) the sequence of every row is
    sharded over, each rank running the stages on its tokens and attending to every
    rank's keys and values (:mod:`zeropipe.adapters.context_parallel`); stages only
    (split first), of the Llama family, with eager or sdpa attention.  At least one of
    the meshes is given.  Nothing is changed when a check fails
    (:class:`PipelineError` naming the values and the fix).
    """
    experts = None if ep_mesh is None else experts_of(stages_or_model, ep_size(ep_mesh))
    if cp_mesh is not None and sequence_parallel:
        raise PipelineError(
            "zeropipe.parallelize: cp_mesh= shards the sequence already; use "
            "sequence_parallel=False with it"
        )
    shard_sequence = None if cp_mesh is None else context_parallel(stages_or_model, cp_mesh)
    if tp_mesh is not None or (ep_mesh is None and cp_mesh is None):  # none: tp's checks refuse
        _tensor_parallel(stages_or_model, tp_mesh, sequence_parallel)
    if experts is not None:
        shard_experts(experts, ep_mesh)
    if shard_sequence is not None:
        shard_sequence()
    return stages_or_model if isinstance(stages_or_model, nn.Module) else list(stages_or_model)


def _tensor_parallel(stages_or_model: object, tp_mesh: Any, sequence_parallel: bool) -> None:
    """The tensor-parallel plan applied to every decoder layer (checked first)."""
    layers = _decoder_layers(stages_or_model)
    size = _tp_size(tp_mesh)
    for layer in layers:
        _check_heads(layer, size)
        if sequence_parallel:
            _check_dense(layer)
    _check_not_parallel(layers)
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in layers:
        if sequence_parallel:
            _check_sequence_on_input(layer, size)
        parallelize_module(layer, tp_mesh, _plan(layer, sequence_parallel))
        if sequence_parallel:
            _sequence_boundary(layer, tp_mesh)
        for name in _HEAD_NORMS:
            norm = _find(layer, name)
            if norm is not None:
                _per_head(norm, tp_mesh)
        if _find(layer, "self_attn.kv_a_proj_with_mqa") is not None:
            _sum_rotary_key_grads(layer.get_submodule("self_attn"), tp_mesh)


def _projections(layer: nn.Module) -> tuple[list[str], list[str]]:
    """The column-wise and the row-wise linears of one decoder layer, by submodule name:
    attention's (each rank its heads) and its dense MLPs' (none in a sparse block)."""
    colwise = [
        f"self_attn.{name}"
        for name in _HEAD_PROJECTIONS
        if _find(layer, f"self_attn.{name}") is not None
    ]
    rowwise = ["self_attn.o_proj"]
    for mlp in _DENSE_MLPS:
        if _find(layer, f"{mlp}.gate_proj") is not None:
            colwise += [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            rowwise.append(f"{mlp}.down_proj")
    return colwise, rowwise


def _plan(layer: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The plan of one decoder layer, by submodule name."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    colwise, rowwise = _projections(layer)
    plan: dict[str, Any] = {name: ColwiseParallel() for name in colwise}
    if not sequence_parallel:
        plan.update({name: RowwiseParallel() for name in rowwise})
        return plan
    seq = Shard(1)
    # Inside the layer the residual stream is cut over the sequence; attention and MLP
    # gather it whole and hand back their part of the sum, reduce-scattered.
    plan.update({name: SequenceParallel(use_local_output=True) for name in _SP_NORMS})
    plan.update({name: RowwiseParallel(output_layouts=seq) for name in rowwise})
    plan["self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": seq},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    )
    plan["mlp"] = PrepareModuleInput(
        input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    return plan


def _sequence_boundary(layer: nn.Module, tp_mesh: Any) -> None:
    """A sequence-parallel layer takes and returns whole hidden states (stages cut anywhere);
    its norms' weight gradients, partial sums over the rank's positions, are summed."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    boundary = PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    )
    parallelize_module(layer, tp_mesh, boundary)
    for name in _SP_NORMS:
        _sum_grads_over_tp(layer.get_submodule(name))


# -- what is parallelized -----------------------------------------------------------------
def _decoder_layers(given: object) -> list[nn.Module]:
    """The supported decoder layers of a model or of its stages, each once, in order."""
    if isinstance(given, nn.Module) and hf_family(given) not in ("llama", "moe"):
        raise PipelineError(_unsupported(type(given).__name__, given))
    roots = parallelized_roots(given)
    layers: dict[int, nn.Module] = {}
    others: set[str] = set()
    for root in roots:
        for module in root.modules():
            name = _layer_class(module)
            if name in _LAYERS:
                layers.setdefault(id(module), module)
            elif name is not None:
                others.add(name)
    # a supported layer's own blocks (a mixture's sparse MoE block) are part of its plan
    others -= {_layer_class(m) for layer in layers.values() for m in layer.modules()}
    if not layers or others:
        what = sorted(others) or [type(r).__name__ for r in roots]
        raise PipelineError(_unsupported(", ".join(dict.fromkeys(what)), None))
    return list(layers.values())


def _layer_class(module: nn.Module) -> str | None:
    """The transformers decoder-layer class ``module`` is (or derives from), if any."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.") and (
            cls.__name__ in _LAYERS or cls.__name__.endswith(("DecoderLayer", "Block"))
        ):
            return cls.__name__
    return None


def _unsupported(what: str, model: object) -> str:
    where = "the Hugging Face model " if model is not None and is_hf_model(model) else ""
    return (
        f"zeropipe.parallelize has no tensor-parallel plan for {where}{what}: it supports the "
        f"decoder layers of {', '.join(TP_FAMILIES)} (a whole model, or the stages "
        f"zeropipe.split made of one); parallelize other models yourself with torch's "
        f"parallelize_module before passing them to Pipeline"
    )


def _tp_size(tp_mesh: Any) -> int:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(tp_mesh, DeviceMesh):
        raise PipelineError(
            f"zeropipe.parallelize: tp_mesh must be a 1-D DeviceMesh (the 'tp' dimension of "
            f"the pipeline's mesh, mesh['tp']), got {type(tp_mesh).__name__}; for expert "
            f"parallelism alone pass ep_mesh= only"
        )
    if tp_mesh.ndim != 1:
        names = tp_mesh.mesh_dim_names or ()
        raise PipelineError(
            f"zeropipe.parallelize: tp_mesh must be a 1-D DeviceMesh, got a {tp_mesh.ndim}-D "
            f"mesh (dims {', '.join(map(repr, names)) or 'unnamed'}); pass its 'tp' dimension, "
            f"mesh['tp']"
        )
    return int(tp_mesh.size())


def _check_heads(layer: nn.Module, size: int) -> None:
    config = getattr(layer.get_submodule("self_attn"), "config", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads <= 0:
        raise PipelineError(
            f"zeropipe.parallelize: {type(layer).__name__}.self_attn has no config with "
            f"num_attention_heads; the plan was checked on transformers 5.24"
        )
    if heads % size or kv % size:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and kv % d == 0]
        raise PipelineError(
            f"zeropipe.parallelize: the model has {heads} attention heads and {kv} key/value "
            f"heads, and tensor parallelism gives each of the {size} 'tp' ranks whole heads of "
            f"both: use a tp size dividing both ({', '.join(map(str, fits))}), or a model "
            f"whose head counts {size} divides"
        )


def _check_dense(layer: nn.Module) -> None:
    """Sequence parallelism: refused on a layer whose MLP is a sparse block or whose
    attention is latent (their plans replicate what would need the whole sequence)."""
    replicated = {
        "mlp.experts": "a mixture of experts",
        "self_attn.kv_a_proj_with_mqa": "latent attention (MLA)",
    }
    for name, what in replicated.items():
        if _find(layer, name) is not None:
            raise PipelineError(
                f"zeropipe.parallelize(sequence_parallel=True): {type(layer).__name__} holds "
                f"{what}, which the tensor-parallel plan keeps replicated over 'tp' on whole "
                f"sequences; use sequence_parallel=False with mixtures of experts"
            )


def _check_not_parallel(layers: list[nn.Module]) -> None:
    from torch.distributed.tensor import DTensor

    for layer in layers:
        # experts sharded over "ep" first are DTensors too; the plan leaves them as they are
        sharded = [m for m in layer.modules() if isinstance(m, ExpertParallel)]
        experts = {id(p) for m in sharded for p in m.parameters()}
        if any(isinstance(p, DTensor) and id(p) not in experts for p in layer.parameters()):
            raise PipelineError(
                f"zeropipe.parallelize: a {type(layer).__name__} already holds DTensor "
                f"parameters (parallelize was called on the model or on its stages already); "
                f"apply it once, to the model or to its stages"
            )


def _find(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


# -- per-head norms and summed gradients ------------------------------------------------
def _per_head(norm: nn.Module, tp_mesh: Any) -> None:
    """A norm over ``head_dim`` (Qwen3's q_norm / k_norm) run on this rank's heads.

    Its input ``[batch, seq, heads / tp, head_dim]`` becomes a DTensor sharded on
    the heads and its weight a replicated DTensor, so that the weight's
    gradient (a sum over every head) is known to be partial and summed over "tp".
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_module

    def heads_in(_module: nn.Module, inputs: Any, mesh: Any) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
            if isinstance(x, Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def local_out(_module: nn.Module, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(norm, tp_mesh, input_fn=heads_in, output_fn=local_out)
    _sum_grads_over_tp(norm)


def _sum_grads_over_tp(module: nn.Module) -> None:
    """Each replicated DTensor parameter of ``module`` gets its gradient summed over "tp".

    A norm run on a rank's heads or sequence positions leaves its weight's
    gradient ``Partial``: each rank holds its part of the sum.  A hook on the
    parameter all-reduces it before it is accumulated, so ``.grad`` is
    ``Replicate`` and whole on every rank, as the optimizer and clipping expect.
    """
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters(recurse=False):
        if not isinstance(p, DTensor):
            raise PipelineError(f"{type(module).__name__}.{name} is not a DTensor after the plan")
        p.register_hook(_replicated_grad)


def _replicated_grad(grad: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(grad, DTensor) and not all(p.is_replicate() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def _sum_rotary_key_grads(attention: nn.Module, tp_mesh: Any) -> None:
    """MLA's rotary key, made whole again in backward.

    ``kv_a_proj_with_mqa`` (replicated) outputs the key/value latent, then
    ``qk_rope_head_dim`` columns: one rotary key that every head reads.  A rank runs
    its heads only, so the gradient of those columns holds its heads' share; they are
    summed over "tp" (the latent's columns arrive whole already: ``kv_b_proj``'s
    column-wise input sums its gradient).
    """
    mla: Any = attention
    start = int(mla.kv_lora_rank)
    group = tp_mesh.get_group()

    def shared_key(_module: nn.Module, _args: Any, out: Tensor) -> Tensor:
        return _SumColumnsGrad.apply(out, start, group)

    attention.get_submodule("kv_a_proj_with_mqa").register_forward_hook(shared_key)


class _SumColumnsGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last columns (from ``start``) over
    ``group`` and passes the others as they are."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, start: int, group: Any) -> Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        out = grad.clone()
        shared = out[..., ctx.start :].contiguous()
        dist.all_reduce(shared, group=ctx.group)
        out[..., ctx.start :] = shared
        return out, None, None


def _check_sequence_on_input(layer: nn.Module, size: int) -> None:
    """Sequence parallelism cuts the sequence evenly: refuse a length ``size`` does not divide."""

    def check(_module: nn.Module, args: tuple[Any, ...]) -> None:
        h = args[0] if args else None
        if isinstance(h, Tensor) and h.dim() >= 2 and h.shape[1] % size:
            raise PipelineError(
                f"zeropipe.parallelize(sequence_parallel=True): a decoder layer got "
                f"{h.shape[1]} positions, which the {size} 'tp' ranks cannot share evenly; "
                f"use sequence lengths divisible by {size}, or sequence_parallel=False"
            )

    layer.register_forward_pre_hook(check)
