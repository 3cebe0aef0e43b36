"""``zeropipe.split`` on Hugging Face mixtures of experts: the model's own loss and gradients,
the router's load-balancing loss included, exactly.

The reference is the unsplit model run microbatch by microbatch (as a pipeline cuts the
batch), each microbatch's loss combined as ``ce_sum_j / counted tokens + coef * aux_j / m``
with ``aux_j`` the model's own ``aux_loss`` on microbatch j.  Models come from tiny configs
(no download) in float64; skipped where transformers is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import hf_cases, hf_mask_cases
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint, offload
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.step.loss_contract import LossContract

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
) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"num_key_value_heads": 1, **MOE[arch]}
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
    model: nn.Module, ids: Tensor, labels: Tensor, mask: Tensor | None = None
) -> tuple[float, dict[str, Tensor]]:
    """The unsplit model, microbatch by microbatch: sum_j ce_sum_j / T + coef * aux_j / M."""
    model.zero_grad(set_to_none=True)
    total_tokens = zeropipe.causal_lm_loss.count(labels)
    loss: Any = 0.0
    for j, (x, y) in enumerate(zip(ids.chunk(M), labels.chunk(M), strict=True)):
        pad = None if mask is None else mask.chunk(M)[j]
        out = model(x, attention_mask=pad, labels=y)
        ce_sum, _ = zeropipe.causal_lm_loss.sum_and_count(out.logits, y)
        loss = loss + ce_sum / total_tokens
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + model.router_aux_loss_coef * out.aux_loss.double() / M
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def worst(
    model: nn.Module, pipe: zeropipe.Pipeline, inputs: Any, labels: Tensor, ref: Any
) -> tuple[float, float]:
    """Loss and largest gradient difference (relative to float32's precision for the
    float32 router weights of DeepSeek-V3) of one pipelined step from ``ref``."""
    ref_loss, ref_grads = ref
    model.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, labels).item()
    grad = 0.0
    for name, p in model.named_parameters():
        assert (p.grad is None) == (name not in ref_grads), name
        if p.grad is not None:
            scale = 1.0 if p.dtype == torch.float64 else 1e-5
            grad = max(grad, (p.grad - ref_grads[name]).abs().max().item() * scale)
    return abs(loss - ref_loss), grad


def cut(model: nn.Module, stages: int) -> list[nn.Module]:
    return zeropipe.split(model, stages, balance=[1, 1, 1, 1] if stages == 4 else [2, 2])


@pytest.mark.parametrize("arch", list(MOE))
def test_every_generator_recompute_and_offload_give_the_reference(arch: str) -> None:
    model = build(arch)
    ids, labels = hf_cases.batch(0, 8)
    ref = reference(model, ids, labels)
    names = list(GENERATORS) if arch == "qwen3_moe" else ["auto", "1f1b", "zbv", "dualpipev"]
    cases = [(n, zeropipe.build_schedule(n, ranks=2, microbatches=M)) for n in names]
    base = zeropipe.build_schedule("1f1b", ranks=2, microbatches=M).compute_only()
    cases += [("1f1b+recompute", checkpoint(base)), ("1f1b+offload", offload(base))]
    for name, schedule in cases:
        stages = cut(model, schedule.num_stages)
        pipe = zeropipe.Pipeline(stages, schedule, loss_fn=zeropipe.causal_lm_loss, mesh="local")
        loss, grad = worst(model, pipe, ids, labels, ref)
        assert loss <= hf_cases.TOL and grad <= hf_cases.TOL, (arch, name, loss, grad)


def test_the_router_term_is_the_models_own_aux_loss_bit_for_bit() -> None:
    for arch in ("qwen3_moe", "mixtral"):
        model = build(arch)
        ids, _ = hf_cases.batch(1, 6)
        expected = model(ids).aux_loss
        h: Any = ids
        for stage in cut(model, 4):
            h = stage(*(h if isinstance(h, tuple) else (h,)))
        logits, term = h
        assert torch.equal(logits, model(ids).logits)
        assert term.dtype == torch.float64
        assert torch.equal(term, COEF * expected.double()), (arch, term, expected)
        # each stage's output carries the running sums: [2, experts] float32
        middle = cut(model, 2)[0](ids)
        assert isinstance(middle, tuple) and middle[1].shape == (2, 4)
        assert middle[1].dtype == torch.float32 and middle[1].requires_grad


def test_without_the_router_loss_or_in_deepseek_v3_nothing_is_added() -> None:
    ids, labels = hf_cases.batch(0, 8)
    for arch, aux in (("qwen3_moe", False), ("deepseek_v3", True)):
        model = build(arch, aux=aux)
        out = model(ids)
        assert getattr(out, "aux_loss", None) is None  # transformers adds none either
        stages = cut(model, 2)
        assert isinstance(stages[1](stages[0](ids)), Tensor)  # logits alone cross out
        ref = hf_cases.reference(model, ids, labels)  # cross-entropy only
        pipe = zeropipe.Pipeline(stages, "1f1b", loss_fn=zeropipe.causal_lm_loss, microbatches=M)
        loss, grad = worst(model, pipe, ids, labels, ref)
        assert loss <= hf_cases.TOL and grad <= hf_cases.TOL, (arch, loss, grad)


def test_each_experts_implementation_gives_the_reference() -> None:
    ids, labels = hf_cases.batch(0, 8)
    for experts, dtype, tol in (
        ("batched_mm", torch.float64, hf_cases.TOL),
        # torch's grouped_mm takes float32, bfloat16 and float16 only: float32 noise
        ("grouped_mm", torch.float32, 1e-5),
    ):
        for arch in ("qwen3_moe", "deepseek_v3"):
            model = build(arch, experts=experts, dtype=dtype)
            assert model.config._experts_implementation == experts
            ref = reference(model, ids, labels)
            schedule = zeropipe.build_schedule("zbv", ranks=2, microbatches=M)
            pipe = zeropipe.Pipeline(
                cut(model, 4), schedule, loss_fn=zeropipe.causal_lm_loss, mesh="local"
            )
            loss, grad = worst(model, pipe, ids, labels, ref)
            grad_tol = tol if dtype == torch.float64 else tol * 1e-5  # worst() scaled it
            assert loss <= tol and grad <= grad_tol, (experts, arch, loss, grad)


def test_padding_excludes_pads_from_the_router_loss_as_the_model_does() -> None:
    model = build("mixtral")
    ids, mask, labels = hf_mask_cases.padded_batch("right")
    ref = reference(model, ids, labels, mask)
    unmasked = reference(model, ids, labels)[0]
    assert abs(unmasked - ref[0]) > 1e-6  # the mask changes the router loss
    schedule = zeropipe.build_schedule("interleaved-1f1b", ranks=2, microbatches=M)
    pipe = zeropipe.Pipeline(cut(model, 4), schedule, loss_fn=zeropipe.causal_lm_loss)
    loss, grad = worst(model, pipe, (ids, mask), labels, ref)
    assert loss <= hf_cases.TOL and grad <= hf_cases.TOL, (loss, grad)


def test_a_measured_cut_and_stages_holding_the_models_parameters() -> None:
    model = build("qwen3_moe")
    ids, labels = hf_cases.batch(0, 8)
    ref = reference(model, ids, labels)
    stages = zeropipe.split(model, 3)  # cut by measured time
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    pipe = zeropipe.Pipeline(stages, "gpipe", loss_fn=zeropipe.causal_lm_loss, microbatches=M)
    loss, grad = worst(model, pipe, ids, labels, ref)
    assert loss <= hf_cases.TOL and grad <= hf_cases.TOL, (loss, grad)


def test_what_cannot_be_exact_is_refused() -> None:
    model = build("qwen3_moe")
    stages = cut(model, 2)
    ids, labels = hf_cases.batch(0, 8)
    # the second stage without the first's router sums
    with pytest.raises(PipelineError, match=r"router sums \[2, 4\]"):
        stages[1](stages[0](ids)[0])
    # the router term averaged over microbatches across data-parallel replicas
    step = LossContract(zeropipe.causal_lm_loss).for_step(
        list(labels.chunk(M)), [2] * M, total=lambda local: 2 * local
    )
    out = stages[1](*stages[0](ids[:2]))
    with pytest.raises(PipelineError, match="data-parallel replicas"):
        step.compute(out, labels[:2], 0)
    # the stages of a mixture of experts are zeropipe.split's to build
    from zeropipe.adapters.hf import split_hf

    with pytest.raises(PipelineError, match=r"mixture of experts: cut it with zeropipe\.split"):
        split_hf(model, 2, [2, 2])
