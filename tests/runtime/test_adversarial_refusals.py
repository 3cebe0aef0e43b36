"""What an adversarial tester found run wrongly, now refused in one line.

A gradient hook on a parameter used by several stages (a tied embedding) would run on
each stage's part of its gradient; an HF subclass whose ``loss_function`` computes its own
``.loss`` would be trained with the pipeline's loss_fn; and a ``functools.partial`` of
``F.cross_entropy`` with ``reduction="none"`` must be refused as its module is.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeropipe
from zeropipe import build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.pipeline import Pipeline


class _Tied(nn.Module):
    """Stage 0 and stage 3 share ``weight`` (as a tied embedding and head do)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def _tied_pipeline() -> tuple[Pipeline, list[nn.Module], nn.Parameter]:
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    middle = [nn.Linear(4, 4).double() for _ in range(2)]
    stages: list[nn.Module] = [_Tied(shared), *middle, _Tied(shared)]
    schedule = build_schedule("interleaved-1f1b", ranks=2, microbatches=2, chunks=2)
    return Pipeline(stages, schedule, loss_fn=F.mse_loss), stages, shared


def test_a_gradient_hook_on_a_parameter_of_several_stages_is_refused_at_step() -> None:
    pipe, _, shared = _tied_pipeline()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, x)  # no hook: it trains (the tied gradients are checked elsewhere)
    grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    calls: list[int] = []
    handle = shared.register_hook(lambda g: calls.append(1) or g.clamp(-0.01, 0.01))
    with pytest.raises(PipelineError) as caught:
        pipe.step(x, x)
    text = str(caught.value)
    assert "'weight', used by stages 0 and 3" in text and "not on their sum" in text, text
    assert "untie" in text and "\n" not in text
    assert not calls  # refused before any backward
    # .grad is as the refused step found it.
    assert all(
        torch.equal(a, b) for a, b in zip(grads, [p.grad for p in pipe.parameters()], strict=True)
    )
    handle.remove()
    pipe.step(x, x)  # the hook removed, it trains again
    shared.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(PipelineError, match="used by stages 0 and 3"):
        pipe.step(x, x)


def test_a_hook_on_a_parameter_of_one_stage_is_not_refused() -> None:
    pipe, stages, _ = _tied_pipeline()
    calls: list[int] = []
    stages[1].weight.register_hook(lambda g: calls.append(1) or g)
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, x)
    assert calls


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.parametrize(
    ("loss_fn", "name"),
    [
        (functools.partial(F.cross_entropy, reduction="none"), "CrossEntropyLoss"),
        (functools.partial(F.nll_loss, reduction="none"), "NLLLoss"),
        (functools.partial(F.cross_entropy, reduce=False), "CrossEntropyLoss"),
        (functools.partial(F.nll_loss, reduce=False, size_average=True), "NLLLoss"),
    ],
    ids=["cross_entropy", "nll_loss", "reduce=False", "reduce+size_average"],
)
def test_a_functional_partial_with_no_reduction_is_refused_as_its_module(
    loss_fn: Any, name: str
) -> None:
    stages = [nn.Linear(4, 4), nn.Linear(4, 3)]
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(PipelineError) as caught:
        pipe = Pipeline(stages, schedule, loss_fn=loss_fn)
        # microbatches of one row: the per-row loss has one element and must not pass
        pipe.step(torch.randn(2, 4), torch.tensor([0, 2]))
    text = str(caught.value)
    assert f"{name}(reduction='none') returns one loss per item" in text, text
    assert "\n" not in text


def _hf_llama() -> Any:
    pytest.importorskip("transformers", reason="the HF adapter needs transformers")
    from tests.adapters import hf_cases

    return hf_cases.build("llama", tied=False, layers=2)


def test_an_hf_subclass_overriding_loss_function_is_refused_by_split() -> None:
    from transformers import LlamaForCausalLM

    class SubLoss(LlamaForCausalLM):
        def loss_function(self, *a: Any, **k: Any) -> Any:  # type: ignore[override]
            return super().loss_function(*a, **k) * 2

    model = _hf_llama()
    model.__class__ = SubLoss
    with pytest.raises(PipelineError) as caught:
        zeropipe.split(model, 2, balance=[1, 1])
    text = str(caught.value)
    assert "SubLoss: it overrides loss_function of transformers' LlamaForCausalLM" in text
    assert "silently ignored" in text and "a loss_fn that computes it" in text
    assert "\n" not in text


@pytest.mark.parametrize("how", ["setter", "loss_type"])
def test_an_hf_model_whose_loss_is_set_another_way_is_refused_by_split(how: str) -> None:
    model = _hf_llama()
    if how == "setter":
        model.loss_function = lambda *a, **k: torch.zeros(())
    else:
        model.loss_type = "ForMaskedLM"
    with pytest.raises(PipelineError, match=r"cannot cut LlamaForCausalLM: it sets .*loss_fn"):
        zeropipe.split(model, 2, balance=[1, 1])
    plain = _hf_llama()
    plain.loss_type = "ForCausalLM"
    assert len(zeropipe.split(plain, 2, balance=[1, 1])) == 2  # the default loss: split
