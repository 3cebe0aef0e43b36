"""Gradient hooks under every generator behave as torch runs them, microbatch by microbatch.

The reference is plain autograd on the same float64 model, each microbatch's loss
(weighted as the pipeline weights it) backpropagated on its own, in the order the
schedule backpropagates them (looped-bfs: last first).
Tensor hooks (``register_hook``, ``register_post_accumulate_grad_hook``) and module
full-backward hooks (pre and post) must be called as often, in the same order per hook,
with the same gradients (and ``.grad`` after each accumulation), and the gradients they
change must reach ``.grad`` changed.  Weights of 512 KiB (over ``PLAIN_BELOW_BYTES``,
recorded for split backward even under plain 1f1b) and of 32 KiB (small) both take part.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import assert_same_gradients
from zeropipe import build_schedule
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.parts import PLAIN_BELOW_BYTES
from zeropipe.runtime.pipeline import Pipeline

WIDTH, NARROW, BATCH, MICROBATCHES, BOUND = 256, 16, 8, 4, 1e-4
Log = dict[str, list[Any]]


class Layer(nn.Module):
    """x + up(tanh(down(tanh(big(x))))): one weight over 256 KiB, two small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(WIDTH, WIDTH)
        self.act = nn.Tanh()
        self.down = nn.Linear(WIDTH, NARROW)
        self.up = nn.Linear(NARROW, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.up(torch.tanh(self.down(self.act(self.big(x)))))


def _copy(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.detach().clone()


def _hooked_model(log: Log) -> nn.Sequential:
    """Four layers (one per stage of a V or interleaved schedule on 2 ranks), hooks logging."""
    torch.manual_seed(35)
    model = nn.Sequential(*(Layer() for _ in range(4))).double()

    def clamp(key: str) -> Callable[[Tensor], Tensor | None]:
        def hook(g: Tensor) -> Tensor | None:
            log.setdefault(key, []).append(_copy(g))
            return None if g is None else g.clamp(-BOUND, BOUND)

        return hook

    def accumulated(key: str) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            log.setdefault(key, []).append(_copy(p.grad))

        return hook

    def full(key: str, scale: float | None) -> Callable[..., tuple[Tensor | None, ...] | None]:
        def hook(
            module: nn.Module, grad_input: tuple[Tensor | None, ...], grad_output: Any
        ) -> tuple[Tensor | None, ...] | None:
            log.setdefault(key, []).append(([_copy(g) for g in grad_input], _copy(grad_output[0])))
            return (
                None
                if scale is None
                else tuple(None if g is None else g * scale for g in grad_input)
            )

        return hook

    def pre(key: str) -> Callable[..., tuple[Tensor, ...]]:
        def hook(module: nn.Module, grad_output: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            log.setdefault(key, []).append(_copy(grad_output[0]))
            return (2 * grad_output[0], *grad_output[1:])

        return hook

    l0, l1, l2, l3 = (model[k] for k in range(4))
    assert isinstance(l0, Layer) and isinstance(l1, Layer)
    assert isinstance(l2, Layer) and isinstance(l3, Layer)
    l0.big.weight.register_hook(clamp("0.big.weight hook"))
    l0.down.weight.register_post_accumulate_grad_hook(accumulated("0.down.weight post"))
    l1.big.weight.register_post_accumulate_grad_hook(accumulated("1.big.weight post"))
    l1.up.weight.register_hook(clamp("1.up.weight hook"))
    # Layer 2's weights have no hooks (deferred to W beside hooked ones); its modules do.
    l2.up.bias.register_hook(clamp("2.up.bias hook"))
    l2.big.register_full_backward_pre_hook(pre("2.big pre"))
    l2.act.register_full_backward_hook(full("2.act full", 0.5))
    l3.big.weight.register_hook(clamp("3.big.weight hook"))
    l3.big.weight.register_post_accumulate_grad_hook(accumulated("3.big.weight post"))
    l3.register_full_backward_hook(full("3 full", None))
    l0.register_full_backward_hook(full("0 full", None))  # its input needs no gradient
    return model


def _backward_order(schedule: Schedule) -> list[int]:
    """The order in which the schedule backpropagates microbatches, the same on every stage."""
    order: dict[int, list[int]] = {}
    for actions in schedule.actions:
        for a in actions:
            if a.kind in (Kind.B, Kind.I) and a.microbatch is not None:
                order.setdefault(a.stage, []).append(a.microbatch)
    orders = {tuple(o) for o in order.values()}
    assert len(orders) == 1, order  # else each stage would need its own reference
    return list(orders.pop())


def _reference(model: nn.Sequential, x: Tensor, y: Tensor, order: list[int]) -> dict[str, Tensor]:
    """Each microbatch's weighted loss backpropagated on its own, as torch users do."""
    xs, ys = x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES)
    with warnings.catch_warnings():
        # Layer 0's full-backward hook fires from its output: its input needs no gradient.
        warnings.simplefilter("ignore")
        for i in order:
            (F.mse_loss(model(xs[i]), ys[i]) * (len(xs[i]) / len(x))).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_log(got: Log, ref: Log) -> None:
    assert sorted(got) == sorted(ref)
    for key, calls in ref.items():
        assert len(got[key]) == len(calls) == MICROBATCHES, (key, len(got[key]), len(calls))
        for k, (a, b) in enumerate(zip(got[key], calls, strict=True)):
            _assert_same(a, b, f"{key}, call {k}")


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(b), where
        for u, v in zip(a, b, strict=True):
            _assert_same(u, v, where)
    elif b is None:
        assert a is None, f"{where}: got a tensor where torch gives None"
    else:
        assert a is not None, f"{where}: got None where torch gives a tensor"
        diff = (a - b).abs().max().item()
        assert diff <= 1e-10, f"{where}: max abs difference {diff:.3g}"


# Not dualpipe: it backpropagates each half of the batch through its own copy of every
# stage, the two halves in different orders, so no one torch order is its reference.
CASES = [(name, 1) for name in sorted(GENERATORS) if name not in ("auto", "dualpipe")] + [
    (name, 2) for name in ("zb-h1", "zbv", "interleaved-1f1b", "dualpipev", "1f1b")
]


@pytest.mark.parametrize(("name", "group_w"), CASES)
def test_hooks_run_as_torch_runs_them_per_microbatch(name: str, group_w: int) -> None:
    ref_log: Log = {}
    ref_model = _hooked_model(ref_log)
    big = ref_model.get_parameter("0.big.weight")
    assert big.numel() * big.element_size() >= PLAIN_BELOW_BYTES  # recorded even under B
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    schedule = build_schedule(name, ranks=2, microbatches=MICROBATCHES, group_w=group_w)
    ref = _reference(ref_model, x, y, _backward_order(schedule))  # looped-bfs: 3, 2, 1, 0
    # The clamps bite: torch's unclamped gradients exceed the bound.
    assert max(t.abs().max().item() for t in ref_log["0.big.weight hook"]) > 10 * BOUND

    log: Log = {}
    model = _hooked_model(log)
    classes = [type(m) for m in model.modules()]
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hooked weights say that they are not deferred
        pipe.step(x, y)
    _assert_same_log(log, ref_log)
    assert_same_gradients(model.named_parameters(), ref)
    assert [type(m) for m in model.modules()] == classes  # no module changed class


def test_a_hooked_weight_is_named_once_in_a_warning() -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()
    model.get_parameter("2.weight").register_hook(lambda g: g)
    pipe = Pipeline(model, build_schedule("1f1b", ranks=1, microbatches=2), loss_fn=F.mse_loss)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x, x)
        pipe.step(x, x)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "linear '2' of stage 0" in texts[0], texts
    assert "\n" not in texts[0]


def test_module_classes_are_kept_under_zbv() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), MyLinear(8, 8)) for _ in range(4))
    ).double()
    before = [(type(m), sorted(m.__dict__)) for m in model.modules()]
    pipe = Pipeline(model, build_schedule("zbv", ranks=2, microbatches=4), loss_fn=F.mse_loss)
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe.step(x, x)
    assert [type(m) for m in model.modules()] == [t for t, _ in before]
    assert all(type(m) is nn.Linear for m in model.modules() if m._get_name() == "Linear")
    assert all(isinstance(m, MyLinear) for m in model.modules() if m._get_name() == "MyLinear")
    assert "_SplitLinear" not in repr(copy.deepcopy(model))
