"""What ``zeropipe.split`` refuses on Hugging Face models instead of running them wrongly.

A subclass whose own ``forward`` the stages would bypass, and inputs the first stage
cannot take (an attention mask beside the ids), each fail in one line naming the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaModel

import zeropipe
from tests.adapters import hf_cases
from zeropipe.core.errors import PipelineError


class Doubled(LlamaForCausalLM):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class Called(GPT2LMHeadModel):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


class Helper(LlamaForCausalLM):
    """Adds a helper and an attribute only: its logits are the base class's."""

    note = "mine"

    def describe(self) -> str:
        return f"{self.note}: {self.config.num_hidden_layers} layers"


class ScaledInner(LlamaModel):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state * 3
        return out


def _as(cls: type, arch: str = "llama") -> Any:
    """A tiny model of ``arch`` whose class is ``cls`` (same weights, same config)."""
    model = hf_cases.build(arch, tied=False)
    model.__class__ = cls
    return model


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: _as(Doubled), "Doubled overrides forward of transformers' LlamaForCausalLM"),
        (lambda: _as(Called, "gpt2"), "Called overrides __call__ of transformers' GPT2LMHeadModel"),
    ],
    ids=["forward", "__call__"],
)
def test_a_subclass_that_overrides_forward_is_refused(make: Any, what: str) -> None:
    model = make()
    with pytest.raises(PipelineError, match=rf"cannot cut .*{what}.*examples/manual_stages\.py"):
        zeropipe.split(model, 2, balance=[2, 2])


def test_a_forward_replaced_on_the_instance_or_the_inner_model_is_refused() -> None:
    patched = hf_cases.build("llama", tied=False)
    plain = patched.forward
    patched.forward = lambda *a, **k: plain(*a, **k)  # as accelerate's hooks do
    with pytest.raises(PipelineError, match="LlamaForCausalLM overrides forward"):
        zeropipe.split(patched, 2, balance=[2, 2])
    inner = hf_cases.build("llama", tied=False)
    inner.model.__class__ = ScaledInner
    with pytest.raises(PipelineError, match=r"LlamaForCausalLM\.model overrides forward of .*"):
        zeropipe.split(inner, 2, balance=[2, 2])
    swapped = hf_cases.build("gpt2", tied=False)
    swapped.transformer = torch.nn.Identity()
    with pytest.raises(PipelineError, match=r"its \.transformer is a Identity, not .* GPT2Model"):
        zeropipe.split(swapped, 2, balance=[2, 2])


def test_a_subclass_that_only_adds_helpers_is_split_and_gives_its_own_logits() -> None:
    model = _as(Helper)
    assert model.describe() == "mine: 4 layers"
    stages = zeropipe.split(model, 2, balance=[2, 2])
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = stages[1](stages[0](ids))
        assert torch.equal(logits, model(ids).logits)


def test_embeddings_in_place_of_ids_are_refused_before_any_work() -> None:
    model = hf_cases.build("llama", tied=False)
    pipe = zeropipe.Pipeline(
        zeropipe.split(model, 2, balance=[2, 2]),
        zeropipe.build_schedule("1f1b", ranks=2, microbatches=2),
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local",
    )
    _, labels = hf_cases.batch(0, 8)
    with pytest.raises(PipelineError, match=r"takes input_ids only.*float64") as err:
        pipe.step(torch.zeros(6, 8, 16, dtype=torch.float64), labels)
    assert "\n" not in str(err.value)
    assert all(p.grad is None for p in model.parameters())
