"""``python benchmarks/packing.py --quick``: the three ways of feeding documents of skewed
lengths run side by side on one pipeline, count the same real tokens and give the same loss,
and padding to the longest document pads most."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the benchmark's Llama needs transformers")

from tests.planning.benchmark_modules import load


def test_the_quick_benchmark_runs_the_three_ways_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = load("packing").main(["--quick"])
    printed = capsys.readouterr().out
    assert set(rows) == {"padded", "packed", "budget"}
    for mode in rows:
        assert f"\n{mode} " in printed
    padded, packed, budget = rows["padded"], rows["packed"], rows["budget"]
    assert padded.real == packed.real == budget.real > 0
    assert padded.padding > packed.padding and padded.padding > budget.padding
    assert packed.rows < padded.rows == budget.rows  # packing shares rows; the others do not
    assert len(set(budget.shapes.split())) > 1  # microbatches of their own shapes
    # the same documents and labels: the same loss (float32), packed rows masked apart
    assert abs(packed.loss - padded.loss) <= 1e-4 and abs(budget.loss - padded.loss) <= 1e-4
    assert all(r.tokens_per_second > 0 for r in rows.values())
