"""``zeropipe.split`` on Hugging Face mixtures of experts: the model's own loss and gradients,
the router's load-balancing loss included, exactly.

The reference is the unsplit model run microbatch by microbatch (as a pipeline cuts the
batch), each microbatch's loss combined as ``ce_sum_j / counted tokens + coef * aux_j / m``
with ``aux_j`` the model's own ``aux_loss`` on microbatch j.  Models come from tiny configs
(no download) in float64; skipped where transformers is not installed.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import hf_cases, hf_mask_cases, hf_moe_cases
from tests.adapters.hf_moe_cases import COEF, MOE, M, build, cut, reference, worst
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint, offload
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.step.loss_contract import LossContract


@pytest.mark.parametrize("arch", list(MOE))
def test_every_generator_recompute_and_offload_give_the_reference(arch: str) -> None:
    model = build(arch)
    ids, labels = hf_cases.batch(0, 8)
    ref = reference(model, ids, labels)
    names = list(GENERATORS) if arch == "qwen3_moe" else ["auto", "1f1b", "zbv", "dualpipev"]
    # dualpipe takes an even microbatch count: 2 here, each half of the batch one direction.
    cases = [
        (n, zeropipe.build_schedule(n, ranks=2, microbatches=2 if n == "dualpipe" else M))
        for n in names
    ]
    base = zeropipe.build_schedule("1f1b", ranks=2, microbatches=M).compute_only()
    cases += [("1f1b+recompute", checkpoint(base)), ("1f1b+offload", offload(base))]
    for name, schedule in cases:
        stages = cut(model, schedule.num_stages - len(schedule.copies))  # copies: the same
        pipe = zeropipe.Pipeline(stages, schedule, loss_fn=zeropipe.causal_lm_loss, mesh="local")
        m = schedule.microbatches  # the router term is each microbatch's
        loss, grad = worst(
            model, pipe, ids, labels, ref if m == M else reference(model, ids, labels, m=m)
        )
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


def test_the_router_term_is_averaged_over_the_global_batchs_microbatches() -> None:
    model = build("qwen3_moe")
    stages = cut(model, 2)
    ids, labels = hf_cases.batch(0, 8)
    out = stages[1](*stages[0](ids[:2]))
    ce_sum, count = zeropipe.causal_lm_loss.sum_and_count(out[0], labels[:2])
    chunks = list(labels.chunk(M))
    mine = zeropipe.causal_lm_loss.count(labels)
    # two replicas, each with M microbatches of as many counted tokens: the total sums both
    step = LossContract(zeropipe.causal_lm_loss).for_step(chunks, [2] * M, total=lambda x: 2 * x)
    got = step.compute(out, labels[:2], 0) * step.weights[0]
    assert torch.allclose(got, ce_sum / (2 * mine) + out[1] / (2 * M), rtol=1e-14, atol=0)
    alone = LossContract(zeropipe.causal_lm_loss).for_step(chunks, [2] * M)
    got = alone.compute(out, labels[:2], 0) * alone.weights[0]
    assert torch.allclose(got, ce_sum / mine + out[1] / M, rtol=1e-14, atol=0)
    assert count == zeropipe.causal_lm_loss.count(labels[:2])


def test_what_cannot_be_cut_is_refused() -> None:
    model = build("qwen3_moe")
    stages = cut(model, 2)
    ids, _ = hf_cases.batch(0, 8)
    # the second stage without the first's router sums
    with pytest.raises(PipelineError, match=r"router sums \[2, 4\]"):
        stages[1](stages[0](ids)[0])
    # the stages of a mixture of experts are zeropipe.split's to build
    from zeropipe.adapters.hf import split_hf

    with pytest.raises(PipelineError, match=r"mixture of experts: cut it with zeropipe\.split"):
        split_hf(model, 2, [2, 2])


@functools.cache
def _two_processes() -> list[dict[str, Any]]:
    return zeropipe.launch(hf_moe_cases.distributed_cases, 2, timeout=600.0)


def test_two_processes_pipeline_and_data_parallel_replicas_give_the_reference() -> None:
    results = _two_processes()
    for key in ("pp2 1f1b", "pp2 zbv", "dp2"):
        both = [r[key] for r in results]
        assert max(w["grad"] for w in both) <= hf_cases.TOL, (key, both)
        assert min(w["checked"] for w in both) > 0, (key, both)
    # every parameter compared on one rank or the other; each replica all of them
    total = len(list(build("qwen3_moe").parameters()))
    assert sum(r["pp2 1f1b"]["checked"] for r in results) >= total
    assert all(r["dp2"]["checked"] == total for r in results)
    # the loss every process returns is the global batch's, the router term averaged over
    # the microbatches of both replicas (the reference of dp2 runs 2 x M microbatches)
    for key in ("pp2 1f1b", "pp2 zbv", "dp2"):
        assert max(r[key]["loss"] for r in results) <= hf_cases.TOL, key
