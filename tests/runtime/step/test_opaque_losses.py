"""Losses whose items the pipeline cannot count: recognised where it can, refused where not.

``F.cross_entropy`` / ``F.nll_loss`` passed themselves are weighted by the
targets they count, like their modules, and give the whole batch's loss and
gradients even when a microbatch counts nothing.  Any other mean is weighted
by rows; where that is visibly wrong (integer targets holding -100, or a
microbatch's mean nan beside finite ones) it is refused in one line naming
the fix, and where it is exact it still runs.  See zeropipe.runtime.step.loss_contract.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, token_model
from tests.gradcheck import reference as whole_batch
from zeropipe import build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.pipeline import Pipeline

IGNORE = -100
UNEVEN = (11, 4)  # batch, microbatches: rows 3, 3, 3, 2


class ClassesFirst(nn.Module):
    """(batch, seq, classes) logits -> (batch, classes, seq), the layout F.cross_entropy reads."""

    def forward(self, z: Tensor) -> Tensor:
        return z.transpose(1, 2)


def classifier(log_probs: bool = False) -> nn.Sequential:
    tail: list[nn.Module] = [ClassesFirst()]
    if log_probs:  # what F.nll_loss expects
        tail.append(nn.LogSoftmax(dim=1))
    return nn.Sequential(*token_model(layers=4), *tail)


def padded(batch: int, pad: int = IGNORE) -> tuple[Tensor, Tensor]:
    """Tokens and labels padded with ``pad``: with UNEVEN, microbatch 0 counts nothing and
    the others count different numbers of labels."""
    x, y = batch_for(token_model(layers=2), batch=batch)
    y = y.clamp(min=1)  # no label equals a pad of 0 by chance
    y[:3] = pad
    y[4, 1:] = pad
    y[-1, 0] = pad
    return x, y


def exact(model: nn.Sequential, pipe_loss: Tensor, ref: tuple[Tensor, dict[str, Tensor]]) -> None:
    ref_loss, ref_grads = ref
    assert torch.isfinite(pipe_loss), "a microbatch that counts nothing must add 0, not nan"
    assert_same_loss(pipe_loss, ref_loss)
    assert abs(pipe_loss.item() - ref_loss.item()) <= 1e-12
    assert assert_same_gradients(model.named_parameters(), ref_grads) <= 1e-12


# -- item 1: F.cross_entropy / F.nll_loss passed themselves -------------------------------
FUNCTIONAL: dict[str, tuple[Callable[..., Tensor], bool, int]] = {
    "F.cross_entropy": (F.cross_entropy, False, IGNORE),
    "F.nll_loss": (F.nll_loss, True, IGNORE),
    "partial(F.cross_entropy, ignore_index=0, weight, label_smoothing)": (
        functools.partial(
            F.cross_entropy,
            ignore_index=0,
            weight=torch.linspace(0.5, 2.0, 11, dtype=torch.float64),
            label_smoothing=0.1,
        ),
        False,
        0,
    ),
}


@pytest.mark.parametrize("empty", [True, False], ids=["a microbatch all ignored", "none"])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
@pytest.mark.parametrize("which", sorted(FUNCTIONAL))
def test_a_functional_loss_with_ignored_labels_gives_the_whole_batch_loss_and_gradients(
    which: str, name: str, empty: bool
) -> None:
    # Was nan (microbatch 0's mean is 0/0), and without an empty microbatch gradients off by
    # 0.107: each microbatch's mean weighted by its rows, not by the labels it counts.
    loss_fn, log_probs, pad = FUNCTIONAL[which]
    model = classifier(log_probs)
    x, y = padded(UNEVEN[0], pad)
    if not empty:
        y[:3, 0] = 1
    ref = whole_batch(model, x, y, loss_fn, UNEVEN[1])
    pipe = Pipeline(model, build_schedule(name, ranks=2, microbatches=UNEVEN[1]), loss_fn=loss_fn)
    exact(model, pipe.step(x, y), ref)
    evaluated = pipe.eval_step(x, y)
    assert isinstance(evaluated, Tensor)
    assert_same_loss(evaluated, ref[0])


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_a_partial_with_the_deprecated_reduce_keyword_is_counted_as_its_module() -> None:
    # reduce= and size_average= are the module's keywords too: counted, so exact.
    model = classifier()
    x, y = padded(8)
    loss_fn = functools.partial(F.cross_entropy, reduce=True)
    ref = whole_batch(model, x, y, loss_fn, 2)
    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=loss_fn)
    exact(model, pipe.step(x, y), ref)


# -- item 2b: a mean weighted by rows, its integer targets holding -100 -------------------
def _lambda_lm(o: Tensor, t: Tensor) -> Tensor:
    return zeropipe.causal_lm_loss(o, t)


def test_a_wrapped_causal_lm_loss_with_ignored_labels_is_refused_in_one_line() -> None:
    # Was gradients off by 0.29: each microbatch's mean weighted by its rows.
    model = token_model(layers=4)
    x, y = batch_for(model, batch=11)
    y[:3, 2:] = IGNORE
    y[5, 1:] = IGNORE
    for loss_fn in (lambda o, t: zeropipe.causal_lm_loss(o, t), _lambda_lm):
        pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=loss_fn)
        for run in (pipe.step, pipe.eval_step):
            with pytest.raises(PipelineError) as err:
                run(x, y)
            message = str(err.value)
            assert "\n" not in message
            assert "-100" in message and "weighted by rows" in message
            assert "zeropipe.causal_lm_loss" in message and "loss_count=" in message
    assert all(p.grad is None for p in model.parameters()), "refused before any backward"
    # The fix the message names is exact.
    ref = whole_batch(model, x, y, zeropipe.causal_lm_loss, 4)
    pipe = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=zeropipe.causal_lm_loss
    )
    exact(model, pipe.step(x, y), ref)


def _token_mean(o: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1))


def test_means_that_rows_weigh_exactly_still_run() -> None:
    # Float targets, and integer targets without -100: every row counts as many items.
    model = mlp(layers=4)
    x, y = batch_for(model, batch=11)
    ref = whole_batch(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(
        model, build_schedule("zbv", ranks=2, microbatches=4), loss_fn=lambda o, t: F.mse_loss(o, t)
    )
    exact(model, pipe.step(x, y), ref)
    tokens = token_model(layers=4)
    x, y = batch_for(tokens, batch=11)
    ref = whole_batch(tokens, x, y, _token_mean, 4)
    pipe = Pipeline(tokens, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=_token_mean)
    exact(tokens, pipe.step(x, y), ref)
    # One microbatch and no replicas: its mean is the batch's, -100 or not.
    x, y = padded(8)
    y[0] = 1
    model = classifier()
    ref = whole_batch(model, x, y, F.cross_entropy, 1)
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=2, microbatches=1),
        loss_fn=lambda o, t: F.cross_entropy(o, t),
    )
    exact(model, pipe.step(x, y), ref)


# -- item 2a: a microbatch's mean nan beside finite ones ----------------------------------
def _ignoring_zero(o: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(o, t, ignore_index=0)  # a pad id the pipeline cannot know


def test_a_mean_over_no_items_beside_finite_ones_is_refused_in_one_line() -> None:
    # Was a step loss of nan (and nan gradients) where the whole batch's is finite.
    x, y = padded(UNEVEN[0], pad=0)
    assert torch.isfinite(_ignoring_zero(classifier()(x), y))
    pipe = Pipeline(
        classifier(),
        build_schedule("1f1b", ranks=2, microbatches=UNEVEN[1]),
        loss_fn=_ignoring_zero,
    )
    with pytest.raises(PipelineError) as err:
        pipe.eval_step(x, y)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("microbatch 0: loss_fn returned nan for a finite output")
    assert "microbatch 1's loss is finite" in message
    assert "loss_count=" in message and "zeropipe.causal_lm_loss" in message
    with pytest.raises(PipelineError, match=r"microbatch 0: loss_fn returned nan"):
        pipe.step(x, y)


def test_a_nan_the_whole_batch_shares_passes() -> None:
    # Every microbatch counting nothing: the whole batch's mean is nan too.
    x, y = padded(UNEVEN[0], pad=0)
    y[:] = 0
    pipe = Pipeline(
        classifier(), build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=_ignoring_zero
    )
    loss = pipe.eval_step(x, y)
    assert isinstance(loss, Tensor) and torch.isnan(loss)
    # A nan output (here from the input) is in the whole batch's mean as well.
    model = mlp(layers=2)
    x, y = batch_for(model, batch=8)
    x[0, 0] = float("nan")
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=2, microbatches=4),
        loss_fn=lambda o, t: F.mse_loss(o, t),
    )
    assert torch.isnan(pipe.step(x, y))


# -- item 3: causal_lm_loss's shapes ---------------------------------------------------
def test_causal_lm_loss_with_1d_labels_is_a_one_line_pipeline_error() -> None:
    # Was a raw IndexError from counting labels[:, 1:] before any logits existed.
    model = token_model(layers=4)
    x, y = batch_for(model, batch=8)
    pipe = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=zeropipe.causal_lm_loss
    )
    with pytest.raises(PipelineError) as err:
        pipe.step(x, y[:, 0])
    message = str(err.value)
    assert "\n" not in message
    assert "labels [batch, seq]" in message and "logits [batch, seq, vocab]" in message
    assert "[8]" in message or "[4]" in message  # the shape it got
    with pytest.raises(PipelineError, match=r"labels \[batch, seq\]"):
        zeropipe.causal_lm_loss.count(y[:, 0])


def test_a_masked_mean_over_float_targets_with_an_empty_microbatch_is_refused() -> None:
    """NaN marks missing regression targets; a microbatch with none left is a mean over no
    items, which the whole batch's mean skips: refused, as for labels, not a NaN loss."""

    def masked_mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        kept = ~torch.isnan(t)
        return F.mse_loss(o[kept], t[kept])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 10)).double()
    x = torch.randn(16, 6, dtype=torch.float64)
    y = torch.randn(16, 10, dtype=torch.float64)
    y[:4] = float("nan")  # microbatch 0 has no target left
    pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=masked_mse)
    with pytest.raises(PipelineError) as err:
        pipe.step(x, y)
    assert "\n" not in str(err.value) and "microbatch 0" in str(err.value)
    assert "loss_count=" in str(err.value)
