"""Input-first full backward: same gradients, input gradient sent from inside B, before param-only work."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import assert_same_gradients, batch_for, mlp, reference
from zeropipe import build_schedule
from zeropipe.autograd.priority import record_backward_order
from zeropipe.core.ir import Kind
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules.registry import generate
from zeropipe.runtime.parts import PLAIN_BELOW_BYTES
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions
from zeropipe.runtime.step.executor import LocalTransport
from zeropipe.runtime.step.handlers import backward_input_first


class SideBranch(nn.Module):
    """Output = lin(x) + scale.exp().sum(): the exp branch feeds only a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(64))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.scale.exp().sum()


def test_input_gradient_is_ready_before_parameter_only_work() -> None:
    torch.manual_seed(0)
    mod = SideBranch()
    x = torch.randn(4, 8, requires_grad=True)
    seen: list[str] = []

    def ready(grads: tuple[Tensor, ...]) -> None:
        seen.append("input ready")
        assert grads[0] is x.grad

    out = mod(x)
    with record_backward_order(out) as order:
        fired = backward_input_first([out], [torch.ones_like(out)], [x], ready)
    assert fired and seen == ["input ready"]
    names = [e.name for e in order.events]
    # the exp branch (parameter-only) now runs after the input's AddmmBackward
    assert names.index("ExpBackward0") > names.index("AddmmBackward0"), names


def test_pipeline_gradients_equal_and_sends_posted_early() -> None:
    model = mlp()
    x, y = batch_for(model, batch=8)
    _, ref = reference(model, x, y, F.mse_loss, 4)
    sent_during_backward: list[str] = []

    class Spy(LocalTransport):
        def send(self, action, tensors):  # type: ignore[no-untyped-def]
            if action.kind is Kind.SEND_B and _in_backward():
                sent_during_backward.append(str(action))
            super().send(action, tensors)

    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss)
    pipe.parts = replace(pipe.parts, transport=Spy())
    pipe.step(x, y)
    assert_same_gradients(model.named_parameters(), ref)
    assert sorted(sent_during_backward) == [f"1SEND_B{i}" for i in range(4)]
    assert Kind.RECV_B in pipe.last_waits

    model.zero_grad(set_to_none=True)
    sent_during_backward.clear()
    off = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss, options=RuntimeOptions(input_first=False))  # fmt: skip
    off.parts = replace(off.parts, transport=Spy())
    off.step(x, y)
    assert_same_gradients(model.named_parameters(), ref)
    assert sent_during_backward == []


def _in_backward() -> bool:
    import inspect

    return any(f.function == "backward_input_first" for f in inspect.stack())


@pytest.mark.parametrize(
    ("schedule", "width", "recording"),
    [
        ("1f1b", 8, [False, False]),  # small weights under B only: plain autograd
        ("1f1b", 160, [True, True]),  # 400 KiB weights: recorded, W fused into .grad
        ("recomputed 1f1b", 8, [False, False]),  # R, then a plain B
        ("zb-h1", 8, [True, True]),  # I and W need the split, whatever the size
    ],
)
def test_a_linear_records_for_split_backward_only_where_it_pays(
    schedule: str, width: int, recording: list[bool]
) -> None:
    model = mlp(layers=4, width=width)
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    assert all((w.numel() * w.element_size() >= PLAIN_BELOW_BYTES) == (width > 8) for w in weights)
    x, y = batch_for(model, batch=8)
    _, ref = reference(model, x, y, F.mse_loss, 4)
    named = checkpoint(generate("1f1b", 2, 4)) if schedule.startswith("recomputed") else schedule
    pipe = Pipeline(model, build_schedule(named, ranks=2, microbatches=4), loss_fn=F.mse_loss)
    # A recording linear keeps its class (prepare_split sets its forward on the instance).
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    recorded = [
        [m in (stage.linears or ()) for m in stage.module.modules() if isinstance(m, nn.Linear)]
        for _, stage in sorted(pipe.stages.items())
    ]
    assert recorded == [[rec] * len(lins) for lins, rec in zip(recorded, recording, strict=True)]
    assert [len(pipe.stages[s].linears or ()) > 0 for s in (0, 1)] == recording
    for _ in range(2):  # the second step accumulates into .grad
        pipe.step(x, y)
    assert_same_gradients(model.named_parameters(), {k: 2 * g for k, g in ref.items()})
