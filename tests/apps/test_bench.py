"""``zeropipe bench``: real side-by-side runs on tiny models, the summary over runs, bad flags."""

from __future__ import annotations

import json
from typing import Any

import pytest

from zeropipe.apps import bench, cli

# One launch serves both tests: the MLP and the transformer, each under 1f1b and zbv.
TINY = bench.BenchConfig(
    schedules=("1f1b", "zbv"),
    blocks=4,
    width=16,
    hidden=32,
    batch=8,
    tf_blocks=2,
    d_model=16,
    heads=2,
    seq=4,
    vocab=11,
    tf_batch=4,
    microbatches=4,
    reps=2,
    warmup=1,
    timeout=120.0,
)


@pytest.fixture(scope="module")
def tiny_rows() -> list[dict[str, Any]]:
    return bench.run_bench(TINY)


def test_a_tiny_side_by_side_run_reports_consistent_rows(tiny_rows: list[dict[str, Any]]) -> None:
    rows = [r for r in tiny_rows if r["model"] == "mlp"]
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    for r in rows:
        assert r["zeropipe_step_s"] > 0 and r["torch_step_s"] > 0 and r["sequential_s"] > 0
        assert r["ratio"] == pytest.approx(r["zeropipe_step_s"] / r["torch_step_s"])
        assert r["efficiency"] == pytest.approx(r["sequential_s"] / (2 * r["zeropipe_step_s"]))
        assert r["torch_efficiency"] == pytest.approx(r["sequential_s"] / (2 * r["torch_step_s"]))
        # The bench runs Pipeline's own default group_w, and says so.
        assert (r["ranks"], r["microbatches"], r["group_w"]) == (2, 4, bench.default_group_w())
        # Both libraries ran the cut chosen by measured time: every layer, every stage used.
        assert sum(r["cut"]) == 4 and min(r["cut"]) >= 1
    assert [len(r["cut"]) for r in rows] == [2, 4]
    table = bench.format_table(tiny_rows, TINY)
    assert "4 x Linear(16,32)-GELU-Linear(32,16)" in table
    assert "1f1b" in table and "zbv" in table
    assert "Pipeline's defaults" in table


def test_both_models_are_benched_and_reported(tiny_rows: list[dict[str, Any]]) -> None:
    assert TINY.models == ("mlp", "transformer")  # both by default
    assert [(r["model"], r["schedule"]) for r in tiny_rows] == [
        ("mlp", "1f1b"),
        ("mlp", "zbv"),
        ("transformer", "1f1b"),
        ("transformer", "zbv"),
    ]
    for r in tiny_rows:
        assert r["efficiency"] == pytest.approx(r["sequential_s"] / (2 * r["zeropipe_step_s"]))
    # The transformer cuts between attention and MLP: embedding, 2 x (attention, MLP), head.
    assert [sum(r["cut"]) for r in tiny_rows[2:]] == [6, 6]
    table = bench.format_table(tiny_rows, TINY)
    assert "transformer: embedding, 2 pre-LN blocks (width 16, 2 heads)" in table
    assert "of the model's 6 layers (2 blocks; embedding, attention and MLP" in table


def test_the_table_says_what_the_cut_counts() -> None:
    # A 6-block transformer cut [7, 7]: the numbers count its 14 layers (the issue: "layers
    # per stage [7, 7]" for a 6-block model, with nothing saying why they add up to 14).
    cfg = bench.BenchConfig(tf_blocks=6, blocks=8, group_w=1)
    rows = [{**_rows({"1f1b": 1.0})[0], "model": m, "cut": cut}
            for m, cut in (("mlp", [4, 4]), ("transformer", [7, 7]))]  # fmt: skip
    lines = bench.format_table(rows, cfg).splitlines()
    described = [line for line in lines if line.startswith("layers per stage: ")]
    assert described == [
        "layers per stage: of the model's 8 layers (one per block)",
        "layers per stage: of the model's 14 layers (6 blocks; embedding, attention and MLP "
        "of each block, head)",
    ]
    for row, line in zip(rows, described, strict=True):
        assert sum(row["cut"]) == int(line.split("model's ")[1].split()[0])


def _rows(ratios: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {
            "model": "mlp",
            "schedule": name,
            "ranks": 2,
            "microbatches": 8,
            "group_w": 4,
            "cut": [4, 4],
            "zeropipe_step_s": ratio,
            "torch_step_s": 1.0,
            "ratio": ratio,
            "sequential_s": 1.0,
            "sequential_whole_batch_s": 0.5,
            "efficiency": 1.0 / (2 * ratio),
            "torch_efficiency": 0.5,
        }
        for name, ratio in ratios.items()
    ]


def test_runs_relaunch_and_summarise_each_schedules_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launched = iter(
        [
            _rows({"1f1b": 0.70, "zbv": 0.60}),
            _rows({"1f1b": 0.90, "zbv": 0.50}),
            _rows({"1f1b": 0.80, "zbv": 0.70}),
        ]
    )
    calls: list[bench.BenchConfig] = []

    def fake_run_bench(cfg: bench.BenchConfig) -> list[dict[str, Any]]:
        calls.append(cfg)
        return next(launched)

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert cli.main(["bench", "--runs", "3", "--schedules", "1f1b,zbv"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 3  # one launch per run
    assert "run 3 of 3:" in out
    summary = out[out.index("over 3 runs") :].splitlines()
    assert summary[2].split() == ["mlp", "1f1b", "0.70", "0.90", "0.80", "0.80"]
    assert summary[3].split() == ["mlp", "zbv", "0.60", "0.50", "0.70", "0.60"]

    launched = iter([_rows({"1f1b": 0.7}), _rows({"1f1b": 0.9})])
    assert cli.main(["bench", "--runs", "2", "--json", "--schedules", "1f1b"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run"], r["ratio"]) for r in lines] == [(0, 0.7), (1, 0.9)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "--reps must be at least 1, got 0"),
        (["--runs", "0"], "--runs must be at least 1, got 0"),
        (["--ranks", "1"], "--ranks must be at least 2, got 1"),
        (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
        (["--model", "mlp", "--batch", "4"], "--batch 4 cannot be split into 8 microbatches"),
        (["--schedules", ","], "--schedules is empty"),
        (["--schedules", "zb-h1"], "no torch counterpart for 'zb-h1'"),
        (["--blocks", "3", "--schedules", "zbv"], "needs 4 stages; give --blocks >= 4"),
        (
            ["--model", "transformer", "--tf-blocks", "1", "--ranks", "4", "--schedules", "zbv"],
            "needs 8 stages; the transformer has 4 layers (1 block; embedding, attention and MLP",
        ),
        (["--model", "transformer", "--d-model", "30"], "--d-model 30 must be a multiple"),
        (["--model", "transformer", "--tf-batch", "4"], "--tf-batch 4 cannot be split"),
        (["--layers", "2"], "unrecognized arguments: --layers 2"),  # --tf-blocks says it
    ],
)
def test_bad_flags_fail_in_one_line_before_any_process_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
