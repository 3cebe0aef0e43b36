"""``zeropipe.split`` on Hugging Face causal LMs: the model's own loss and gradients, exactly.

Models come from small configs (no download); skipped where transformers is not installed.
The distributed check is one 2-process launch that runs every case inside the ranks
(tests/adapters/hf_two_processes.py, shared with test_hf_mask.py's padded cases).
"""

from __future__ import annotations

import pytest
import torch

from zeropipe import build_schedule

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import hf_cases, hf_two_processes
from zeropipe.core.errors import PipelineError


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", hf_cases.ARCHS)
def test_every_schedule_gives_the_models_own_loss_and_gradients(arch: str, tied: bool) -> None:
    for schedule in hf_cases.SCHEDULES:
        worst = hf_cases.errors(arch, tied, schedule)
        assert worst["loss"] <= hf_cases.TOL, (schedule, worst)
        assert worst["grad"] <= hf_cases.TOL, (schedule, worst)


@pytest.mark.parametrize("arch", hf_cases.ARCHS)
def test_stages_hold_the_models_own_parameters(arch: str) -> None:
    model = hf_cases.build(arch, tied=True)
    names = list(model.state_dict())
    stages = zeropipe.split(model, 3, balance=[1, 2, 1])
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    # the tied weight is one object on the first and the last stage
    shared = {id(p) for p in stages[0].parameters()} & {id(p) for p in stages[-1].parameters()}
    assert shared == {id(model.get_input_embeddings().weight)}
    assert list(model.state_dict()) == names


def test_hf_loss_is_causal_lm_loss() -> None:
    model = hf_cases.build("llama", tied=False)
    ids, labels = hf_cases.batch(0, 8)
    out = model(ids, labels=labels)
    # HF computes its loss in float32 (it upcasts the logits with .float()); ours keeps float64.
    assert abs(out.loss.item() - zeropipe.causal_lm_loss(out.logits, labels).item()) < 1e-6
    model32 = model.float()
    out = model32(ids, labels=labels)
    assert torch.equal(out.loss, zeropipe.causal_lm_loss(out.logits, labels))


def test_sdpa_attention_and_a_measured_cut() -> None:
    model = hf_cases.build("qwen3", tied=True, attn="sdpa")
    ids, labels = hf_cases.batch(0, 8)
    ref_loss, ref_grads = hf_cases.reference(model, ids, labels)
    stages = zeropipe.split(model, 4)  # cut by measured time
    pipe = zeropipe.Pipeline(
        stages, build_schedule("zbv", ranks=2, microbatches=3), loss_fn=zeropipe.causal_lm_loss
    )
    assert abs(pipe.step(ids, labels).item() - ref_loss) <= hf_cases.TOL
    for name, p in model.named_parameters():
        assert p.grad is not None
        assert (p.grad - ref_grads[name]).abs().max().item() <= hf_cases.TOL, name


def test_bad_balance_and_unsupported_hf_models_are_refused() -> None:
    model = hf_cases.build("gpt2", tied=False)
    with pytest.raises(PipelineError, match="decoder-layer counts summing to the model's 4"):
        zeropipe.split(model, 2, balance=[1, 2])
    with pytest.raises(PipelineError, match="0 allowed only on the first or last"):
        zeropipe.split(model, 3, balance=[2, 0, 2])
    from transformers import BertConfig, BertModel

    bert = BertModel(
        BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    with pytest.raises(PipelineError, match=r"the Hugging Face model BertModel.*by hand"):
        zeropipe.split(bert, 2)


def test_two_processes_every_architecture_and_schedule() -> None:
    results = [r["unpadded"] for r in hf_two_processes.results()]
    per_model_params = {
        (arch, tied): len(list(hf_cases.build(arch, tied).parameters()))
        for arch in hf_cases.ARCHS
        for tied in (False, True)
    }
    for key in results[0]:
        arch, tied_s, _schedule = key.split()
        both = [r[key] for r in results]
        assert max(w["loss"] for w in both) <= hf_cases.TOL, (key, both)
        assert max(w["grad"] for w in both) <= hf_cases.TOL, (key, both)
        # every parameter was compared on some rank, at each of the two steps
        n = per_model_params[(arch, tied_s == "tied=True")]
        assert sum(w["checked"] for w in both) >= 2 * n, (key, both)
    assert len(results[0]) == len(hf_cases.ARCHS) * 2 * len(hf_cases.SCHEDULES)


def test_the_models_own_gradient_checkpointing_runs_exactly_in_a_pipeline() -> None:
    # What `zeropipe train --checkpoint-blocks` turns on for a Hugging Face model: each
    # decoder layer keeps its input and runs again in its backward, under every kind of
    # backward (full B, and I then W), with the model's own loss and gradients.
    from zeropipe.apps.models.hf_presets import hf_checkpointing

    model = hf_cases.build("llama", False)
    refs = [hf_cases.reference(model, *hf_cases.batch(step, seq)) for step, seq in hf_cases.STEPS]
    hf_checkpointing(model)
    model.train()
    runs = [0]
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    for schedule, balance in (("1f1b", [2, 2]), ("zbv", [1, 1, 1, 1])):
        stages = zeropipe.split(model, len(balance), balance=balance)
        built = build_schedule(schedule, ranks=2, microbatches=3)
        pipe = zeropipe.Pipeline(stages, built, loss_fn=zeropipe.causal_lm_loss)
        for (step, seq), (ref_loss, ref_grads) in zip(hf_cases.STEPS, refs, strict=True):
            model.zero_grad(set_to_none=True)
            runs[0] = 0
            loss = pipe.step(*hf_cases.batch(step, seq))
            assert abs(loss.item() - ref_loss) <= hf_cases.TOL
            for name, p in model.named_parameters():
                assert p.grad is not None, name
                assert (p.grad - ref_grads[name]).abs().max().item() <= hf_cases.TOL, name
            assert runs[0] == 2 * 4 * 3  # 4 layers' MLPs, 3 microbatches, run twice
    with pytest.raises(zeropipe.ZeropipeError, match="does not support gradient checkpointing"):
        hf_checkpointing(torch.nn.Linear(2, 2))
