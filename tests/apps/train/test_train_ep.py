"""``zeropipe train --ep N``: a mixture's experts sharded over the data-parallel replicas.

One 4-process run (``--ranks 2 --ep 2``: pp 2 x dp 2, the experts over dp) is exported
and its eval loss compared with the exported folder loaded by ``from_pretrained`` and run
microbatch by microbatch as the two replicas cut the batch; the flags that cannot work
are refused in one line before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import zeropipe  # noqa: E402
from zeropipe.apps.cli import main  # noqa: E402
from zeropipe.apps.train.config import TrainConfig  # noqa: E402
from zeropipe.apps.train.loop import layout, train  # noqa: E402
from zeropipe.apps.train.workload import batch, load_corpus  # noqa: E402
from zeropipe.core.errors import ZeropipeError  # noqa: E402


def _eval_loss(model: Any, cfg: TrainConfig, parts: int) -> float:
    """The eval loss of ``cfg``'s run from the HF model, the batch cut into ``parts``
    microbatches (every replica's): CE sums over the batch's counted tokens, plus the
    router loss over the microbatches."""
    corpus, loss_fn, total = load_corpus(cfg), zeropipe.causal_lm_loss, 0.0
    with torch.no_grad():
        for k in range(cfg.eval_batches):
            x, _ = batch(corpus, cfg, k, "val")
            for part in x.chunk(parts):
                out = model(part)
                total += float(loss_fn.sum_and_count(out.logits, part)[0] / loss_fn.count(x))
                total += model.router_aux_loss_coef * float(out.aux_loss) / parts
    return total / cfg.eval_batches


def test_ep2_trains_inside_two_replicas_and_exports_the_whole_experts(
    tmp_path: Path, capsys: Any
) -> None:
    cfg = TrainConfig(
        model="qwen3-moe", ranks=2, ep=2, steps=3, batch_size=8, microbatches=2, seq=16,
        width=32, blocks=2, schedule="1f1b", out=str(tmp_path / "run"), quiet=True, lr=1e-2,
        warmup=1,
    )  # fmt: skip
    summary = train(cfg)
    assert cfg.dp == 2 and layout(cfg).startswith("pp 2 x dp 2 (experts over dp: ep 2)")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    # the replicas' expert shards, trained apart, make one model whose loss is the run's
    got = _eval_loss(exported, cfg, cfg.dp * cfg.microbatches)
    assert got == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"ep": 0}, "--ep must be >= 1 (1: no expert parallelism), got 0"),
        ({"ep": 2, "dp": 3}, "--ep 2 with --dp 3: the experts are sharded over blocks of"),
        ({"ep": 2}, "--ep 2 with --model gpt: expert parallelism shards a mixture of experts"),
        (
            {"ep": 3, "model": "qwen3-moe", "batch_size": 24},
            "--ep 3 must divide the qwen3-moe model's",
        ),
    ],
)
def test_ep_flags_that_cannot_work_are_refused_before_launching(
    settings: dict[str, Any], needle: str, tmp_path: Path
) -> None:
    cfg = TrainConfig(ranks=2, out=str(tmp_path), **settings)
    with pytest.raises(ZeropipeError) as err:
        cfg.check()
    assert needle in str(err.value), str(err.value)
