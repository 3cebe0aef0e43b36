"""``zeropipe train --tp N`` on a mixture of experts: attention tensor-parallel, the sparse
blocks replicated over "tp".

``--model qwen3-moe --ranks 2 --tp 2`` (4 processes) trains two steps with the losses of
the same run at ``--tp 1`` (2 processes) within float32 noise, the router's loss included
(the preset asks for it); and ``--ranks 1 --ep 2 --tp 2`` (each of 2 replicas
tensor-parallel, the experts sharded over the replicas) those of ``--ranks 1 --dp 2``.
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

SMALL = ["--batch-size", "4", "--microbatches", "2", "--schedule", "1f1b", "--eval-batches", "1"]
MODEL = ["--model", "qwen3-moe", "--width", "32", "--blocks", "2", "--seq", "16"]  # 4 heads, 2 kv


def _run(out: Path, layout_flags: list[str], capsys: Any) -> list[dict[str, Any]]:
    args = ["train", *MODEL, *layout_flags, "--steps", "2", *SMALL]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_losses(one: list[dict[str, Any]], two: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in two] == [0, 1, 2]
    compared = 0
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)
                compared += 1
    assert compared >= 4, one


def test_tp2_trains_a_mixture_with_the_losses_of_tp1(tmp_path: Path, capsys: Any) -> None:
    one = _run(tmp_path / "tp1", ["--ranks", "2"], capsys)
    two = _run(tmp_path / "tp2", ["--ranks", "2", "--tp", "2"], capsys)
    _same_losses(one, two)
    assert layout(TrainConfig(model="qwen3-moe", ranks=2, tp=2)) == (
        "pp 2 x dp 1 x tp 2 = 4 processes"
    )


def test_tp2_with_the_experts_over_two_replicas_has_the_losses_of_dp2(
    tmp_path: Path, capsys: Any
) -> None:
    """--ep 2 --tp 2: each replica tensor-parallel, its experts sharded over the replicas."""
    one = _run(tmp_path / "dp2", ["--ranks", "1", "--dp", "2"], capsys)
    two = _run(tmp_path / "ep2tp2", ["--ranks", "1", "--ep", "2", "--tp", "2"], capsys)
    _same_losses(one, two)
