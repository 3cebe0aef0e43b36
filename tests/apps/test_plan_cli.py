"""``zeropipe plan``: the ranked table from specs or a measured cost model, its JSON,
its plot, and one-line errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeropipe.apps import cli
from zeropipe.apps.plan_output import candidates_from_json
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.planning.cluster import Config

SMALL = (
    "plan", "--model", "llama-3-8b", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "2048",
    "--global-batch", "32", "--schedules", "1f1b,zbv", "--microbatch-sizes", "1,2", "--quiet",
)  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.split()[:2] == ["#", "pp"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))  # a memory plan has single spaces
    return rows


def test_cluster_mode_prints_a_ranked_table_and_round_trips_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, *SMALL, "--top", "4", "--json", str(path))
    assert (code, err) == (0, "")
    assert "llama-3-8b, 8.0B parameters" in out and "16 x h100-sxm" in out
    assert "matmuls at 60% of peak" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    steps = [float(r[9]) for r in rows]
    assert steps == sorted(steps)
    assert "configurations simulated" in out and "pruned (a lower bound" in out
    assert "tensor parallel tp in {1,2,4,8} inside a node, sequence parallel" in out
    data = json.loads(path.read_text())
    cands = candidates_from_json(data)
    assert len(cands) == 4 and cands[0].step_time == pytest.approx(steps[0], rel=1e-3)
    assert [c.to_dict() for c in cands] == data["candidates"]
    assert {c.schedule for c in cands} <= {"1f1b", "zbv"}
    for c, r in zip(cands, rows, strict=True):
        assert c.pp * c.dp * c.tp == 16 and c.dp * c.microbatch_size * c.microbatches == 32
        assert [r[1], r[2], r[3]] == [str(c.pp), str(c.dp), str(c.tp)]
    assert all("tp" in row for row in data["candidates"])


def test_unfused_attention_with_dropout_plans_slower_steps_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, flash, _ = run(capsys, *SMALL, "--top", "1")
    assert code == 0 and "flash attention, " in flash
    code, unfused, _ = run(capsys, *SMALL, "--top", "1", "--attention", "unfused", "--dropout")
    assert code == 0 and "unfused attention, dropout, " in unfused
    # The score matrices' passes through memory make the best step slower.
    assert float(_rows(unfused)[0][9]) > float(_rows(flash)[0][9])


def test_progress_goes_to_stderr_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL[:-1], "--top", "2")
    assert code == 0
    assert "plan:" not in out
    assert all(line.startswith("plan: ") for line in err.splitlines())


def test_plot_draws_the_best_timeline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "best.png"
    code, out, _ = run(capsys, *SMALL, "--top", "1", "--plot", str(path))
    assert code == 0 and f"wrote plot: {path}" in out
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def _cost_file(tmp_path: Path) -> Path:
    stage = StageCost(F=1.0, I=1.0, W=1.0, act=10.0, weights=5.0, boundary_bytes=1.0)
    costs = CostModel(tuple(stage for _ in range(4)), latency=0.1, unit="bytes")
    path = tmp_path / "costs.json"
    path.write_text(costs.to_json())
    return path


def test_costs_mode_ranks_schedules_for_one_pipeline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ("plan", "--costs", str(_cost_file(tmp_path)), "--ranks", "2", "--microbatches", "8")
    code, out, err = run(capsys, *argv, "--quiet", "--top", "20")
    assert (code, err) == (0, "")
    rows = _rows(out)
    names = [r[4] for r in rows]  # no dp / mbs / throughput columns here
    assert {"1f1b", "zb-h1", "zbv", "interleaved-1f1b"} <= set(names)
    assert {r[3] for r in rows} == {"1", "2"}  # stages merged for one chunk, kept for two
    assert "tokens/s" not in out and "dp" not in out.split("\n\n")[1].splitlines()[0].split()
    steps = [float(r[6]) for r in rows]
    assert steps == sorted(steps)
    # zb-h1 beats 1f1b on the same costs: W fills the bubbles.
    assert names.index("zb-h1") < names.index("1f1b")


def test_costs_mode_with_a_limit_nothing_fits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ("plan", "--costs", str(_cost_file(tmp_path)), "--ranks", "2", "--microbatches", "4")
    code, out, err = run(capsys, *argv, "--quiet", "--memory", str(5 / 2**30))
    assert code == 2 and "NO" in out
    assert err.startswith("zeropipe: error: no configuration fits the memory limit")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--gpu", "tpu-v9"), "unknown GPU 'tpu-v9'; known: a100-40gb"),
        (("--model", "nope-1b"), "unknown model 'nope-1b'"),
        (("--gpus", "12"), "--gpus 12 is not a whole number of h100-sxm nodes"),
        (("--gpus", "64", "--global-batch", "1", "--tp", "1"), "no configuration to price"),
        (("--tp", "3"), "--tp 3 does not divide --gpus 16"),
        (("--tp", "16", "--gpus", "32"), "--tp 16 is more than the 8 GPUs of a h100-sxm node"),
        (("--tp", "6", "--gpus", "48"), "does not divide the 8 GPUs of a node"),
        (("--tp", "0"), "argument --tp: expected integers >= 1"),
        (("--pp", "1,0"), "argument --pp: expected integers >= 1"),
        (("--dp", "3"), "--dp 3 does not divide --gpus 16"),
        (("--pp", "64", "--gpus", "64"), "--pp 64: deeper than the model's 32 blocks"),
        (("--memory", "1"), "no configuration fits the memory limit"),
        (("--schedules", "1f1b,bogus"), "unknown schedule(s) bogus"),
        (("--ranks", "2"), "--ranks and --microbatches go with --costs"),
        # A share of the peak above 1 was refused config by config, then blamed on the batch.
        (("--efficiency", "1.01"), "argument --efficiency: must be in (0, 1], got 1.01"),
        (("--efficiency", "5"), "argument --efficiency: must be in (0, 1], got 5"),
        (("--efficiency", "0"), "argument --efficiency: must be in (0, 1], got 0"),
    ],
)
def test_bad_input_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    args = list(SMALL)
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, _, err = run(capsys, *args)
    assert code == 2
    assert err.startswith("zeropipe: error: ") and message in err, err


def test_missing_flags_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "plan", "--model", "llama-3-8b")
    assert code == 2 and "--gpus, --gpu, --seq, --global-batch" in err
    code, _, err = run(capsys, "plan", "--costs", str(tmp_path / "none.json"), "--ranks", "2")
    assert code == 2 and "--costs needs --ranks R and --microbatches M" in err
    code, _, err = run(capsys, "plan", "--costs", "x.json", "--gpus", "8")
    assert code == 2 and "drop --gpus" in err
    code, _, err = run(capsys, "plan", "--costs", "x.json", "--tp", "2", "--ranks", "2")
    assert code == 2 and "drop --tp" in err


def test_config_chunks() -> None:
    assert Config(4, 2, 1, 8, 8).chunks == 2


def test_tp_pp_dp_lists_restrict_the_search(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    argv = (*SMALL, "--top", "20", "--tp", "2,4", "--pp", "2,4", "--json", str(path))
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "tensor parallel tp in {2,4} inside a node" in out
    cands = candidates_from_json(json.loads(path.read_text()))
    assert cands and {c.tp for c in cands} <= {2, 4} and {c.pp for c in cands} <= {2, 4}
    assert {c.tp for c in cands} == {2, 4}  # both kept: neither is pruned away entirely
    for c in cands:
        assert c.pp * c.dp * c.tp == 16
    code, out, _ = run(capsys, *SMALL, "--top", "5", "--tp", "4", "--pp", "2", "--dp", "2")
    assert code == 0 and {tuple(r[1:4]) for r in _rows(out)} == {("2", "2", "4")}


def test_sequence_parallelism_lowers_memory_not_time(capsys: pytest.CaptureFixture[str]) -> None:
    fixed = (*SMALL, "--top", "1", "--tp", "4", "--pp", "2", "--dp", "2", "--schedules", "1f1b")
    fixed += ("--microbatch-sizes", "2")
    code, with_sp, _ = run(capsys, *fixed)
    assert code == 0
    code, without, _ = run(capsys, *fixed, "--no-sequence-parallel")
    assert code == 0 and "no sequence parallelism" in without
    (a,), (b,) = _rows(with_sp), _rows(without)
    # The same collective bytes (reduce-scatter + all-gather against all-reduce); the
    # norms, residual stream and dropout masks are cut along the sequence: less memory
    # and less memory-bound work.
    assert float(a[9]) <= float(b[9])
    assert float(a[13]) < float(b[13])


def test_checkpointed_blocks_trade_time_for_memory_and_say_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One fixed layout: every block's forward runs again inside its backward (a longer
    # step), and a stage keeps only its blocks' inputs and one block rebuilt (less memory).
    fixed = (*SMALL, "--top", "1", "--tp", "1", "--pp", "4", "--dp", "4", "--schedules", "1f1b")
    fixed += ("--microbatch-sizes", "2", "--shard-optimizer")
    code, kept, _ = run(capsys, *fixed)
    assert code == 0 and "every block checkpointed" not in kept
    code, rebuilt, _ = run(capsys, *fixed, "--checkpoint-blocks")
    assert code == 0 and "flash attention, every block checkpointed, " in rebuilt
    (a,), (b,) = _rows(kept), _rows(rebuilt)
    assert a[8] == b[8] == "none"  # no recompute (R) planned in either
    assert float(b[9]) > float(a[9])
    assert float(b[13]) < float(a[13])


def test_tp_across_nodes_is_priced_on_the_network(capsys: pytest.CaptureFixture[str]) -> None:
    def one(gpus: int, tp: int, *more: str) -> float:
        argv = ("plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--seq", "2048",
                "--global-batch", "2", "--gpus", str(gpus), "--tp", str(tp), "--pp", "1",
                "--dp", "1", "--microbatch-sizes", "2", "--schedules", "1f1b", "--quiet")  # fmt: skip
        code, out, _ = run(capsys, *argv, *more)
        assert code == 0, out
        assert f"tensor parallel tp in {{{tp}}}" in out
        return float(_rows(out)[0][9])

    # Twice the GPUs, but every block's collectives on a link 9x slower: a slower step.
    assert one(16, 16, "--tp-across-nodes") > one(8, 8)


def test_a_measured_plan_that_would_run_for_minutes_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ("plan", "--costs", str(_cost_file(tmp_path)), "--ranks", "2")
    code, out, err = run(capsys, *argv, "--microbatches", "100000", "--quiet")
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert "10 schedule(s) of 2 rank(s) x up to 2 chunk(s) x 100000 microbatches" in line
    assert "about 1.2e+07 actions, which would take ~" in line and "--force" in line, line


def test_a_cluster_plan_whose_largest_schedule_is_huge_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096")
    code, out, err = run(capsys, *argv, "--global-batch", "1000000")
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert "pp 8 x dp 1 x tp 1 at microbatch size 1" in line and "4.8e+07 actions" in line, line


class _Searched(Exception):
    pass


@pytest.mark.parametrize(
    "argv",
    [  # the README's and docs' plans
        ("llama-3-8b", "64", "4096", "256"),
        ("llama-3-70b", "1024", "4096", "1024"),
        ("llama-3.1-405b", "8192", "8192", "2048"),
    ],
)
def test_the_documented_plans_are_within_the_size_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    from zeropipe.apps import plan_cli

    def searched(**_: object) -> None:
        raise _Searched  # the size check let it through; the search itself is not run here

    monkeypatch.setattr(plan_cli, "search", searched)
    model, gpus, seq, batch = argv
    with pytest.raises(_Searched):
        cli.main(["plan", "--model", model, "--gpus", gpus, "--gpu", "h100-sxm", "--seq", seq,
                  "--global-batch", batch])  # fmt: skip


def test_force_plans_past_the_size_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from zeropipe.apps import plan_size

    monkeypatch.setattr(plan_size, "PLAN_LIMIT", 10)
    argv = ("plan", "--costs", str(_cost_file(tmp_path)), "--ranks", "2", "--microbatches", "4")
    assert run(capsys, *argv, "--quiet")[0] == 2
    code, out, _ = run(capsys, *argv, "--quiet", "--force", "--schedules", "1f1b")
    assert code == 0 and "1f1b" in out
