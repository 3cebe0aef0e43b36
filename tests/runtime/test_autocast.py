"""bf16 autocast with float32 parameters and gradients: ``RuntimeOptions(autocast=...)``.

The pipeline runs each stage's forward, its recompute and the loss under
``torch.autocast``, and every backward (B, I, W) outside it -- as torch
recommends, and as the reference (:func:`tests.gradcheck.reference` with
``autocast=``) does microbatch by microbatch.  CPU autocast supports bfloat16,
so this is checked here; tests/test_gpu.py repeats it on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import assert_same_loss, batch_for, mlp, reference
from zeropipe import Pipeline, build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.runtime.pipeline import RuntimeOptions

BF16 = RuntimeOptions(autocast=torch.bfloat16)


def assert_bf16_gradients(model: nn.Module, ref: dict[str, Tensor], split: bool) -> None:
    """float32 ``.grad`` equal to the reference: to float32 rounding, or to bf16 rounding.

    Microbatches' gradients are summed in the schedule's order, so float32
    rounding may differ.  A split backward (I, W) also computes each weight
    gradient as ``g^T @ x`` in bfloat16 where autograd computes ``(x^T @ g)^T``:
    the bf16 product of one microbatch is then rounded differently, by up to a
    unit in the last place of bf16 (2**-8 relative) per microbatch.
    """
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None, name
        assert p.grad.dtype == torch.float32, (name, p.grad.dtype)
        r = ref[name]
        if split:
            tol = 2**-7 * r.abs().max().item()
            assert (p.grad - r).abs().max().item() <= tol, name
        else:
            assert torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6), name


def splits(name: str) -> bool:
    sched = generate(name, 2, 4)
    return any(a.kind is Kind.I for acts in sched.actions for a in acts)


@pytest.mark.parametrize("name", sorted(n for n in GENERATORS if n != "auto"))
def test_every_schedule_under_bf16_autocast_matches_the_autocast_reference(name: str) -> None:
    model = mlp(layers=8, dtype=torch.float32)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4, autocast=torch.bfloat16)
    plain_loss, _ = reference(model, x, y, F.mse_loss, 4)
    assert ref_loss != plain_loss  # autocast changed the arithmetic: the check has teeth
    pipe = Pipeline(
        model, build_schedule(name, ranks=2, microbatches=4), loss_fn=F.mse_loss, options=BF16
    )
    model.zero_grad(set_to_none=True)
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_bf16_gradients(model, ref, split=splits(name))


def test_recompute_runs_under_autocast_too() -> None:
    # R redoes F: were it to run in float32, the recomputed graph would not be F's.
    model = mlp(layers=8, dtype=torch.float32)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4, autocast=torch.bfloat16)
    pipe = Pipeline(model, checkpoint(generate("1f1b", 2, 4)), loss_fn=F.mse_loss, options=BF16)
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert pipe.memory.report.recomputations > 0
    assert_bf16_gradients(model, ref, split=False)


def test_the_loss_runs_under_autocast_and_the_backward_outside() -> None:
    seen: dict[str, object] = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, t: Tensor) -> Tensor:
            seen["forward"] = torch.is_autocast_enabled("cpu")
            return t.clone()

        @staticmethod
        def backward(ctx: object, g: Tensor) -> Tensor:
            seen["backward"] = torch.is_autocast_enabled("cpu")
            return g

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        seen["loss"] = torch.is_autocast_enabled("cpu")
        seen["out"] = out.dtype
        return F.mse_loss(Probe.apply(out), target)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=loss_fn, options=BF16
    )
    loss = pipe.step(x, y)
    assert seen == {"loss": True, "out": torch.bfloat16, "forward": True, "backward": False}
    assert loss.dtype == torch.float32  # mse_loss is one autocast keeps in float32
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of the step


def test_only_bfloat16_is_accepted() -> None:
    with pytest.raises(PipelineError, match="GradScaler"):
        RuntimeOptions(autocast=torch.float16)
    with pytest.raises(PipelineError, match="bfloat16"):
        RuntimeOptions(autocast=torch.float32)
    with pytest.raises(PipelineError, match="bfloat16"):
        RuntimeOptions(autocast="bf16")  # type: ignore[arg-type]
