"""zeropipe.planning.plan: profile, balance and search for a model; the runtime's overhead; auto_plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gradcheck import assert_same_gradients, assert_same_loss, reference
from zeropipe.apps.models import GPTConfig, gpt
from zeropipe.apps.models.gpt import lm_loss
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind
from zeropipe.core.schedules import generate
from zeropipe.core.validate import validate
from zeropipe.planning.plan import (
    auto_plan,
    balance_by_time,
    layer_costs,
    plan_model,
    profile,
    runtime_overhead,
)
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.runtime.step.stage import split_layers


def _lopsided(seed: int = 0) -> nn.Sequential:
    """Six layers, two of them (0 and 2) several times the work of the others."""
    torch.manual_seed(seed)

    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 64))

    def narrow() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))

    return nn.Sequential(wide(), narrow(), wide(), narrow(), narrow(), narrow())


def test_balancing_puts_one_wide_layer_in_each_stage_measured() -> None:
    # The wide layers take about 20 times the work of the narrow ones, so the measured cut
    # cannot depend on timing noise; how much faster the balanced pipeline runs is shown by
    # benchmarks, never by a timed unit test.
    model = _lopsided()
    x = torch.randn(64, 64)
    assert balance_by_time(model, x, 2, repeat=5) == [2, 4]

    # On the measured per-layer costs, the balanced cut's slowest stage beats the uniform one's.
    costs = layer_costs(model, x, repeat=3)
    times = [c.F + c.time(Kind.B) for c in costs.stages]
    assert max(sum(times[:2]), sum(times[2:])) < max(sum(times[:3]), sum(times[3:]))


def test_split_layers_shares_the_layers() -> None:
    model = _lopsided()
    stages = split_layers(model, [3, 3])
    assert [len(s) for s in stages] == [3, 3]
    assert stages[1][0] is model[3]


def test_plan_model_cuts_the_model_for_the_schedule_it_picks() -> None:
    cfg = GPTConfig(layers=4, width=32, heads=2, seq=16)
    model = gpt(cfg)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(0))
    result = plan_model(model, tokens, 2, 4, target=tokens, loss_fn=lm_loss, repeat=3)
    assert sum(result.balance) == len(model)
    # One part per model stage: a copy (dualpipe's second direction) runs its original's.
    assert len(result.balance) == result.schedule.num_stages - len(result.schedule.copies)
    assert "cut" in result.explanation
    validate(result.schedule, costs=result.costs)


def test_runtime_overhead_per_action_is_measured() -> None:
    # The runtime's bookkeeping per action: more than nothing, less than a millisecond-scale
    # stage would take on any machine this runs on.
    assert 0 < runtime_overhead(torch.device("cpu"), warmup=2, repeat=15) < 0.01
    costs = profile([nn.Linear(8, 8), nn.Linear(8, 8)], torch.randn(4, 8), warmup=1, repeat=3)
    assert 0 < costs.overhead < 0.01
    assert costs.post == 0  # one process: nothing to post


def test_auto_plan_under_given_costs_keeps_the_callers_cut() -> None:
    plan = auto_plan(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), 2, 4,
                     costs=CostModel.uniform(2))  # fmt: skip
    assert plan.balance is None and plan.schedule.num_ranks == 2
    assert plan.explanation
    validate(plan.schedule)


def test_auto_plan_profiles_and_its_plan_runs_with_the_reference_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, dtype=torch.float64) for _ in range(4)])
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randn(8, 8, dtype=torch.float64)
    plan = auto_plan(model, 2, 4, sample=(x, y), loss_fn=F.mse_loss)
    assert plan.balance is not None and sum(plan.balance) == 4
    pipe = Pipeline(model, plan.schedule, loss_fn=F.mse_loss, balance=plan.balance)
    loss = pipe.step(x, y)
    got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    expected = F.mse_loss(model(x), y)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad, rtol=0, atol=1e-12)  # type: ignore[arg-type]


def test_an_auto_plan_that_is_dualpipe_runs_with_the_unsplit_models_gradients() -> None:
    # Half of each F/B pair hidden, W cheaper than I: DualPipe's two directions win on 4 ranks.
    costs = CostModel(tuple(StageCost(F=1, I=1, W=0.5, weights=1) for _ in range(4)), overlap=0.5)
    torch.manual_seed(2)
    stages = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double() for _ in range(4)]
    model = nn.Sequential(*stages)
    plan = auto_plan(stages, 4, 8, costs=costs)
    made = generate("dualpipe", 4, 8)
    assert (plan.schedule.actions, plan.schedule.copies) == (made.actions, made.copies)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 8)
    pipe = Pipeline(stages, plan.schedule, loss_fn=F.mse_loss)
    assert [s.module for s in pipe.parts.all_stages[4:]] == stages  # the copies: same modules
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)


def test_auto_plan_refuses_what_it_cannot_plan() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(PipelineError, match=r"costs= .* or sample="):
        auto_plan(model, 2, 2)
    with pytest.raises(PipelineError, match=r"nn\.Sequential"):
        auto_plan([nn.Linear(2, 2), nn.Linear(2, 2)], 2, 2, sample=(torch.zeros(2, 2), None))


def test_pipeline_points_auto_at_auto_plan() -> None:
    with pytest.raises(PipelineError, match="auto_plan"):
        Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "auto", microbatches=2)


def _two_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Sequential(nn.Linear(8, 8))]


def _bytes(costs: CostModel) -> list[tuple[float, float, float]]:
    return [(c.act, c.act_w, c.boundary_bytes) for c in costs.stages]


def test_profile_takes_the_inputs_and_target_pair_as_auto_plan_does() -> None:
    # It was a raw "TypeError: Sequential.forward() takes 2 positional arguments but 3 were
    # given": the pair was passed to the first stage as two inputs.
    stages, x, y = _two_stages(), torch.randn(4, 8), torch.randn(4, 8)
    once = {"warmup": 0, "repeat": 1}
    paired = profile(stages, (x, y), loss_fn=F.mse_loss, **once)
    apart = profile(stages, x, target=y, loss_fn=F.mse_loss, **once)  # as auto_plan calls it
    no_loss = profile(stages, x, **once)
    assert _bytes(paired) == _bytes(apart)
    # The target reached the loss: the last stage saves what the loss needs for backward.
    assert paired.stages[-1].act > no_loss.stages[-1].act == 0
    # The same pair, as the whole batch, is what auto_plan takes.
    model = nn.Sequential(*_two_stages())
    plan = auto_plan(model, 2, 2, sample=(torch.randn(8, 8), torch.randn(8, 8)), loss_fn=F.mse_loss)
    assert plan.balance == [1, 1]


@pytest.mark.parametrize(
    ("sample", "loss_fn", "says"),
    [
        ("pair", None, r"Sequential\.forward\(input\), cannot take the sample's 2 input tensors"),
        ("inputs", F.mse_loss, r"loss_fn needs the target"),
        ("words", F.mse_loss, r"sample's inputs must be a tensor or a tuple of tensors .*got str"),
    ],
)
def test_a_sample_the_first_stage_cannot_take_is_one_typed_line(
    sample: str, loss_fn: Any, says: str
) -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    given: Any = {"pair": (x, y), "inputs": x, "words": ("x", y)}[sample]
    for call in (
        lambda: profile(_two_stages(), given, loss_fn=loss_fn, warmup=0, repeat=1),
        lambda: auto_plan(nn.Sequential(*_two_stages()), 2, 2, sample=given, loss_fn=loss_fn),
    ):
        with pytest.raises(PipelineError, match=says) as err:
            call()
        assert len(str(err.value).splitlines()) == 1
