"""dualpipe in one process: PP stages given, the copies run on them, exact; its refusals.

The 2- and 4-rank gloo checks of its loss and gradients are in the distributed launch
(dist_cases.grid), with every other generator; the refusal of its eval without a target
on several ranks is read here from that launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, reference
from tests.runtime import dist_cases
from zeropipe import Pipeline, build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind
from zeropipe.runtime.options import RuntimeOptions


def _stages(pp: int) -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double() for _ in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_pp_stages_named_dualpipe_run_each_twice_and_give_the_unsplit_gradients(
    pp: int, overlap: bool
) -> None:
    stages = _stages(pp)
    model = nn.Sequential(*stages)
    m = 2 * pp
    x, y = torch.randn(3 * m, 6, dtype=torch.float64), torch.randn(3 * m, 6, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, F.mse_loss, m)
    pipe = Pipeline(
        stages,
        "dualpipe",
        microbatches=m,
        loss_fn=F.mse_loss,
        options=RuntimeOptions(overlap=overlap),
    )
    # Each copy runs the very module of the stage it copies: one parameter, one .grad.
    run = pipe.parts.all_stages
    assert len(run) == 2 * pp
    assert all(run[pp + k].module is stages[k] for k in range(pp))
    loss = pipe.step(x, y)
    assert_same_loss(loss, ref_loss)
    assert_same_gradients(model.named_parameters(), ref)


def test_dropout_draws_alike_in_either_direction() -> None:
    model = mlp(dropout=0.5)
    x, y = batch_for(model, batch=13)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 6, seed=4)
    schedule = build_schedule("dualpipe", ranks=2, microbatches=6)
    loss = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(seed=4)).step(x, y)
    assert_same_loss(loss, ref_loss)
    assert_same_gradients(model.named_parameters(), ref)


def test_eval_gives_every_microbatchs_output_in_order() -> None:
    stages = _stages(2)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = Pipeline(stages, "dualpipe", microbatches=4, loss_fn=F.mse_loss)
    out = pipe.eval_step(x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, nn.Sequential(*stages)(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("count", "microbatches", "words"),
    [
        (3, 4, "even number of ranks"),
        (4, 5, "even number of microbatches"),
        (4, 4, ">= 2 x ranks - 2 = 6"),
    ],
)
def test_refusals_are_one_line(count: int, microbatches: int, words: str) -> None:
    with pytest.raises(PipelineError, match=words) as err:
        Pipeline(_stages(count), "dualpipe", microbatches=microbatches, loss_fn=F.mse_loss)
    assert "\n" not in str(err.value)


def test_a_stage_list_as_long_as_stages_and_copies_is_refused_naming_the_copies() -> None:
    schedule = build_schedule("dualpipe", ranks=2, microbatches=2)
    with pytest.raises(PipelineError, match=r"has 2 stages \(and 2 copies of them") as err:
        Pipeline(_stages(4), schedule, loss_fn=F.mse_loss)
    assert "\n" not in str(err.value)


def test_on_two_ranks_eval_without_a_target_is_refused_on_every_rank() -> None:
    results = dist_cases.main_results(2)
    for rank, out in enumerate(results):
        message = out["dualpipe_outputs"]
        assert isinstance(message, str), (rank, message)
        assert "ends its microbatches' routes on several ranks" in message, (rank, message)


@pytest.mark.parametrize("rewrite", ["checkpoint", "offload"])
def test_recompute_and_offload_keep_it_exact(rewrite: str) -> None:
    from zeropipe.core.passes.fit import checkpoint, offload

    model = mlp(dropout=0.3)
    x, y = batch_for(model, batch=9)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4, seed=2)
    base = build_schedule("dualpipe", ranks=2, microbatches=4).compute_only()
    schedule = (checkpoint if rewrite == "checkpoint" else offload)(base)
    assert schedule.routes == base.routes and schedule.copies == base.copies
    added = Kind.R if rewrite == "checkpoint" else Kind.OFFLOAD
    assert sum(a.kind is added for acts in schedule.actions for a in acts) == 2 * 4  # every one
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(seed=2))
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
