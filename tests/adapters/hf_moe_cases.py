"""Small Hugging Face mixtures of experts and the reference their pipelines must equal.

Shared by test_hf_moe.py and its one 2-process launch (``distributed_cases`` runs in each
rank).  The reference is the unsplit model run microbatch by microbatch (as a pipeline
cuts the batch), each microbatch's loss combined as
``ce_sum_j / counted tokens + coef * aux_j / microbatches`` with ``aux_j`` the model's own
``aux_loss`` on microbatch j alone.  Models are built from tiny configs (no download).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases

COEF = 0.3  # large, so that a router term lost or counted twice moves the loss a lot
M = 3  # microbatches of the 6-row batches of hf_cases
MOE: dict[str, dict[str, Any]] = {
    # layer 1 dense (mlp_only_layers): routers on layers 0, 2 and 3 only
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": [1],
        "router_aux_loss_coef": COEF,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": COEF},
    # dense first block, a shared expert, grouped routing with the correction bias, MLA
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 8,
        "q_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "num_key_value_heads": 2,
    },
}


def build(
    arch: str,
    aux: bool = True,
    experts: str = "eager",
    dtype: torch.dtype = torch.float64,
    attn: str = "eager",
    kv_heads: int = 1,
) -> nn.Module:
    """A 4-layer ``arch`` (hidden 16, 2 heads, ``kv_heads`` key/value heads; DeepSeek-V3's
    MLA 2), the same on every process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"num_key_value_heads": kv_heads, **MOE[arch]}
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.0,
        output_router_logits=aux,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=dtype, attn_implementation=attn, experts_implementation=experts
    )
    if arch == "deepseek_v3":  # a bias that changes which experts are chosen
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return model


def reference(
    model: nn.Module, ids: Tensor, labels: Tensor, mask: Tensor | None = None, m: int = M
) -> tuple[float, dict[str, Tensor]]:
    """The unsplit model, microbatch by microbatch: sum_j ce_sum_j / T + coef * aux_j / m."""
    model.zero_grad(set_to_none=True)
    total_tokens = zeropipe.causal_lm_loss.count(labels)
    loss: Any = 0.0
    for j, (x, y) in enumerate(zip(ids.chunk(m), labels.chunk(m), strict=True)):
        pad = None if mask is None else mask.chunk(m)[j]
        out = model(x, attention_mask=pad, labels=y)
        ce_sum, _ = zeropipe.causal_lm_loss.sum_and_count(out.logits, y)
        loss = loss + ce_sum / total_tokens
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + model.router_aux_loss_coef * out.aux_loss.double() / m
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def step_errors(
    model: nn.Module,
    pipe: zeropipe.Pipeline,
    inputs: Any,
    labels: Tensor,
    ref: tuple[float, dict[str, Tensor]],
    mine: set[int] | None = None,
) -> dict[str, float]:
    """One pipelined step against ``ref``: the loss difference, the largest gradient
    difference over the parameters in ``mine`` (all if None; relative to float32's precision
    for the float32 router weights of DeepSeek-V3), the loss and how many were compared."""
    ref_loss, ref_grads = ref
    model.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, labels).item()
    grad, checked = 0.0, 0
    for name, p in model.named_parameters():
        if mine is not None and id(p) not in mine:
            continue
        assert (p.grad is None) == (name not in ref_grads), name
        if p.grad is not None:
            scale = 1.0 if p.dtype == torch.float64 else 1e-5
            grad = max(grad, (p.grad - ref_grads[name]).abs().max().item() * scale)
            checked += 1
    return {"loss": abs(loss - ref_loss), "grad": grad, "value": loss, "checked": checked}


def worst(
    model: nn.Module,
    pipe: zeropipe.Pipeline,
    inputs: Any,
    labels: Tensor,
    ref: tuple[float, dict[str, Tensor]],
) -> tuple[float, float]:
    """The loss and largest gradient differences of one step (:func:`step_errors`)."""
    errors = step_errors(model, pipe, inputs, labels, ref)
    return errors["loss"], errors["grad"]


def cut(model: nn.Module, stages: int) -> list[nn.Module]:
    """The 4-layer model in 4, 2 or 1 stages."""
    return zeropipe.split(model, stages, balance={4: [1, 1, 1, 1], 2: [2, 2], 1: [4]}[stages])


def distributed_cases(rank: int, world: int) -> dict[str, Any]:
    """Qwen3-MoE with its router loss on 2 processes: a 2-rank pipeline under 1f1b and zbv,
    and 2 data-parallel replicas of a 1-rank pipeline, each on its half of the batch (the
    router term averaged over the global batch's microbatches).  Per case: the loss and
    gradient differences from the reference, and how many gradients were compared."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    ids, labels = hf_cases.batch(0, 8)
    out: dict[str, Any] = {}
    for name in ("1f1b", "zbv"):
        model = build("qwen3_moe")
        ref = reference(model, ids, labels)
        schedule = zeropipe.build_schedule(name, ranks=2, microbatches=M)
        stages = cut(model, schedule.num_stages)
        pipe = zeropipe.Pipeline(stages, schedule, loss_fn=zeropipe.causal_lm_loss)
        mine = {id(p) for p in pipe.parameters()}
        out[f"pp2 {name}"] = step_errors(model, pipe, ids, labels, ref, mine)
    model = build("qwen3_moe")
    ref = reference(model, ids, labels, m=world * M)  # every replica's microbatches
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    pipe = zeropipe.Pipeline(
        cut(model, 1), "1f1b", loss_fn=zeropipe.causal_lm_loss, microbatches=M, mesh=mesh
    )
    half = (torch.tensor_split(ids, world)[rank], torch.tensor_split(labels, world)[rank])
    out["dp2"] = step_errors(model, pipe, *half, ref)  # the loss: this replica's share
    return out
