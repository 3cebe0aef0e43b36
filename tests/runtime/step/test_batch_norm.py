"""Deferred BatchNorm: a pipelined step moves running statistics once, as a whole-batch forward.

The reference for the running statistics is one ``nn.BatchNorm`` forward, from
the step's starting statistics, on every row the step fed that BatchNorm (the
first BatchNorm sees the batch's own rows, so it is also the whole-batch
model's).  The reference for the loss and gradients is the plain model run
microbatch by microbatch: in training each microbatch is normalised by its
own statistics, deferred or not.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import no_crash
from tests.runtime import dist_cases
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.passes.fit import checkpoint
from zeropipe.core.schedules import generate
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.runtime.step.batch_norm import DeferredBatchNorm, deferred_batch_norm

M = 4  # microbatches
STEPS = 2
BN = (nn.BatchNorm1d, nn.BatchNorm2d)
STATS = ("running_mean", "running_var", "num_batches_tracked")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 12),
        nn.Unflatten(1, (2, 2, 3)),
        nn.BatchNorm2d(2),  # first: sees the batch's own rows
        nn.Flatten(),
        nn.Tanh(),
        nn.Linear(12, 6),
        nn.BatchNorm1d(6, momentum=None),  # cumulative average: reads num_batches_tracked
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=0.3, eps=1e-3),
        nn.Linear(6, 3),
    ).double()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    # Rows far from zero: statistics merged as sums of x and x^2 would lose digits here.
    x = torch.randn(4 * M + 2, 4, dtype=torch.float64, generator=g) * 3 + 50
    return x, torch.randn(4 * M + 2, 3, dtype=torch.float64, generator=g)


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


Run = list[tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]]


def _reference() -> Run:
    """Per step: loss, buffers, gradients of the plain model run microbatch by microbatch,
    its running statistics then set to one forward's on all the step's rows."""
    model = _model()
    norms = {n: m for n, m in model.named_modules() if isinstance(m, BN)}
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        start = {n: copy.deepcopy(m) for n, m in norms.items()}
        rows: dict[str, list[Tensor]] = {n: [] for n in norms}
        hooks = [
            m.register_forward_pre_hook(lambda _, args, seen=rows[n]: seen.append(args[0].detach()))
            for n, m in norms.items()
        ]
        model.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64)
        for xi, yi in zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True):
            part = F.mse_loss(model(xi), yi) * (len(xi) / len(x))
            part.backward()
            loss += part.detach()
        for h in hooks:
            h.remove()
        for n, whole in start.items():
            whole(torch.cat(rows[n]))  # one nn.BatchNorm forward on the step's rows
            for buf in STATS:
                getattr(norms[n], buf).copy_(getattr(whole, buf))
        out.append((loss, _buffers(model), _grads(model)))
    return out


def _pipelined(schedule: Schedule, model: nn.Module | None = None) -> Run:
    model = deferred_batch_norm(_model()) if model is None else model
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        out.append((loss.detach(), _buffers(model), _grads(model)))
    return out


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=0, atol=1e-12, msg=f"{what}: {n}")


def _schedules() -> dict[str, Schedule]:
    return {
        "1f1b": generate("1f1b", 2, M),
        "zbv": generate("zbv", 2, M),  # split backward: I and W
        "1f1b+R": checkpoint(generate("1f1b", 2, M)),
        "zbv+R": checkpoint(generate("zbv", 2, M)),
    }


@pytest.mark.parametrize("name", sorted(_schedules()))
def test_step_updates_running_statistics_once_as_one_whole_batch_forward(name: str) -> None:
    schedule = _schedules()[name]
    if name.endswith("+R"):  # every forward is run twice: recomputation must not count
        assert sum(a.kind is Kind.R for acts in schedule.actions for a in acts) == (
            schedule.num_stages * M
        )
    ref = _reference()
    got = _pipelined(schedule)
    whole = _model()  # the first BatchNorm's rows are the batch's: the whole-batch model's
    for step, ((want_loss, want_bufs, want_grads), (loss, bufs, grads)) in enumerate(
        zip(ref, got, strict=True)
    ):
        where = f"{name}, step {step}"
        assert bufs["6.num_batches_tracked"].item() == step + 1, where
        _assert_same(bufs, want_bufs, where)
        _assert_same(grads, want_grads, where)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12, msg=where)
        whole(_batch(step)[0])
        for buf in STATS:
            torch.testing.assert_close(
                bufs[f"2.{buf}"], getattr(whole[2], buf), rtol=0, atol=1e-12, msg=where
            )


def test_plain_batch_norm_counts_every_microbatch_and_warns_once() -> None:
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _pipelined(generate("1f1b", 2, M), model)
    said = [w for w in caught if "BatchNorm" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "deferred_batch_norm" in str(said[0].message)
    assert said[0].filename == __file__  # points at the code that built the pipeline
    assert got[-1][1]["6.num_batches_tracked"].item() == M * STEPS


def test_no_warning_for_deferred_or_eval_mode_batch_norm() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipeline(deferred_batch_norm(_model()), generate("1f1b", 2, M), loss_fn=F.mse_loss)
        Pipeline(_model().eval(), generate("1f1b", 2, M), loss_fn=F.mse_loss)


def test_eval_step_normalises_by_running_statistics_and_records_nothing() -> None:
    model = deferred_batch_norm(_model())
    pipe = Pipeline(model, generate("zbv", 2, M), loss_fn=F.mse_loss)
    x, y = _batch(0)
    pipe.step(x, y)
    model.eval()
    before = _buffers(model)
    loss = pipe.eval_step(x, y)
    out = pipe.eval_step(x)
    _assert_same(_buffers(model), before, "after eval_step")
    plain = _model()
    plain.load_state_dict(model.state_dict())  # the same keys: a plain model loads them
    plain.eval()
    with torch.no_grad():
        want = plain(x)
    assert isinstance(out, Tensor) and isinstance(loss, Tensor)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, F.mse_loss(want, y), rtol=0, atol=1e-12)
    # In training mode a forward-only step is one batch too: one update, not one per microbatch.
    model.train()
    pipe.eval_step(x)
    assert model[6].num_batches_tracked.item() == 2


def test_failed_step_leaves_running_statistics_and_stops_deferring() -> None:
    model = deferred_batch_norm(_model())

    def failing(out: Tensor, target: Tensor) -> Tensor:
        raise ValueError("loss failed")

    pipe = Pipeline(model, generate("1f1b", 2, M), loss_fn=failing)
    before = _buffers(model)
    with pytest.raises(PipelineError, match="loss failed"):
        pipe.step(*_batch(0))
    _assert_same(_buffers(model), before, "after the failed step")
    norm = model[6]
    assert isinstance(norm, DeferredBatchNorm) and norm.pending is None
    model(_batch(0)[0])  # outside a step again: updates at once
    assert norm.num_batches_tracked.item() == 1


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 5), (6, 3, 2, 2), (6, 3, 2, 1, 2)])
def test_outside_a_pipeline_it_is_an_ordinary_batch_norm(
    shape: tuple[int, ...], momentum: float | None
) -> None:
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    plain = cls(3, momentum=momentum).double()
    deferred = deferred_batch_norm(copy.deepcopy(plain))
    assert isinstance(deferred, DeferredBatchNorm)
    g = torch.Generator().manual_seed(0)
    for train in (True, True, False):
        plain.train(train)
        deferred.train(train)
        x = torch.randn(shape, dtype=torch.float64, generator=g) + 2
        torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=1e-12)
        _assert_same(_buffers(deferred), _buffers(plain), f"training={train}")


def test_converter_keeps_tensors_and_settings_and_leaves_what_it_cannot_defer() -> None:
    class Mine(nn.BatchNorm1d):
        pass

    shared = nn.BatchNorm1d(4, eps=1e-3, momentum=None, affine=False)
    model = nn.Sequential(
        nn.Sequential(nn.BatchNorm2d(3, momentum=0.2), shared),
        shared,
        nn.BatchNorm3d(2).eval(),
        nn.BatchNorm1d(4, track_running_stats=False),
        Mine(4),
        nn.LayerNorm(4),
    )
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    keys = set(model.state_dict())
    assert deferred_batch_norm(model) is model
    inner = model[0]
    assert isinstance(inner, nn.Sequential)
    first, second = inner[0], inner[1]
    assert isinstance(first, DeferredBatchNorm) and first.momentum == 0.2 and first.dims == (4,)
    assert isinstance(second, DeferredBatchNorm) and model[1] is second
    assert (second.eps, second.momentum, second.affine, second.weight) == (1e-3, None, False, None)
    assert isinstance(model[2], DeferredBatchNorm) and not model[2].training
    assert type(model[3]) is nn.BatchNorm1d and type(model[4]) is Mine
    assert set(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert isinstance(deferred_batch_norm(nn.BatchNorm1d(2)), DeferredBatchNorm)  # itself
    with pytest.raises(PipelineError, match="expects 4-D input, got 2-D"):
        first(torch.randn(5, 3))
    with pytest.raises(PipelineError, match="track_running_stats=False"):
        DeferredBatchNorm.from_batch_norm(model[3])


def test_public_names() -> None:
    assert zeropipe.DeferredBatchNorm is DeferredBatchNorm
    assert zeropipe.deferred_batch_norm is deferred_batch_norm


# -- two processes over gloo ----------------------------------------------------------------


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Each schedule's buffers of the stages this rank runs, after STEPS steps (in the 2-rank
    launch the distributed tests share: tests/runtime/dist_cases.py)."""
    out: dict[str, Any] = {}
    for name in ("1f1b", "zbv+R"):
        model = deferred_batch_norm(_model())
        pipe = Pipeline(model, _schedules()[name], loss_fn=F.mse_loss)
        for step in range(STEPS):
            pipe.step(*_batch(step))
        mine = {id(b) for stage in pipe.stages.values() for b in stage.module.buffers()}
        out[name] = {n: b.clone() for n, b in model.named_buffers() if id(b) in mine}
    return out


def test_two_processes_keep_the_whole_batch_statistics() -> None:
    results = [out["batch_norm"] for out in dist_cases.main_results(2)]
    for rank, out in enumerate(results):
        no_crash(out, f"the BatchNorm steps on rank {rank}")
    want = _reference()[-1][1]
    for name in ("1f1b", "zbv+R"):
        got = {n: b for out in results for n, b in out[name].items()}
        assert all(out[name] for out in results), f"{name}: a rank runs no BatchNorm"
        _assert_same(got, want, f"{name} on 2 ranks")
