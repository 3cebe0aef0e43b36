"""``zeropipe train --model qwen3-moe | mixtral | deepseek-v3``, ``--model-path`` and
``zeropipe export`` of Hugging Face mixtures of experts.

A run's eval loss is compared with the exported folder loaded by ``from_pretrained``
and run microbatch by microbatch as the pipeline cuts the batch: each microbatch's
cross-entropy sum over the batch's counted tokens, plus its router loss
(``router_aux_loss_coef * aux_loss``) over the microbatches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import zeropipe  # noqa: E402
from zeropipe.apps import hf_folder  # noqa: E402
from zeropipe.apps.cli import main  # noqa: E402
from zeropipe.apps.train.config import TrainConfig  # noqa: E402
from zeropipe.apps.train.loop import train  # noqa: E402

MOE = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 16, "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 4},
    "deepseek_v3": {
        "n_routed_experts": 4, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 8,
        "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    },
}  # fmt: skip


def _pipeline_eval_loss(model: Any, cfg: TrainConfig) -> float:
    """The eval loss of ``cfg``'s run, from the HF model run microbatch by microbatch."""
    from zeropipe.apps.train.workload import batch, load_corpus

    corpus, loss_fn, total = load_corpus(cfg), zeropipe.causal_lm_loss, 0.0
    with torch.no_grad():
        for k in range(cfg.eval_batches):
            x, _ = batch(corpus, cfg, k, "val")
            loss = 0.0
            for part in x.chunk(cfg.microbatches):
                out = model(part)
                loss += float(loss_fn.sum_and_count(out.logits, part)[0] / loss_fn.count(x))
                if getattr(out, "aux_loss", None) is not None:
                    loss += model.router_aux_loss_coef * float(out.aux_loss) / cfg.microbatches
            total += loss
    return total / cfg.eval_batches


@pytest.mark.parametrize("model", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_a_preset_trains_and_exports_with_the_pipeline_eval_loss(
    model: str, tmp_path: Path, capsys: Any
) -> None:
    # One process (the one 2-process launch of these tests is test_hf_moe's): what is
    # checked here is the presets, the export's layout and the run's eval loss.
    cfg = TrainConfig(
        model=model, ranks=1, steps=3, batch_size=8, microbatches=4, seq=16, width=32,
        blocks=2, schedule="1f1b", out=str(tmp_path / "run"), quiet=True, lr=1e-2, warmup=1,
    )  # fmt: skip
    summary = train(cfg)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    # the experts one tensor per expert and projection, as save_pretrained writes them
    keys = set(hf_folder.weight_map(tmp_path / "hf"))
    block = "block_sparse_moe" if model == "mixtral" else "mlp"
    gate = "w1" if model == "mixtral" else "gate_proj"
    assert f"model.layers.1.{block}.experts.3.{gate}.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(exported).__name__.lower().startswith(model.replace("-", "")[:7])
    # the router's loss is on in the Qwen3-MoE and Mixtral presets, absent from DeepSeek-V3
    assert exported.config.output_router_logits is True
    with torch.no_grad():
        aux = exported(torch.zeros(1, 4, dtype=torch.long)).aux_loss
    assert (aux is None) == (model == "deepseek-v3")
    got = _pipeline_eval_loss(exported, cfg)
    assert got == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.parametrize("kind", list(MOE))
def test_a_saved_folder_gives_transformers_logits_and_router_loss(
    kind: str, tmp_path: Path
) -> None:
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.3, **MOE[kind],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if kind == "deepseek_v3":  # a trained correction bias, which the folder must carry
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.5, -0.5, 0.2, 0.0]))
    model.save_pretrained(tmp_path / kind)
    stages, _, keys = hf_folder.build_from_folder(tmp_path / kind, 2, [2, 2], [0, 1])
    if kind == "deepseek_v3":
        assert "model.layers.3.mlp.gate.e_score_correction_bias" in keys
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = stages[1].eval()(*_tuple(stages[0].eval()(x)))
        want = model(x)
    logits = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    if kind == "deepseek_v3":
        assert isinstance(out, torch.Tensor)
    else:
        torch.testing.assert_close(out[1], 0.3 * want.aux_loss, rtol=1e-6, atol=0)


def _tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)
