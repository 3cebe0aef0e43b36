"""``zeropipe train --cp N``: every sequence sharded over N processes per pipeline rank.

``--model llama --ranks 2 --cp 2 --seq 256`` (4 processes) trains two steps with the losses
of the same run at ``--cp 1`` (2 processes) within float32 noise, each process holding the
activations of half the tokens; the flags that cannot work are refused in one line before
any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from zeropipe.apps.cli import main
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import layout
from zeropipe.core.errors import ZeropipeError

SMALL = ["--batch-size", "4", "--microbatches", "2", "--schedule", "1f1b", "--eval-batches", "1"]


def _run(out: Path, cp: int, capsys: Any) -> list[dict[str, Any]]:
    args = ["train", "--model", "llama", "--ranks", "2", "--cp", str(cp), "--seq", "256"]
    assert main([*args, "--steps", "2", *SMALL, "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cp2_trains_with_the_losses_of_cp1(tmp_path: Path, capsys: Any) -> None:
    one = _run(tmp_path / "cp1", 1, capsys)
    two = _run(tmp_path / "cp2", 2, capsys)
    assert [r["step"] for r in two] == [0, 1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)
    # each of the cp processes holds half the sequence's activations (the gathered keys and
    # values and the whole-row masks aside)
    assert two[1]["peak_saved_bytes"] < 0.8 * one[1]["peak_saved_bytes"]
    cfg = TrainConfig(model="llama", ranks=2, cp=2)
    assert layout(cfg) == "pp 2 x dp 1 x cp 2 x tp 1 = 4 processes"


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"cp": 0}, "--cp must be >= 1 (1: no context parallelism), got 0"),
        ({"cp": 2}, "--cp 2 with --model gpt: context parallelism shards the attention"),
        ({"cp": 2, "model": "llama", "seq": 30}, "use a --seq divisible by 4"),
        ({"cp": 2, "model": "qwen3-moe", "seq": 32}, "not Qwen3MoeForCausalLM"),
        ({"cp": 2, "model": "gpt2", "seq": 32}, "not GPT2LMHeadModel"),
        ({"cp": 2, "ep": 2, "model": "qwen3-moe", "seq": 32}, "mixtures of experts are not"),
    ],
)
def test_cp_flags_that_cannot_work_are_refused_before_launching(
    settings: dict[str, Any], needle: str, tmp_path: Path
) -> None:
    cfg = TrainConfig(ranks=2, out=str(tmp_path), **settings)
    with pytest.raises(ZeropipeError) as err:
        cfg.check()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
