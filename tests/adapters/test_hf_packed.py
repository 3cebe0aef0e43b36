"""Packed documents: a split Hugging Face model takes a dict batch whose position ids restart
at each document, and attention never crosses one, exactly as each document run alone.

Rows hold two documents each (their lengths differ from row to row); ``position_ids`` count
from 0 in each.  transformers masks such rows apart itself when it is given position ids and
no attention mask; the stages pass the position ids on, so every stage builds that mask and
the rotary positions of its documents.  The reference is the unsplit model on the same dict,
checked first against each document run alone.  float64, eager attention, no dropout.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules import GENERATORS

pytest.importorskip("transformers", reason="the Hugging Face adapter needs transformers")

SEQ = 12
FIRST = (5, 3, 7, 4, 9, 6)  # the first document's length in each row


def packed(seed: int = 0) -> tuple[dict[str, Tensor], Tensor]:
    """Six rows of two documents, and labels where no document's first token is predicted
    from the one before it (nor a -100 row part, so microbatches count differently)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (len(FIRST), SEQ), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n), torch.arange(SEQ - n)]) for n in FIRST])
    labels = ids.clone()
    labels[pos == 0] = -100  # a document's first token starts it: nothing predicts it
    labels[2, -3:] = -100
    return {"input_ids": ids, "position_ids": pos}, labels


def reference(model: nn.Module, batch: dict[str, Tensor], labels: Tensor) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = zeropipe.causal_lm_loss(model(**batch, use_cache=False).logits, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_the_reference_masks_documents_apart(arch: str) -> None:
    # What the pipeline is compared with: each document's logits are those of it alone.
    model = hf_cases.build(arch, tied=True)
    batch, _ = packed()
    with torch.no_grad():
        # Without a cache: transformers masks packed rows apart only when there is none, and
        # a model whose config says use_cache=True makes one even in training.
        logits = model(**batch, use_cache=False).logits
        for row, n in enumerate(FIRST):
            for doc in (slice(0, n), slice(n, SEQ)):
                alone = model(batch["input_ids"][row : row + 1, doc]).logits[0]
                assert (logits[row, doc] - alone).abs().max().item() <= 1e-12, (arch, row, doc)
        # and without the position ids, or with a cache, the second document sees the first
        for crossed in (model(batch["input_ids"]).logits, model(**batch).logits):
            assert (crossed - logits).abs().max().item() > 1e-3


def _pipeline(model: nn.Module, name: str) -> zeropipe.Pipeline:
    schedule = zeropipe.build_schedule(name, ranks=2, microbatches=3)
    per_stage = 4 // schedule.num_stages  # the models have 4 decoder layers
    stages = zeropipe.split(model, schedule.num_stages, balance=[per_stage] * schedule.num_stages)
    return zeropipe.Pipeline(stages, schedule, loss_fn=zeropipe.causal_lm_loss)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_generator_gives_the_documents_own_loss_and_gradients(arch: str) -> None:
    model = hf_cases.build(arch, tied=True)
    batch, labels = packed()
    ref_loss, ref_grads = reference(model, batch, labels)
    checked = []
    for name in sorted(GENERATORS):
        if name == "auto":
            continue
        try:
            pipe = _pipeline(model, name)
        except zeropipe.ScheduleError:
            continue  # a generator that needs more microbatches or stages than these
        model.zero_grad(set_to_none=True)
        loss = pipe.step(batch, labels)
        assert abs(loss.item() - ref_loss) <= hf_cases.TOL, (name, loss.item(), ref_loss)
        for n, p in model.named_parameters():
            assert p.grad is not None, (name, n)
            assert (p.grad - ref_grads[n]).abs().max().item() <= hf_cases.TOL, (name, n)
        checked.append(name)
    assert {"1f1b", "zbv", "zb-h1", "interleaved-1f1b", "dualpipev"} <= set(checked), checked


def test_positions_with_a_padding_mask_and_recompute_and_eval() -> None:
    model = hf_cases.build("qwen3", tied=False)
    batch, labels = packed(1)
    mask = torch.ones_like(batch["input_ids"])
    mask[4, -2:] = 0  # padding at a row's end: with a mask, transformers does not unpack rows
    labels[4, -2:] = -100
    full = {**batch, "attention_mask": mask}
    ref_loss, ref_grads = reference(model, full, labels)
    stages = zeropipe.split(model, 2)
    schedule = checkpoint(zeropipe.generate("1f1b", ranks=2, microbatches=3))
    pipe = zeropipe.Pipeline(stages, schedule, loss_fn=zeropipe.causal_lm_loss)
    assert any(a.kind.value == "R" for a in pipe.schedule.actions[0])
    loss = pipe.step(full, labels)
    assert abs(loss.item() - ref_loss) <= hf_cases.TOL
    for n, p in model.named_parameters():
        assert (p.grad - ref_grads[n]).abs().max().item() <= hf_cases.TOL, n
    # an evaluation step without a target returns the logits of the packed documents
    with torch.no_grad():
        logits = pipe.eval_step(batch)
        want = model(**batch, use_cache=False).logits
    assert isinstance(logits, Tensor) and (logits - want).abs().max().item() <= 1e-12


def test_dict_batches_that_cannot_be_passed_are_refused() -> None:
    model = hf_cases.build("llama", tied=True)
    batch, labels = packed()
    stages = zeropipe.split(model, 2)
    pipe = zeropipe.Pipeline(stages, "1f1b", loss_fn=zeropipe.causal_lm_loss, microbatches=2)
    with pytest.raises(PipelineError, match=r"token_type_ids unknown"):
        pipe.step({**batch, "token_type_ids": batch["input_ids"]}, labels)
    with pytest.raises(PipelineError, match=r"position_ids must be integers"):
        pipe.step({**batch, "position_ids": batch["position_ids"].double()}, labels)
    with pytest.raises(PipelineError, match=r"empty dict"):
        pipe.step({}, labels)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    two_ranks = zeropipe.build_schedule("1f1b", ranks=2, microbatches=2)
    plain = zeropipe.Pipeline(layers, two_ranks, loss_fn=nn.MSELoss())
    with pytest.raises(PipelineError, match=r"slice of an nn.Sequential.*positional"):
        plain.step({"x": torch.randn(4, 4)}, torch.randn(4, 4))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_mixture_of_experts_masks_documents_apart_with_its_router_loss(arch: str) -> None:
    from tests.adapters import hf_moe_cases

    model = hf_moe_cases.build(arch)
    batch, labels = packed(2)
    m = 3
    # The reference: the unsplit model microbatch by microbatch on the same packed rows.
    total = zeropipe.causal_lm_loss.count(labels)
    loss_ref: Tensor | float = 0.0
    parts = [t.chunk(m) for t in (batch["input_ids"], batch["position_ids"], labels)]
    for ids, pos, lab in zip(*parts, strict=True):
        out = model(ids, position_ids=pos, use_cache=False)
        ce_sum, _ = zeropipe.causal_lm_loss.sum_and_count(out.logits, lab)
        loss_ref = loss_ref + ce_sum / total
        if getattr(out, "aux_loss", None) is not None:
            loss_ref = loss_ref + model.config.router_aux_loss_coef * out.aux_loss.double() / m
    assert isinstance(loss_ref, Tensor)
    loss_ref.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    schedule = zeropipe.build_schedule("zbv", ranks=2, microbatches=m)
    pipe = zeropipe.Pipeline(hf_moe_cases.cut(model, 4), schedule, loss_fn=zeropipe.causal_lm_loss)
    loss = pipe.step(batch, labels)
    assert abs(loss.item() - loss_ref.item()) <= hf_cases.TOL
    for n, p in model.named_parameters():
        scale = 1.0 if p.dtype == torch.float64 else 1e-5  # DeepSeek's float32 router weights
        assert (p.grad is None) == (n not in ref), n
        if p.grad is not None:
            assert (p.grad - ref[n]).abs().max().item() * scale <= hf_cases.TOL, n


def test_a_dict_batch_is_described_by_its_names_in_step_messages() -> None:
    # What an out-of-step error says of a dict batch (ranks must agree on it, names included).
    from zeropipe.runtime.step.stage import split_step, step_signature
    from zeropipe.runtime.transport.wire import describe_batch

    batch, labels = packed()
    micro, _, _ = split_step(tuple(batch.values()), labels, 3, None)
    text = describe_batch(step_signature(micro, labels, tuple(batch)))
    assert text == (
        "inputs (input_ids, position_ids) int64[2, 12], int64[2, 12] per microbatch, "
        "target int64[6, 12]"
    ), text
    assert describe_batch(step_signature(micro, labels)).startswith("inputs int64[2, 12]")
