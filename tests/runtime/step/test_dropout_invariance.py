"""Dropout draws the same masks whatever the cut and the schedule, for every kind of stage.

Each layer is seeded by ``(seed, step, microbatch, its index in the whole model)``:
an ``nn.Sequential`` cut by the pipeline, the slices ``zeropipe.split`` returns, the
stages of a split Hugging Face model (embedding 0, decoder layer ``i`` ``i + 1``, head
last) and hand-made stages that name their layers with ``seed_layers``.  So 1f1b on two
stages and zbv on four agree, in float64, with the unsplit model run under that rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import zeropipe
from tests import gradcheck
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.step.stage import seeded

STEPS = 3
# (schedule, stages): two stages on two ranks, and four (two ranks x two chunks)
LAYOUTS = (("1f1b", 2), ("zbv", 4))
TOL = 1e-10


def _llama() -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attention_dropout=0.3,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="eager")
    return model.train()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (6, 8), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100  # microbatches count different numbers of tokens
    return ids, labels


def _hf_reference(model: Any, seed: int) -> list[tuple[float, dict[str, Tensor]]]:
    """The unsplit model under the pipeline's rule: microbatch by microbatch, each unit
    (embedding, decoder layer, final norm) seeded by its index right before it runs."""
    inner, layers = model.model, len(model.model.layers)
    units = [(inner.embed_tokens, 0), *[(m, i + 1) for i, m in enumerate(inner.layers)]]
    units.append((inner.norm, layers + 1))
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        ids, labels = _batch(step)
        logits = []
        for mb, part in enumerate(torch.tensor_split(ids, 3)):
            handles = [
                m.register_forward_pre_hook(
                    lambda _m, _a, k=k, mb=mb, step=step: seeded(
                        seed, step, mb, 1_000_003 + k, torch.device("cpu")
                    )
                )
                for m, k in units
            ]
            try:
                logits.append(model(part).logits)
            finally:
                for h in handles:
                    h.remove()
        model.zero_grad(set_to_none=True)
        loss = zeropipe.causal_lm_loss(torch.cat(logits), labels)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _hf_pipelined(schedule: str, stages: int, seed: int) -> list[tuple[float, dict[str, Tensor]]]:
    model = _llama()
    pipe = zeropipe.Pipeline(
        zeropipe.split(model, stages, balance=[4 // stages] * stages),
        zeropipe.build_schedule(schedule, ranks=2, microbatches=3),
        loss_fn=zeropipe.causal_lm_loss,
        mesh="local",
        options=zeropipe.RuntimeOptions(seed=seed),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(*_batch(step))
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _assert_same(
    got: list[tuple[float, dict[str, Tensor]]], want: list[tuple[float, dict[str, Tensor]]]
) -> None:
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want, strict=True)):
        assert abs(loss - ref_loss) <= TOL, (step, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= TOL, f"step {step} {name}: {diff:.3g}"


def test_a_split_hf_model_draws_the_same_dropout_whatever_the_cut_and_schedule() -> None:
    pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
    ref = _hf_reference(_llama(), seed=5)
    # dropout is on: a different seed changes the loss
    assert abs(_hf_reference(_llama(), seed=6)[0][0] - ref[0][0]) > 1e-6
    for schedule, stages in LAYOUTS:
        _assert_same(_hf_pipelined(schedule, stages, seed=5), ref)


def _sequential_steps(stages: Any, schedule: str, model: nn.Sequential) -> list[Any]:
    pipe = zeropipe.Pipeline(
        stages,
        zeropipe.build_schedule(schedule, ranks=2, microbatches=3),
        loss_fn=gradcheck.token_loss,
        mesh="local",
    )
    out = []
    for step in range(STEPS):
        x, y = gradcheck.batch_for(model, batch=6, seed=step)
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _sequential_reference(model: nn.Sequential) -> list[Any]:
    out = []
    for step in range(STEPS):
        x, y = gradcheck.batch_for(model, batch=6, seed=step)
        loss, grads = gradcheck.reference(model, x, y, gradcheck.token_loss, 3, step=step)
        out.append((loss.item(), grads))
    return out


@pytest.mark.parametrize(("schedule", "stages"), LAYOUTS)
def test_the_slices_split_returns_are_seeded_by_their_layers(schedule: str, stages: int) -> None:
    model = gradcheck.token_model(layers=8, dropout=0.3)
    ref = _sequential_reference(model)
    _assert_same(_sequential_steps(zeropipe.split(model, stages), schedule, model), ref)


class _Block(nn.Module):
    """A hand-made stage: a run of the model's layers behind its own forward."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.body = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.body:
            x = layer(x)
        return x


@pytest.mark.parametrize(("schedule", "stages"), LAYOUTS)
def test_hand_made_stages_that_name_their_layers_are_seeded_by_them(
    schedule: str, stages: int
) -> None:
    from zeropipe.runtime.step.stage import seed_layers

    model = gradcheck.token_model(layers=8, dropout=0.3)
    ref = _sequential_reference(model)
    layers, per = list(model), 8 // stages
    hand = [
        seed_layers(
            _Block(layers[s * per : (s + 1) * per]),
            {f"body.{k}": s * per + k for k in range(per)},
        )
        for s in range(stages)
    ]
    _assert_same(_sequential_steps(hand, schedule, model), ref)


def test_layer_keys_that_name_no_submodule_or_repeat_an_index_are_refused() -> None:
    from zeropipe.runtime.step.stage import seed_layers

    block = _Block([nn.Linear(2, 2), nn.Dropout(0.1)])
    with pytest.raises(PipelineError, match=r"names 'body\.7', which is not a submodule of"):
        seed_layers(block, {"body.7": 0})
    with pytest.raises(PipelineError, match="index 0; layer indices are distinct ints >= 0"):
        seed_layers(block, {"body.0": 0, "body.1": 0})
    with pytest.raises(PipelineError, match="index -1"):
        seed_layers(block, {"body.0": -1})
