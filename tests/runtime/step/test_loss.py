"""The step's loss and gradients equal the whole batch's, whatever loss_fn counts and reduces.

Each microbatch's loss is computed on its own; these tests pin how they are
combined (zeropipe.runtime.step.loss_contract): torch loss modules by the items their mean
counts (ignored targets excluded, class weights summed), sums by 1,
``(loss_sum, count)`` by ``loss_count``, plain functions by rows -- against
the model run on the whole batch without a pipeline (tests/gradcheck.py), in
float64, over several schedules and uneven microbatch sizes, in one process
and over gloo with two ranks.  What cannot be made exact is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import (
    assert_same_gradients,
    assert_same_loss,
    batch_for,
    mlp,
    no_crash,
    reference,
    token_model,
)
from tests.runtime import dist_cases
from zeropipe import build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

IGNORE = -100  # torch's default ignore_index: padding
SCHEDULES = ("1f1b", "zbv", "interleaved-1f1b", "gpipe")
UNEVEN = (11, 4)  # batch, microbatches: rows 3, 3, 3, 2


class ClassesFirst(nn.Module):
    """(batch, seq, classes) logits -> (batch, classes, seq), the layout nn.CrossEntropyLoss reads."""

    def forward(self, z: Tensor) -> Tensor:
        return z.transpose(1, 2)


def lm_model(layers: int = 6, log_probs: bool = False) -> nn.Sequential:
    """A tied-embedding token model (float64, no dropout) whose logits put classes on dim 1."""
    tail: list[nn.Module] = [ClassesFirst()]
    if log_probs:  # what nn.NLLLoss expects
        tail.append(nn.LogSoftmax(dim=1))
    return nn.Sequential(*token_model(layers=layers), *tail)


def padded(batch: int, seq: int = 3, vocab: int = 11) -> tuple[Tensor, Tensor]:
    """Token inputs and targets, some padded with IGNORE; the first three rows entirely,
    so with UNEVEN the first microbatch counts nothing at all."""
    x, y = batch_for(token_model(layers=2, vocab=vocab), batch=batch, seq=seq)
    y = y.clone()
    y[:3] = IGNORE
    y[4, 1:] = IGNORE
    y[-1, 0] = IGNORE
    return x, y


def summed_lm_loss(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The (loss_sum, count) form: cross-entropy summed over the tokens that count."""
    return F.cross_entropy(logits, target, reduction="sum"), (target != IGNORE).sum()


def lm_count(target: Tensor) -> Tensor:
    return (target != IGNORE).sum()


def _mean_of_summed(logits: Tensor, target: Tensor) -> Tensor:
    total, count = summed_lm_loss(logits, target)
    return total / count


@dataclass(frozen=True)
class Case:
    """A model, a batch, the pipeline's loss_fn, and the whole-batch loss it must equal."""

    model: Callable[[], nn.Sequential]
    batch: Callable[[int], tuple[Tensor, Tensor]]
    loss_fn: Callable[..., Any]
    whole: Callable[[Tensor, Tensor], Tensor]  # the loss of the whole batch, as a scalar
    loss_count: Callable[[Tensor], Any] | None = None


def _floats(batch: int) -> tuple[Tensor, Tensor]:
    return batch_for(mlp(layers=2), batch=batch)


_WEIGHTS = torch.linspace(0.5, 2.0, 11, dtype=torch.float64)
_CE = nn.CrossEntropyLoss(weight=_WEIGHTS, label_smoothing=0.1)
_MSE_SUM = nn.MSELoss(reduction="sum")
_L1 = nn.L1Loss()
_NLL = nn.NLLLoss(weight=_WEIGHTS)
CASES = {
    "cross-entropy(weight, label_smoothing, ignore_index)": Case(lm_model, padded, _CE, _CE),
    "nll(weight, ignore_index)": Case(lambda: lm_model(log_probs=True), padded, _NLL, _NLL),
    "mse(sum)": Case(lambda: mlp(layers=4), _floats, _MSE_SUM, _MSE_SUM),
    "l1(mean)": Case(lambda: mlp(layers=4), _floats, _L1, _L1),
    "(loss_sum, count)": Case(lm_model, padded, summed_lm_loss, _mean_of_summed, lm_count),
}


def _run(
    case: Case, name: str, batch: int, m: int, *, eval_too: bool = False
) -> tuple[Tensor, Tensor, nn.Sequential, dict[str, Tensor], Tensor | None]:
    model = case.model()
    x, y = case.batch(batch)
    ref_loss, ref = reference(model, x, y, case.whole, m)
    pipe = Pipeline(
        model,
        build_schedule(name, ranks=2, microbatches=m),
        loss_fn=case.loss_fn,
        loss_count=case.loss_count,
    )
    loss = pipe.step(x, y)
    evaluated = pipe.eval_step(x, y) if eval_too else None
    assert evaluated is None or isinstance(evaluated, Tensor)
    return loss, ref_loss, model, ref, evaluated


# -- the reproductions ------------------------------------------------------------------
def test_sum_reduced_mse_is_the_whole_batch_sum_not_the_mean_of_microbatch_sums() -> None:
    model = mlp(layers=4)
    x, y = batch_for(model, batch=8)
    loss_fn = nn.MSELoss(reduction="sum")
    ref_loss, ref = reference(model, x, y, loss_fn, 4)
    loss = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=loss_fn).step(
        x, y
    )
    assert_same_loss(loss, ref_loss)  # was a quarter of it (each sum weighted by 2/8)
    assert_same_gradients(model.named_parameters(), ref)


def test_cross_entropy_with_ignored_targets_weights_microbatches_by_the_targets_counted() -> None:
    model = lm_model()
    x, y = padded(8)  # microbatch 0 counts 3 targets of 12 (padding), microbatch 1 counts 9
    loss_fn = nn.CrossEntropyLoss()
    ref_loss, ref = reference(model, x, y, loss_fn, 2)
    loss = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=loss_fn).step(
        x, y
    )
    assert_same_loss(loss, ref_loss)  # rows-weighted, it was the mean of the two means
    assert_same_gradients(model.named_parameters(), ref)


@pytest.mark.parametrize("which", ["input", "target"])
def test_a_0_dimensional_input_or_target_is_a_one_line_pipeline_error(which: str) -> None:
    model = mlp(layers=2)
    x, y = batch_for(model, batch=4)
    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=F.mse_loss)
    args = (torch.tensor(1.0, dtype=torch.float64), y) if which == "input" else (x, y.sum())
    with pytest.raises(PipelineError) as err:
        pipe.step(*args)
    message = str(err.value)
    assert f"the {which} is 0-dimensional" in message and "reshape(1)" in message
    assert "\n" not in message


# -- equality over schedules and uneven microbatches ------------------------------------
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_every_loss_kind_gives_the_whole_batch_loss_and_gradients(
    name: str, case_name: str
) -> None:
    batch, m = UNEVEN
    loss, ref_loss, model, ref, evaluated = _run(CASES[case_name], name, batch, m, eval_too=True)
    assert torch.isfinite(loss), "a microbatch that counts nothing must add 0, not nan"
    assert_same_loss(loss, ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    assert evaluated is not None
    assert_same_loss(evaluated, ref_loss)  # eval_step normalises the same way


def test_unpadded_cross_entropy_module_and_function_agree_with_each_other_and_the_batch() -> None:
    model = lm_model()
    x, y = batch_for(token_model(layers=2), batch=11)
    ref_loss, _ = reference(model, x, y, nn.CrossEntropyLoss(), 4)
    by_module = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=nn.CrossEntropyLoss()
    ).eval_step(x, y)
    by_rows = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.cross_entropy
    ).eval_step(x, y)
    assert isinstance(by_module, Tensor) and isinstance(by_rows, Tensor)
    assert_same_loss(by_module, ref_loss)
    assert_same_loss(by_rows, ref_loss)  # every row counts seq targets: rows are exact


def _ignoring_zero(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target, ignore_index=0)  # a pad the pipeline cannot see


def test_a_plain_function_is_weighted_by_rows_as_documented() -> None:
    # F.cross_entropy itself is now counted like its module, and -100 in a function's targets
    # is refused (tests/runtime/step/test_opaque_losses.py); a pad of 0 is not seen.  With every
    # microbatch counting something: rows-weighted means, not the batch's.
    model = lm_model()
    x, y = padded(11)
    y = torch.where(y == IGNORE, 0, y.clamp(min=1))
    y[:3] = 1
    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=_ignoring_zero)
    loss = pipe.eval_step(x, y)
    with torch.no_grad():
        out = model(x)
    parts = zip(torch.tensor_split(out, 4), torch.tensor_split(y, 4), strict=True)
    expected = sum(len(t) / 11 * _ignoring_zero(o, t) for o, t in parts)
    assert isinstance(loss, Tensor)
    assert abs(loss.item() - float(expected)) <= 1e-12
    assert abs(loss.item() - _ignoring_zero(out, y).item()) > 1e-3


def test_a_second_step_accumulates_like_two_backward_calls() -> None:
    model = lm_model()
    x, y = padded(11)
    _, ref = reference(model, x, y, nn.CrossEntropyLoss(), 4)
    pipe = Pipeline(
        model, build_schedule("zbv", ranks=2, microbatches=4), loss_fn=nn.CrossEntropyLoss()
    )
    pipe.step(x, y)
    pipe.step(x, y)
    assert_same_gradients(model.named_parameters(), {n: 2 * g for n, g in ref.items()})


def test_a_batch_that_counts_nothing_is_nan_like_the_whole_batch() -> None:
    model = lm_model()
    x, y = padded(8)
    y[:] = IGNORE
    whole = nn.CrossEntropyLoss()(model(x), y)
    loss = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=nn.CrossEntropyLoss()
    ).step(x, y)
    assert torch.isnan(whole) and torch.isnan(loss)


# -- the (loss_sum, count) contract ------------------------------------------------------
def test_a_count_that_disagrees_with_loss_count_is_refused() -> None:
    x, y = padded(8)

    def miscounted(logits: Tensor, target: Tensor) -> tuple[Tensor, int]:
        return F.cross_entropy(logits, target, reduction="sum"), target.numel()

    pipe = Pipeline(
        lm_model(),
        build_schedule("1f1b", ranks=2, microbatches=2),
        loss_fn=miscounted,
        loss_count=lm_count,
    )
    with pytest.raises(PipelineError, match=r"microbatch 0: loss_fn counted 12 .* says 3"):
        pipe.step(x, y)


def test_a_tuple_without_loss_count_is_refused_and_says_what_to_pass() -> None:
    x, y = padded(8)
    pipe = Pipeline(
        lm_model(), build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=summed_lm_loss
    )
    with pytest.raises(PipelineError, match=r"needs Pipeline\(loss_count=fn\)"):
        pipe.step(x, y)


def test_loss_count_with_a_scalar_loss_is_refused() -> None:
    x, y = padded(8)
    pipe = Pipeline(
        lm_model(),
        build_schedule("1f1b", ranks=2, microbatches=2),
        loss_fn=F.cross_entropy,
        loss_count=lm_count,
    )
    with pytest.raises(PipelineError, match=r"must return \(loss_sum, count\)"):
        pipe.step(x, y)


# -- refusals -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loss_fn", "loss_count", "says"),
    [
        (nn.MSELoss(reduction="none"), None, r"MSELoss\(reduction='none'\) returns one loss per"),
        (nn.CrossEntropyLoss(reduction="none"), None, r"use reduction='mean' or 'sum'"),
        (nn.MultiMarginLoss(), None, r"cannot tell what this loss's mean divides by"),
        (nn.CrossEntropyLoss(), lm_count, r"drop loss_count="),
        (nn.MSELoss(reduction="batchmean"), None, r"KLDivLoss's only"),
    ],
)
def test_what_cannot_be_exact_is_refused_when_the_pipeline_is_built(
    loss_fn: nn.Module, loss_count: Callable[[Tensor], Any] | None, says: str
) -> None:
    with pytest.raises(PipelineError, match=says):
        Pipeline(
            mlp(layers=2),
            build_schedule("1f1b", ranks=2, microbatches=2),
            loss_fn=loss_fn,
            loss_count=loss_count,
        )


def test_a_subclass_of_a_known_loss_is_not_assumed_to_count_like_it() -> None:
    class Scaled(nn.CrossEntropyLoss):
        def forward(self, logits: Tensor, target: Tensor) -> Tensor:
            return 2 * super().forward(logits, target)

    with pytest.raises(PipelineError, match=r"Scaled\(reduction='mean'\)"):
        Pipeline(lm_model(), build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=Scaled())


@pytest.mark.filterwarnings("ignore:Using a target size")  # torch warns of broadcasting
@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), nn.L1Loss()], ids=["mse", "l1"])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_target_broadcast_over_the_outputs_columns_gives_the_whole_batch_gradients(
    name: str, loss_fn: nn.Module
) -> None:
    # Output (11, 8), target (11, 1): the mean covers 11 x 8 elements, 8 per target element,
    # in uneven microbatches (3, 3, 3, 2 rows).  It was refused as mixing microbatches' rows.
    model = mlp(layers=4)
    x, _ = batch_for(model, batch=11)
    y = torch.randn(11, 1, dtype=torch.float64)
    ref_loss, ref = reference(model, x, y, loss_fn, 4)
    pipe = Pipeline(model, build_schedule(name, ranks=2, microbatches=4), loss_fn=loss_fn)
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_an_elementwise_loss_whose_target_broadcasts_across_rows_is_refused() -> None:
    # The classic slip: a target of shape (batch,) for an output of (batch, n).  Per
    # microbatch, (8,) against (8, 8) broadcasts to (8, 8) along the columns: every row's
    # output meets every row's target.  The whole batch's loss would mix microbatches' rows.
    model = mlp(layers=2)
    x, _ = batch_for(model, batch=16)
    y = torch.randn(16, dtype=torch.float64)
    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=nn.MSELoss())
    with pytest.raises(PipelineError, match=r"mixes rows of different microbatches") as err:
        pipe.step(x, y)
    message = str(err.value)
    assert "output [8, 8] and target [8]" in message and "one row per output row" in message
    assert len(message.splitlines()) == 1


def test_a_target_class_outside_the_class_weights_is_a_pipeline_error() -> None:
    x, y = padded(8)
    y[5, 0] = 11  # the vocabulary (and the weights) has 11 classes: 0..10
    pipe = Pipeline(lm_model(), build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=_CE)
    with pytest.raises(PipelineError, match=r"microbatch 1: CrossEntropyLoss: target classes"):
        pipe.step(x, y)


# -- two ranks over gloo ------------------------------------------------------------------
DIST_CASES = (
    "cross-entropy(weight, label_smoothing, ignore_index)",
    "mse(sum)",
    "(loss_sum, count)",
)


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Inside each rank: loss and owned gradients per (schedule, case); then a refused count.

    It runs in the 2-rank launch the distributed tests share (tests/runtime/dist_cases.py),
    among its failure cases: the two refusals end only their own pipelines."""
    out: dict[str, Any] = {}
    batch, m = UNEVEN
    options = RuntimeOptions(timeout=30.0)
    for name in ("1f1b", "zbv"):
        for case_name in DIST_CASES:
            case = CASES[case_name]
            model = case.model()
            x, y = case.batch(batch)
            pipe = Pipeline(
                model,
                name,
                loss_fn=case.loss_fn,
                microbatches=m,
                loss_count=case.loss_count,
                options=options,
            )
            loss = pipe.step(x, y)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            out[f"{name}/{case_name}"] = {"loss": loss.item(), "grads": grads}
    x, y = padded(batch)
    wrong = Pipeline(
        lm_model(),
        "1f1b",
        loss_fn=summed_lm_loss,
        microbatches=m,
        loss_count=lambda t: t.numel(),
        options=RuntimeOptions(timeout=10.0),
    )
    try:
        wrong.step(x, y)
        out["refused"] = None
    except PipelineError as exc:
        out["refused"] = str(exc)
    # A scalar loss_fn returning a sum: only the last stage's rank computes (and probes) it.
    summed = Pipeline(
        lm_model(),
        "1f1b",
        loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="sum"),
        microbatches=m,
        options=RuntimeOptions(timeout=10.0),
    )
    try:
        summed.step(*batch_for(token_model(layers=2, vocab=11), batch=batch, seq=3))
        out["sum_refused"] = None
    except PipelineError as exc:
        out["sum_refused"] = str(exc)
    return out


def test_two_ranks_over_gloo_give_the_whole_batch_loss_and_gradients() -> None:
    results = [out["loss"] for out in dist_cases.main_results(2)]
    for rank, out in enumerate(results):
        no_crash(out, f"the loss cases on rank {rank}")
    batch, m = UNEVEN
    for name in ("1f1b", "zbv"):
        for case_name in DIST_CASES:
            case = CASES[case_name]
            model = case.model()
            x, y = case.batch(batch)
            ref_loss, ref = reference(model, x, y, case.whole, m)
            key = f"{name}/{case_name}"
            losses = [r[key]["loss"] for r in results]
            assert losses[0] == losses[1], (key, losses)  # the loss reaches every rank
            assert abs(losses[0] - ref_loss.item()) <= 1e-10, (key, losses[0], ref_loss.item())
            seen: set[str] = set()
            for r in results:
                params = []
                for n, g in r[key]["grads"].items():
                    p = nn.Parameter(torch.empty_like(g))
                    p.grad = g
                    params.append((n, p))
                assert_same_gradients(params, ref, only_owned=True)
                seen |= set(r[key]["grads"])
            assert seen == set(dict(model.named_parameters())), key
    # The last stage's rank finds the miscount; the other rank ends with its message too.
    for r in results:
        assert r["refused"] is not None and "loss_fn counted" in r["refused"], r["refused"]
        refused = r["sum_refused"]
        assert refused is not None and "returns a sum over its microbatch's rows" in refused
