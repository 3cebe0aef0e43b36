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
stages works; the sequence length must be divisible by the tp size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from zeropipe.adapters.context_parallel import context_parallel
from zeropipe.adapters.ep import ep_size, experts_of, parallelized_roots, shard_experts
from zeropipe.adapters.hf import SUPPORTED, hf_family, is_hf_model
from zeropipe.core.errors import PipelineError

__all__ = ["TP_FAMILIES", "parallelize"]

# The model classes whose decoder layers carry the plan, and those layers' classes.
TP_FAMILIES = tuple(name for name, family in SUPPORTED.items() if family == "llama")
_LAYERS = tuple(name.replace("ForCausalLM", "DecoderLayer") for name in TP_FAMILIES)
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")  # fmt: skip
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
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
    _check_not_parallel(layers)
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in layers:
        if sequence_parallel:
            _check_sequence_on_input(layer, size)
        parallelize_module(layer, tp_mesh, _plan(sequence_parallel))
        if sequence_parallel:
            _sequence_boundary(layer, tp_mesh)
        for name in _HEAD_NORMS:
            norm = _find(layer, name)
            if norm is not None:
                _per_head(norm, tp_mesh)


def _plan(sequence_parallel: bool) -> dict[str, Any]:
    """The plan of one decoder layer, by submodule name."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {name: ColwiseParallel() for name in _COLWISE}
    if not sequence_parallel:
        plan.update({name: RowwiseParallel() for name in _ROWWISE})
        return plan
    seq = Shard(1)
    # Inside the layer the residual stream is cut over the sequence; attention and MLP
    # gather it whole and hand back their part of the sum, reduce-scattered.
    plan.update({name: SequenceParallel(use_local_output=True) for name in _SP_NORMS})
    plan.update({name: RowwiseParallel(output_layouts=seq) for name in _ROWWISE})
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
    if isinstance(given, nn.Module) and hf_family(given) != "llama":
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


def _check_not_parallel(layers: list[nn.Module]) -> None:
    from torch.distributed.tensor import DTensor

    for layer in layers:
        if any(isinstance(p, DTensor) for p in layer.parameters()):
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
