"""Edges of the Python API a new user met, each refused at construction or now working.

- a loss class passed as ``loss_fn`` (``nn.MSELoss``, not ``nn.MSELoss()``);
- a model built under ``torch.device("meta")`` and never materialised;
- ``torch.compile``'d stages: exact under 1F1B and ZB-V (split backward, recompute with
  dropout, ``eval_step``).  The tests compile with ``backend="aot_eager"``: it runs dynamo
  and AOT autograd (the stage's backward becomes one compiled autograd node, what the
  split backward must cope with) in float64 without a C++ compiler, while inductor would
  need one and takes tens of seconds on this machine's 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeropipe
from tests.gradcheck import assert_same_gradients, batch_for, mlp, reference
from zeropipe import Pipeline, build_schedule
from zeropipe.base import _compat
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint
from zeropipe.runtime.parts import build_stages, check_materialised


def _schedule() -> zeropipe.Schedule:
    return build_schedule("1f1b", ranks=2, microbatches=2)


# -- a loss class instead of a loss ---------------------------------------------------------
class MyLoss(nn.Module):
    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (nn.MSELoss, "loss_fn is the class torch.nn.MSELoss, not a loss: pass an instance, "
                     "nn.MSELoss()"),
        (MyLoss, f"loss_fn is the class {__name__}.MyLoss, not a loss: pass an instance, "
                 f"MyLoss()"),
    ],
    ids=["torch", "user"],
)  # fmt: skip
@pytest.mark.parametrize("positional", [False, True])
def test_a_loss_class_is_refused_at_construction_naming_the_instance(
    loss_fn: type[nn.Module], message: str, positional: bool
) -> None:
    with pytest.raises(PipelineError) as err:
        if positional:
            Pipeline(mlp(layers=2), _schedule(), loss_fn)
        else:
            Pipeline(mlp(layers=2), _schedule(), loss_fn=loss_fn)
    assert str(err.value) == message


# -- a model on the meta device -------------------------------------------------------------
def test_a_model_built_on_meta_is_refused_at_construction_naming_stage_and_fix() -> None:
    with torch.device("meta"):
        model = mlp(layers=4)
    with pytest.raises(PipelineError) as err:
        Pipeline(model, _schedule(), F.mse_loss)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("stage 0's parameter '0.body.0.weight' is on the meta device")
    assert "model.to_empty(device=...)" in message and "load_state_dict" in message


def test_a_meta_buffer_of_a_later_stage_is_named() -> None:
    model = mlp(layers=4)
    model[3].register_buffer("scale", torch.empty(8, device="meta"))
    with pytest.raises(PipelineError, match=r"^stage 1's buffer '1.scale' is on the meta device"):
        Pipeline(model, _schedule(), F.mse_loss)


def test_only_the_stages_this_process_runs_must_be_materialised() -> None:
    """A rank that materialises its own stages only (``--model-path``) leaves the others on
    meta: the check reads the stages it is given, the ones this process runs."""
    with torch.device("meta"):
        model = mlp(layers=4)
    stages = build_stages(model, 2, None)
    stages[1].module.to_empty(device="cpu")
    check_materialised({1: stages[1]})  # rank 1's stage: materialised, passes
    with pytest.raises(PipelineError, match="stage 0's parameter"):
        check_materialised({0: stages[0]})


def test_a_meta_model_materialised_and_loaded_runs_exactly() -> None:
    ref_model = mlp(layers=4)
    with torch.device("meta"):
        model = mlp(layers=4)
    model.to_empty(device="cpu")
    model.load_state_dict(ref_model.state_dict())
    x, y = batch_for(model, batch=4)
    ref_loss, ref = reference(ref_model, x, y, F.mse_loss, 2)
    loss = Pipeline(model, _schedule(), F.mse_loss).step(x, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12
    assert assert_same_gradients(model.named_parameters(), ref) <= 1e-12


# -- torch.compile'd stages -----------------------------------------------------------------
@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: dynamo's caches (and recompile limits) are global."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("name", "ranks", "chunks", "recompute"),
    [("1f1b", 2, 1, False), ("zbv", 2, 2, False), ("zbv", 2, 2, True)],
    ids=["1f1b", "zbv", "zbv-recompute"],
)
def test_compiled_stages_give_the_models_loss_and_gradients(
    name: str, ranks: int, chunks: int, recompute: bool
) -> None:
    model = mlp(layers=4, dropout=0.1 if recompute else 0.0)
    x, y = batch_for(model, batch=8)
    stages = [torch.compile(s, backend="aot_eager") for s in zeropipe.split(model, ranks * chunks)]
    schedule = build_schedule(name, ranks=ranks, microbatches=4)
    pipe = Pipeline(stages, checkpoint(schedule) if recompute else schedule, F.mse_loss)
    for step in range(2):  # the second step runs what the first compiled
        ref_loss, ref = reference(model, x, y, F.mse_loss, 4, step=step)  # its dropout masks
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-10, step
        assert assert_same_gradients(model.named_parameters(), ref) <= 1e-10
    model.eval()
    with torch.no_grad():
        assert (pipe.eval_step(x) - model(x)).abs().max().item() <= 1e-12
    # The forward ran compiled: the stage module is the compiled one, its layers the model's.
    assert all(s.module is c for s, c in zip(pipe.all_stages, stages, strict=True))
    assert all(_compat.uncompiled(c) is not c for c in stages)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_stage_compiled_in_place_runs_exactly() -> None:
    model = mlp(layers=4)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    stages = zeropipe.split(model, 2)
    for stage in stages:
        stage.compile(backend="aot_eager")
    loss = Pipeline(stages, "1f1b", F.mse_loss, microbatches=4).step(x, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-10
    assert assert_same_gradients(model.named_parameters(), ref) <= 1e-10


def test_a_compiled_whole_model_is_refused_naming_per_stage_compile() -> None:
    compiled = torch.compile(mlp(layers=4), backend="aot_eager")
    with pytest.raises(PipelineError) as err:
        Pipeline(compiled, _schedule(), F.mse_loss)
    message = str(err.value)
    assert "\n" not in message and "zeropipe_layer_keys" not in message
    assert "compile each stage instead" in message
    assert "[torch.compile(s) for s in zeropipe.split(model, n)]" in message


def test_uncompiled_reaches_the_original_module() -> None:
    plain = nn.Linear(2, 2)
    assert _compat.uncompiled(plain) is plain
    assert _compat.uncompiled(torch.compile(plain, backend="eager")) is plain
