"""``zeropipe.split`` with an attention_mask: padded batches give the model's own loss and grads.

Models come from small configs (no download); skipped where transformers is not installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import hf_cases, hf_mask_cases, hf_two_processes
from zeropipe.core.errors import PipelineError


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_padded_batches_give_the_models_own_loss_and_gradients(
    arch: str, side: str, schedule: str
) -> None:
    worst = hf_mask_cases.errors(arch, side, schedule)
    assert worst["loss"] <= hf_cases.TOL, worst
    assert worst["grad"] <= hf_cases.TOL, worst
    assert worst["checked"] == 2 * len(list(hf_cases.build(arch, tied=False).parameters()))
    # the padding matters: a pipeline ignoring the mask could not match
    assert worst["unmasked"] > 1e-6, worst


def test_stages_pass_the_mask_along_and_the_last_returns_logits() -> None:
    model = hf_cases.build("qwen3", tied=False)
    ids, mask, _ = hf_mask_cases.padded_batch("right")
    stages = zeropipe.split(model, 3, balance=[1, 2, 1])
    with torch.no_grad():
        out0 = stages[0](ids, mask)
        out1 = stages[1](*out0)
        logits = stages[2](*out1)
        plain = stages[0](ids)
    # the mask crosses stages as bool, as transformers reads it (an integer tensor that
    # crosses is the position ids of packed documents)
    assert isinstance(out0, tuple) and len(out0) == 2 and torch.equal(out0[1], mask != 0)
    assert isinstance(out1, tuple) and out1[1] is out0[1]
    assert isinstance(plain, torch.Tensor) and plain.shape == (6, 8, 16)  # no mask: as before
    assert isinstance(logits, torch.Tensor)
    assert torch.equal(logits, model(ids, attention_mask=mask).logits)
    # a float mask is read as transformers reads it, and crosses stages as bool
    with torch.no_grad():
        as_float = stages[0](ids, mask.double())
    assert as_float[1].dtype == torch.bool and torch.equal(as_float[0], out0[0])


def test_a_mask_of_the_wrong_shape_is_refused() -> None:
    model = hf_cases.build("gpt2", tied=False)
    stages = zeropipe.split(model, 2, balance=[2, 2])
    ids, mask, _ = hf_mask_cases.padded_batch("right")
    with pytest.raises(PipelineError, match=r"attention_mask \[batch, seq\].*int64 \[6, 7\]"):
        stages[0](ids, mask[:, 1:])
    with pytest.raises(PipelineError, match=r"got 3 tensor\(s\)"):
        stages[0](ids, mask, mask)
    hidden = stages[0](ids)
    with pytest.raises(PipelineError, match=r"a stage .* takes hidden only"):
        stages[1](hidden, mask[:3])


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_a_split_model_raises_no_deprecation_warning(arch: str, padded: bool) -> None:
    model = hf_cases.build(arch, tied=False, attn="sdpa")
    ids, mask, labels = hf_mask_cases.padded_batch("left")
    pipe = zeropipe.Pipeline(
        zeropipe.split(model, 2, balance=[2, 2]),
        zeropipe.build_schedule("1f1b", ranks=2, microbatches=2),
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        loss = pipe.step((ids, mask) if padded else ids, labels)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_two_processes_padded() -> None:
    results = [r["padded"] for r in hf_two_processes.results()]
    assert set(results[0]) == {"llama left", "gpt2 right"}
    for key in results[0]:
        arch = key.split()[0]
        both = [r[key] for r in results]
        assert max(w["loss"] for w in both) <= hf_cases.TOL, (key, both)
        assert max(w["grad"] for w in both) <= hf_cases.TOL, (key, both)
        assert min(w["unmasked"] for w in both) > 1e-6, (key, both)
        n = len(list(hf_cases.build(arch, tied=False).parameters()))
        assert sum(w["checked"] for w in both) >= 2 * n, (key, both)
