"""zeropipe.profile: stage costs measured on this machine, repeatable, in the runtime's units."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from zeropipe.apps import cli
from zeropipe.core.costs import CostModel
from zeropipe.core.ir import Kind
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.profiling import profile_stages
from zeropipe.runtime.launch import launch

B, A, H, C = 8, 32, 128, 16  # microbatch rows, input, hidden, output widths


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(A, H), nn.GELU(), nn.Linear(H, C)),
        nn.Sequential(nn.Linear(C, H), nn.Tanh(), nn.Linear(H, H), nn.GELU(), nn.Linear(H, C)),
    ]


def test_memory_is_counted_as_the_runtime_counts_it() -> None:
    stages = _stages()
    costs = profile_stages(stages, torch.randn(B, A), warmup=1, repeat=3)
    f32 = 4
    # Stage 0: GELU saves the first linear's output, the second linear its input
    # (GELU's output); the stage input and output are boundary tensors, not counted.
    assert costs.stages[0].act == f32 * B * (H + H)
    # What W still needs: each linear's input and output gradient.
    assert costs.stages[0].act_w == f32 * B * ((A + H) + (H + C))
    # Stage 1 (last, no loss: its output is a boundary too): tanh saves its output,
    # linear 2 its input (the same tensor), GELU its input, linear 3 GELU's output.
    assert costs.stages[1].act == f32 * B * (H + H + H)
    assert costs.stages[0].boundary_bytes == f32 * B * C
    assert costs.stages[1].boundary_bytes == 0
    assert costs.unit == "bytes"


def test_times_are_positive_and_split_backward_is_real() -> None:
    costs = profile_stages(_stages(), torch.randn(64, A), warmup=1, repeat=5)
    for c in costs.stages:
        assert min(c.F, c.I, c.W, c.time(Kind.B), c.time(Kind.R)) > 0
        # W does real work (the linears' weight products): not a no-op beside I.
        assert c.W > 0.05 * c.I


def test_two_profiles_agree() -> None:
    """Back-to-back profiles agree within 1.5x per figure, memory exactly.

    Why 1.5x: each figure is the median of 7 repetitions interleaved across
    stages on one thread; measured on the shared 2-core development machine,
    back-to-back profiles of this model differed by at most 1.27x over 24
    pairs.  A broken measurement (I timing the whole backward, W timing
    nothing, a forward timed twice) moves a figure by 2x or more.  Other
    processes' load can still shift a median, so one more profile is taken
    before failing, and it must agree with one of the first two.
    """
    stages = _stages()
    x = torch.randn(64, A)

    def figures(c: CostModel) -> list[float]:
        return [getattr(s, k) for s in c.stages for k in ("F", "I", "W", "B", "R")]

    def agree(a: CostModel, b: CostModel) -> bool:
        return all(
            max(u, v) <= 1.5 * min(u, v) for u, v in zip(figures(a), figures(b), strict=True)
        )

    first, second = profile_stages(stages, x), profile_stages(stages, x)
    assert [s.act for s in first.stages] == [s.act for s in second.stages]
    assert [s.act_w for s in first.stages] == [s.act_w for s in second.stages]
    if not agree(first, second):
        third = profile_stages(stages, x)
        assert agree(first, third) or agree(second, third), (figures(first), figures(second))


def test_the_model_is_left_as_it_was() -> None:
    stages = _stages()
    for p in stages[0].parameters():
        p.grad = torch.full_like(p, 3.0)
    x = torch.randn(B, A)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    stages[1].eval()
    profile_stages(stages, x, warmup=0, repeat=1, threads=1)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG state restored
    assert torch.get_num_threads() == threads
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in stages[0].parameters())
    assert all(p.grad is None for p in stages[1].parameters())
    assert all(
        type(m) is nn.Linear for s in stages for m in s.modules() if isinstance(m, nn.Linear)
    )
    assert stages[0].training and not stages[1].training


def test_loss_on_the_last_stage_and_json_round_trip(tmp_path: object) -> None:
    stages = _stages()
    target = torch.randn(B, C)
    costs = profile_stages(
        stages, torch.randn(B, A), target=target, loss_fn=nn.functional.mse_loss, repeat=2
    )
    # With a loss the last stage's output is held by the loss graph only: counted.
    assert costs.stages[1].act >= 4 * B * (3 * H)
    assert costs.latency == 0 and costs.bandwidth == float("inf")
    assert "not measured" in costs.meta["comm"]
    again = CostModel.from_json(costs.to_json())
    assert again == costs and again.meta["repeat"] == 2
    timeline = simulate(generate("1f1b", 2, 4), again)
    assert timeline.makespan > 0 and timeline.memory_unit == "bytes"


def test_an_nn_sequential_is_profiled_layer_by_layer() -> None:
    model = nn.Sequential(nn.Linear(A, H), nn.ReLU(), nn.Linear(H, C))
    costs = profile_stages(model, torch.randn(B, A), warmup=0, repeat=1)
    assert len(costs.stages) == 3


def test_target_without_loss_is_refused() -> None:
    with pytest.raises(Exception, match="both target and loss_fn"):
        profile_stages(_stages(), torch.randn(B, A), target=torch.randn(B, C))


def _profile_on_rank(rank: int, world: int) -> tuple[float, float, float, str]:
    costs = profile_stages(_stages(), torch.randn(B, A), warmup=1, repeat=3)
    return costs.latency, costs.bandwidth, costs.post, costs.meta["comm"]


def test_wire_is_measured_between_two_processes() -> None:
    results = launch(_profile_on_rank, 2, timeout=120)
    (lat0, bw0, post0, how), (lat1, bw1, post1, _) = results
    assert (lat0, bw0, post0) == (lat1, bw1, post1)  # every rank gets the same figures
    assert 0 < lat0 < 0.1 and bw0 > 1e6  # gloo on one host: well under 100 ms, over 1 MB/s
    assert 0 < post0 < 0.05  # posting costs something, and far less than a step
    assert "ranks 0 and 1" in how


def test_w_run_together_is_measured_when_paired_runs_were_timed() -> None:
    # Every other repetition runs two W of a stage as one; W_fused is what the second adds.
    # Whether it is cheaper than a W of its own is a timing claim, shown by
    # benchmarks/split_backward.py, not asserted here.
    paired = profile_stages(_stages(), torch.randn(B, A), warmup=1, repeat=4)
    for c in paired.stages:
        assert c.W_fused is not None and math.isfinite(c.W_fused) and c.W_fused >= 0
    # warmup=0, repeat=1: the one timed repetition runs a W alone, so nothing is paired.
    single = profile_stages(_stages(), torch.randn(B, A), warmup=0, repeat=1)
    assert all(c.W_fused is None for c in single.stages)


def test_stage_profile_leaves_the_runtime_overhead_to_the_planning_layer() -> None:
    costs = profile_stages(_stages(), torch.randn(B, A), warmup=1, repeat=3)
    assert costs.overhead == 0  # zeropipe.planning.plan.profile measures it (it needs the runtime)
    assert costs.post == 0  # one process: nothing to post


def test_cli_profile_writes_costs(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/costs.json"
    args = ["profile", "--model", "mlp", "--blocks", "4", "--width", "32", "--stages", "2"]
    code = cli.main([*args, "--repeat", "2", "--warmup", "1", "--balance", "--out", out])
    text, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "stage" in text and "wrote costs" in text
    costs = CostModel.from_json(Path(out).read_text())
    assert len(costs.stages) == 2 and sum(costs.meta["cut"]) == 4
    code = cli.main(["simulate", "--schedule", "1f1b", "--ranks", "2", "--costs", out, "--json"])
    got = json.loads(capsys.readouterr()[0])
    assert code == 0 and got["memory_unit"] == "bytes"


def test_cli_profile_counts_blocks_and_the_layers_its_cut_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The issue: "--layers 4" printed "10 layers"; the flag counted blocks, the line layers.
    out = tmp_path / "costs.json"
    args = ["profile", "--blocks", "2", "--width", "16", "--seq", "8", "--stages", "2"]
    code = cli.main([*args, "--repeat", "1", "--warmup", "0", "--out", str(out)])
    lines = capsys.readouterr()[0].splitlines()
    assert code == 0
    assert lines[0].startswith(
        "gpt: 2 blocks, 6 layers (embedding, attention and MLP of each block, head), "
        "in 2 stage(s) of [3, 3] layers, "
    )
    meta = CostModel.from_json(out.read_text()).meta
    assert (meta["blocks"], meta["layers"], sum(meta["cut"])) == (2, 6, 6)
