"""Small Hugging Face causal LMs and the check that a pipeline gives their own loss and gradients.

Shared by the local tests and the one 2-process launch (``distributed_cases`` runs in
each rank).  Models are built from configs (no download) in float64 with eager
attention and no dropout, so a pipelined step equals the model's own to ~1e-15.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import whole_grads

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
SCHEDULES = ("gpipe", "1f1b", "zb-h2", "interleaved-1f1b", "zbv")
TOL = 1e-10


def build(arch: str, tied: bool, attn: str = "eager", layers: int = 4) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg: Any = GPT2Config(
            vocab_size=64,
            n_embd=16,
            n_layer=layers,
            n_head=2,
            n_positions=32,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            tie_word_embeddings=tied,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        cfg = AutoConfig.for_model(
            arch,
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
            attention_dropout=0.0,
        )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation=attn)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    return model


def batch(step: int, seq: int) -> tuple[Tensor, Tensor]:
    """Input ids and labels partly -100, so microbatches count different numbers of tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (6, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 2] = -100
    labels[3, 2:] = -100
    labels[5, 1] = -100
    return ids, labels


STEPS = ((0, 8), (1, 6))  # (step, sequence length): the length changes between steps


def reference(model: nn.Module, ids: Tensor, labels: Tensor) -> tuple[float, dict[str, Tensor]]:
    """The model's own loss and gradients (its logits, HF's shifted mean loss in float64)."""
    model.zero_grad(set_to_none=True)
    loss = zeropipe.causal_lm_loss(model(ids).logits, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


# Microbatches of their own (rows, sequence length), each length divisible by 4 (a cp of 2).
VARLEN = ((2, 8), (1, 12), (3, 4))


def varlen_batches() -> zeropipe.Microbatches:
    """Three microbatches of ``VARLEN``'s shapes, some labels ignored."""
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 64, shape, generator=g) for shape in VARLEN]
    labels = [t.clone() for t in ids]
    labels[1][0, :3] = -100
    return zeropipe.Microbatches(inputs=ids, targets=labels)


def varlen_reference(model: nn.Module) -> tuple[float, dict[str, Tensor]]:
    """``model`` on ``varlen_batches``: its token losses summed over every microbatch, over
    every counted token (what a step over those microbatches must give)."""
    batches, fn = varlen_batches(), zeropipe.causal_lm_loss
    assert batches.targets is not None
    pairs = zip(batches.inputs, batches.targets, strict=True)
    sums = [fn.sum_and_count(model(input_ids=x, use_cache=False).logits, t)[0] for x, t in pairs]
    loss = torch.stack(sums).sum() / sum(fn.count(t) for t in batches.targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def varlen_step(model: nn.Module, stages: list[nn.Module], mesh: Any) -> dict[str, Any]:
    """One zbv step of ``model``'s (parallelized) ``stages`` over ``varlen_batches``: the
    loss and this process's stages' whole gradients."""
    pipe = zeropipe.Pipeline(
        stages,
        "zbv",
        microbatches=len(VARLEN),
        loss_fn=zeropipe.causal_lm_loss,
        mesh=mesh,
        options=zeropipe.RuntimeOptions(timeout=60.0),
    )
    loss = pipe.step(varlen_batches())
    return {"loss": loss.item(), "grads": whole_grads(model)}


def errors(arch: str, tied: bool, schedule: str, local: bool = True) -> dict[str, float]:
    """Largest loss and gradient differences from the model's own, over ``STEPS``."""
    model = build(arch, tied)
    refs = [reference(model, *batch(step, seq)) for step, seq in STEPS]
    chunks = 2 if schedule in ("interleaved-1f1b", "zbv") else 1
    stages = zeropipe.split(model, 2 * chunks, balance=[1, 1, 1, 1] if chunks == 2 else [2, 2])
    pipe = zeropipe.Pipeline(
        stages,
        zeropipe.build_schedule(schedule, ranks=2, microbatches=3),
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local" if local else None,
    )
    mine = {id(p) for p in pipe.parameters()}
    worst = {"loss": 0.0, "grad": 0.0, "checked": 0.0}
    for (step, seq), (ref_loss, ref_grads) in zip(STEPS, refs, strict=True):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(*batch(step, seq))
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss))
        for name, p in model.named_parameters():
            if id(p) not in mine:
                continue
            assert p.grad is not None, f"{arch} {schedule}: {name} has no gradient"
            worst["grad"] = max(worst["grad"], (p.grad - ref_grads[name]).abs().max().item())
            worst["checked"] += 1
    return worst


def distributed_cases(rank: int, world: int) -> dict[str, Any]:
    """Every architecture, tied and untied, under every schedule, in this rank."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for arch in ARCHS:
        for tied in (False, True):
            for schedule in SCHEDULES:
                out[f"{arch} tied={tied} {schedule}"] = errors(arch, tied, schedule, local=False)
    return out
