"""``Pipeline``'s constructor: what to run, what to minimise, where, how -- and nothing else.

An unknown keyword is a TypeError (naming the closest parameter, where one is close); a
model that is not cut, and a torchrun world that was never initialised, are refused in
one line.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeropipe
from tests.gradcheck import assert_same_gradients, mlp, reference
from zeropipe import Pipeline, RuntimeOptions, build_schedule
from zeropipe.core.errors import PipelineError


def test_the_constructor_takes_at_most_eight_parameters() -> None:
    params = [p for p in inspect.signature(Pipeline).parameters.values() if p.name != "self"]
    assert len(params) <= 8, [p.name for p in params]
    assert [p.name for p in params] == [
        "stages",
        "schedule",
        "loss_fn",
        "microbatches",
        "loss_count",
        "balance",
        "mesh",
        "options",
    ]
    assert all(p.kind is not p.VAR_KEYWORD for p in params)


@pytest.mark.parametrize("keyword", ["ranks", "seed", "process_group"])
def test_an_unknown_keyword_is_a_type_error_naming_it(keyword: str) -> None:
    with pytest.raises(TypeError) as err:
        Pipeline(mlp(layers=2), "1f1b", F.mse_loss, microbatches=2, **{keyword: 2})  # type: ignore[call-arg]
    assert str(err.value) == f"Pipeline.__init__() got an unexpected keyword argument {keyword!r}"


@pytest.mark.parametrize(
    ("keyword", "meant"),
    [("microbatch", "microbatches"), ("option", "options"), ("stage", "stages")],
)
def test_a_misspelt_keyword_is_a_type_error_naming_the_closest_parameter(
    keyword: str, meant: str
) -> None:
    with pytest.raises(TypeError) as err:
        Pipeline(mlp(layers=2), "1f1b", F.mse_loss, microbatches=2, **{keyword: 2})  # type: ignore[call-arg]
    assert str(err.value) == (
        f"Pipeline.__init__() got an unexpected keyword argument {keyword!r}. "
        f"Did you mean {meant!r}?"
    )


def test_microbatches_passed_by_position_is_refused_naming_the_keyword() -> None:
    stages = list(mlp(layers=2).children())
    with pytest.raises(PipelineError, match=r"microbatches= and the rest are keywords"):
        Pipeline(stages, "1f1b", 2, F.mse_loss)  # type: ignore[call-arg]
    with pytest.raises(PipelineError, match=r"loss_fn must be callable, got int 2"):
        Pipeline(stages, "1f1b", 2)  # type: ignore[arg-type]


def test_a_plain_module_is_refused_in_one_line_saying_what_to_pass() -> None:
    class My(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with pytest.raises(PipelineError) as err:
        Pipeline(My(), "1f1b", F.mse_loss, microbatches=2)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message
    assert "got a single My" in message
    assert "zeropipe.split(model, n)" in message and "[stage0, stage1, ...]" in message


def test_a_torchrun_world_that_was_never_initialised_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    stages = list(mlp(layers=2).children())
    with pytest.raises(PipelineError) as err:
        Pipeline(stages, "1f1b", F.mse_loss, microbatches=2)
    message = str(err.value)
    assert "\n" not in message
    assert "WORLD_SIZE=2" in message and "zeropipe.init_from_env()" in message
    # Said on purpose, the whole pipeline runs in this process.
    pipe = Pipeline(stages, "1f1b", F.mse_loss, microbatches=2, mesh="local")
    assert not pipe.distributed and pipe.schedule.num_ranks == 2


def test_a_named_schedule_on_a_sequential_in_one_process_says_to_build_it() -> None:
    with pytest.raises(PipelineError, match=r"zeropipe.build_schedule\('zbv', ranks=R"):
        Pipeline(mlp(layers=4), "zbv", F.mse_loss, microbatches=4)


def test_options_carry_seed_device_and_protocol_and_check_them() -> None:
    with pytest.raises(PipelineError, match="p2p must be"):
        RuntimeOptions(p2p="fast")  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="seed must be an int"):
        RuntimeOptions(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="mesh='world'"):
        Pipeline(mlp(layers=2), build_schedule("1f1b", ranks=2, microbatches=2), mesh="world")


def test_the_new_form_is_exact_with_dropout_seeded_by_the_options() -> None:
    """The seed given through RuntimeOptions: loss and gradients of the unpipelined model."""
    model = mlp(layers=4, dropout=0.3)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4, seed=7)
    for schedule in (
        build_schedule("1f1b", ranks=2, microbatches=4),
        build_schedule("zbv", ranks=2, microbatches=4, group_w=2),
    ):
        model.zero_grad(set_to_none=True)
        pipe = Pipeline(model, schedule, F.mse_loss, options=zeropipe.RuntimeOptions(seed=7))
        loss = pipe.step(x, y)
        assert abs(loss.item() - ref_loss.item()) < 1e-12, schedule.name
        assert assert_same_gradients(model.named_parameters(), ref) < 1e-12, schedule.name
