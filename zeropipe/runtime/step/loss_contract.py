"""A step's loss normalised so that it, and its gradients, equal those of the whole batch.

It holds one concept, how microbatch losses are weighted.  The batch is cut
into microbatches and each one's loss is computed on its own on the last stage.
The step's loss is ``sum_i w_i * loss_i`` and the last stage's backward of
microbatch ``i`` is seeded with ``w_i``, so ``w_i`` must be known before the
first backward -- that is, from the targets, before the step runs (every rank
receives the whole batch, so the last stage's rank can).
What ``loss_i`` and ``w_i`` are depends on the kind of ``loss_fn``::

    loss_fn                                   loss_i                   w_i
    torch loss module, reduction="mean"       the module's sum         1 / items in the batch
    torch loss module, reduction="sum"        the module's sum         1
    F.cross_entropy, F.nll_loss itself        as its module (nn.CrossEntropyLoss(), ...)
      (or a functools.partial of keywords
      its module takes)
    any module with reduction="sum"           its sum                  1
    function -> (loss_sum, count)             loss_sum                 1 / sum_j loss_count(target_j)
      with Pipeline(loss_count=...)
    function -> scalar (a mean)               its mean                 rows_i / rows in the batch
    a mean that knows its own count           its sum_and_count        1 / sum_j its count(target_j)
      (``sum_and_count`` and ``count`` methods,
      e.g. zeropipe.causal_lm_loss)

A third element, ``(loss_sum, count, term)``, adds ``term / microbatches`` (a router loss, a
mean over the global batch's microbatches, summed over data-parallel replicas like the count).

"Items" are what the module's mean divides by: the targets not equal to
``ignore_index`` (their class-weight sum with ``weight=``) for
``CrossEntropyLoss`` / ``NLLLoss``, the elements for the element-wise losses,
the rows for ``KLDivLoss(reduction="batchmean")``.  Calling the module with
``reduction="sum"`` instead of multiplying its mean back up keeps a
microbatch whose targets are all ignored at 0 (its mean is 0/0 = nan).

An element-wise loss's target may broadcast over the output's non-batch dims
(output ``[8, 4]``, target ``[8, 1]``): its mean then divides by the broadcast
shape's elements, 4 for each of the target's, which the weights (taken from
the targets, before the output exists) cannot see.  Each microbatch's sum is
divided by that spread instead -- the same for every microbatch, since it
depends on the non-batch dims only -- which is exact.  A target whose rows are
not the output's rows (``[1, 4]`` or ``[4]`` against ``[8, 4]``) would mix rows
of different microbatches and is refused.

A mean weighted by rows (any other function returning a scalar) is exact only
when every row counts the same number of items.  Two signs that they do not
are refused with a :class:`PipelineError` naming ``loss_count=`` and
``zeropipe.causal_lm_loss``: integer targets holding -100 (the ignore_index
of torch's losses and Hugging Face's labels) when the batch is cut into
several microbatches or replicas, at the first microbatch's loss, before any
backward; and a microbatch whose loss is nan although its output is finite (a
mean over no items, 0/0) beside one whose loss is finite -- the whole batch's
mean would be finite.  Every
microbatch nan is the whole batch's nan, and passes.  Other ignored targets
(another ignore_index, a mask) that leave every microbatch something to count
cannot be seen, and are weighted by rows.  A scalar that is a *sum* over the
microbatch's rows would be weighted as a mean, the step scaled by the rows: the
first microbatch of two rows or more is probed (:meth:`LossContract.probe_mean`,
``loss_fn`` on each half of the rows, without grad, the RNG state restored), a
microbatch of one row with the next one (``loss_fn`` once on the two concatenated,
:meth:`LossContract.probe_pair`), and a sum is refused, naming the fix (a mean, a
module with ``reduction = "sum"``, or ``(loss_sum, count)``).  Anything else this module cannot
make exact (``reduction="none"``, a mean-reduced module it does not know) is
refused too, saying what to pass instead.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.base.device import autocast
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.step.stage import preserved_rng

__all__ = ["LossContract", "LossCountFn", "LossFn", "StepLoss"]

LossFn = Callable[..., object]  # -> a scalar Tensor, or (loss_sum, count) with loss_count
LossCountFn = Callable[[Tensor], object]  # a microbatch's target -> its count (int or Tensor)

# Mean over every element of the (output, target) pair, broadcast: the count is taken from
# the target, and a microbatch's sum divided by how much wider the broadcast is (_spread).
_ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.SoftMarginLoss,
    nn.PoissonNLLLoss,
    nn.KLDivLoss,
)
_CLASSES: tuple[type[nn.Module], ...] = (nn.CrossEntropyLoss, nn.NLLLoss)
# The deprecated keywords that override reduction= (reduce=False is reduction="none"): the
# module takes them as the function does, so a partial giving them is refused as it is.
_LEGACY = ("size_average", "reduce")
# torch's functional losses with an ignore_index, passed as loss_fn itself or as a
# functools.partial of keywords: each is its module's forward with the same defaults, so it
# is run as that module and weighted by the items it counts, not by rows (which ignored
# targets make wrong, and a microbatch whose targets are all ignored makes nan).
_FUNCTIONAL: tuple[tuple[Callable[..., object], type[nn.Module], frozenset[str]], ...] = (
    (
        F.cross_entropy,
        nn.CrossEntropyLoss,
        frozenset({"weight", "ignore_index", "reduction", "label_smoothing", *_LEGACY}),
    ),
    (F.nll_loss, nn.NLLLoss, frozenset({"weight", "ignore_index", "reduction", *_LEGACY})),
)
# The ignore_index of torch's losses and Hugging Face's labels: in the integer targets of a
# mean weighted by rows, it says that rows count different numbers of items.
_IGNORE_INDEX = -100
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)

Weighting = Literal["items", "sum", "count", "rows"]
Kept = tuple[tuple[Tensor, ...], Tensor, Tensor]  # a probed microbatch's outputs, target, value
# How many probes a scalar loss_fn gets, at most, while they cannot tell a sum from a mean (a
# zero loss): each costs two calls of loss_fn on half a microbatch, or one on a pair of them.
_PROBES = 4


class LossContract:
    """What ``loss_fn`` returns and how microbatches are weighted; refuses what is inexact.

    Built once per pipeline.  :meth:`for_step` turns one batch's targets into
    the step's :class:`StepLoss`.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        loss_count: LossCountFn | None = None,
        *,
        autocast: torch.dtype | None = None,
    ) -> None:
        """``autocast``: the dtype ``loss_fn`` runs under ``torch.autocast`` in (as the
        stages' forward does), so a loss autocast keeps in float32 is computed in float32."""
        if not callable(loss_fn):
            raise PipelineError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if loss_count is not None and not callable(loss_count):
            raise PipelineError(f"loss_count must be callable, got {type(loss_count).__name__}")
        counted = _self_counting(loss_fn)
        if counted is not None:
            if loss_count is not None:
                raise PipelineError(
                    f"{type(loss_fn).__name__} counts its own items (its count method); "
                    f"drop loss_count="
                )
            loss_fn, loss_count = counted
        elif loss_count is None:
            module = _functional_module(loss_fn)
            if module is not None:
                loss_fn = module
        self.loss_fn = loss_fn
        self.loss_count = loss_count
        self.autocast = autocast
        self.weighting = _weighting(loss_fn, loss_count)
        # A scalar loss_fn is probed on the first microbatches it sees (a one-row one paired
        # with the next) until one tells a mean from a sum; a probe that cannot tell counts down.
        self.probes_left = _PROBES if self.weighting == "rows" else 0

    def probe_mean(
        self, fn: LossFn, output: Tensor | tuple[Tensor, ...], target: Tensor, whole: Tensor
    ) -> None:
        """Refuse a scalar ``loss_fn`` that returns a sum over its rows: weighted by rows as
        a mean, it would scale the step's loss and gradients by the microbatch's rows.

        ``whole`` is ``fn(output, target)``; ``fn`` is run again on each half of the rows,
        without grad, on detached outputs, with the RNG state restored, so nothing the step
        computes changes.  Refused when ``whole`` is the halves' sum and not their mean
        weighted by rows; a loss that is neither (a mask, a batch-level term) or both (a
        zero loss) passes.
        """
        rows = _rows(output, target)
        if rows < 2:
            return  # no two halves to compare, or target and output not cut alike: not a probe
        outputs, first, several = _tensors(output), rows // 2, isinstance(output, tuple)
        values = [
            _probed(fn, several, tuple(t.detach()[c] for t in outputs), target[c], self.autocast)
            for c in (slice(0, first), slice(first, rows))
        ]
        parts = [(first, values[0]), (rows - first, values[1])]
        self._judge(fn, parts, float(whole.detach()), "the whole microbatch is the halves' sum")

    def probe_pair(self, fn: LossFn, kept: Kept, later: Kept) -> bool:
        """As :meth:`probe_mean`, for a microbatch of one row (``kept``: no halves): ``fn``
        once on it and the ``later`` microbatch concatenated along dim 0, against their own
        values (each ``(outputs, target, value)``, detached).  False, and nothing run, when
        their shapes beyond dim 0 (or dtypes) differ."""
        pairs = [*zip(kept[0], later[0], strict=False), (kept[1], later[1])]
        if len(kept[0]) != len(later[0]) or any(
            a.shape[1:] != b.shape[1:] or a.dtype != b.dtype for a, b in pairs
        ):
            return False
        joined = [torch.cat(pair) for pair in pairs]
        # Outputs as the stage gives them to loss_fn: a tuple only when there are several.
        got = _probed(fn, len(joined) > 2, tuple(joined[:-1]), joined[-1], self.autocast)
        parts = [(len(k[1]), float(k[2])) for k in (kept, later)]
        self._judge(fn, parts, got, "two microbatches together is the sum of theirs alone")
        return True

    def _judge(
        self, fn: LossFn, parts: Sequence[tuple[int, float | None]], got: float | None, on: str
    ) -> None:
        """Refuse a sum: ``got``, the value on the rows of ``parts`` ((rows, value) each), is
        their sum and not their mean weighted by rows.  A probe that cannot tell (or sees
        neither) counts down; one that can ends the probing."""
        values = [v for _, v in parts if v is not None and math.isfinite(v)]
        self.probes_left -= 1
        if got is None or not math.isfinite(got) or len(values) < len(parts):
            return
        summed, rows = sum(values), sum(r for r, _ in parts)
        mean = sum(r * v for (r, _), v in zip(parts, values, strict=True)) / rows
        # Loose enough for a loss computed in reduced precision, far tighter than the factor
        # of about ``rows`` / 2 between a sum and a mean.
        tol = 1e-3 * max(abs(summed), abs(mean), abs(got), 1e-12)
        near_sum, near_mean = abs(got - summed) <= tol, abs(got - mean) <= tol
        self.probes_left = 0 if near_sum != near_mean else self.probes_left
        if not near_sum or near_mean:
            return
        name = getattr(fn, "__name__", type(fn).__name__)
        raise PipelineError(
            f"loss_fn {name} returns a sum over its microbatch's rows (its value on {on}), but "
            f"a function returning a scalar is weighted by rows as a mean, so the step's loss "
            f"and gradients would be scaled by the rows; return the mean (reduction='mean'), "
            f"or say it is a sum: an nn.Module with reduction = 'sum' (the step's loss is then "
            f"the batch's sum), or (loss_sum, count) with Pipeline(loss_count=...)"
        )

    def for_step(
        self,
        targets: Sequence[Tensor],
        sizes: Sequence[int],
        *,
        total: Callable[[float], float] | None = None,
    ) -> StepLoss:
        """The weights of this batch's microbatches, from their targets (before any backward).

        ``total``: the sum of a count over the data-parallel replicas, whose
        slices together are the global batch: the weights are then shares of
        the global batch, and the replicas' gradients and losses sum to its.
        """
        fn = self.loss_fn
        overall = total if total is not None else (lambda x: x)
        if self.weighting == "rows":
            # One slice of the batch is weighted exactly, ignored targets or not.
            ignored = (len(sizes) > 1 or total is not None) and _holds_ignored(targets)
            batch = overall(float(sum(sizes)))
            return StepLoss(self, fn, [n / batch for n in sizes], None, ignored=ignored)
        if self.weighting == "sum":
            return StepLoss(self, fn, [1.0] * len(sizes), None)
        if self.weighting == "count":
            count = self.loss_count
            assert count is not None  # _weighting chose "count" because it was given
            counts = [
                _as_count(count(t), f"loss_count(target of microbatch {i})")
                for i, t in enumerate(targets)
            ]
        else:
            assert isinstance(fn, nn.Module)  # "items" is chosen for modules only
            counts = [_items(fn, t, i) for i, t in enumerate(targets)]
            # A copy made now sees the module's settings as they are this step; it shares
            # the module's weights and hooks, and only its reduction differs.
            fn = copy.copy(fn)
            setattr(fn, "reduction", "sum")  # noqa: B010 (nn.Module's typing rejects a str)
        whole = overall(float(sum(counts)))
        # A batch with nothing to count: the whole batch's mean is 0/0 = nan, and so is this.
        share = 1.0 / whole if whole != 0 else math.nan
        scale = whole / overall(float(len(sizes)))  # a term's: see _sum_and_count
        return StepLoss(self, fn, [share] * len(sizes), counts, term_scale=scale)


@dataclass
class StepLoss:
    """One step's loss: the per-microbatch weights and how to compute each microbatch's loss.

    ``weights[i]`` seeds microbatch ``i``'s backward; ``counts`` (when the
    weighting counts items) is what each microbatch's loss sums over.
    """

    contract: LossContract
    fn: LossFn  # what is called per microbatch
    weights: list[float]
    counts: list[float] | None
    # Loss elements per target element of an element-wise loss whose target broadcasts
    # (see the module docstring): the first microbatch's, which every other must share.
    spread: float | None = None
    # For a mean weighted by rows: a microbatch whose loss was nan from a finite output, and
    # one whose loss was finite (see _check_mean).
    empty: int | None = None
    finite: int | None = None
    # A mean weighted by rows whose integer targets hold -100: refused at the first loss,
    # before any backward, once a tuple (which has a message of its own) is ruled out.
    ignored: bool = False
    # A microbatch of one row awaiting the next, to probe a mean on the two (see _probe).
    kept: Kept | None = None
    term_scale: float | None = None  # a term times this, weighted 1 / items: term / microbatches

    def compute(self, output: Tensor | tuple[Tensor, ...], target: Tensor, i: int) -> Tensor:
        """Microbatch ``i``'s loss as the weights expect it: its sum, or its mean for "rows"."""
        contract = self.contract
        spread = 1.0
        if contract.weighting == "items":
            assert isinstance(self.fn, nn.Module)
            spread = self._spread(_spread(self.fn, output, target, i), i)
        first = output[0] if isinstance(output, tuple) else output
        with autocast(first.device, contract.autocast):
            result = self.fn(output, target)
        if spread != 1.0 and isinstance(result, Tensor):
            result = result / spread  # the items the weights counted are the target's
        if isinstance(result, tuple):
            return self._sum_and_count(result, i)
        if contract.weighting == "count":
            raise PipelineError(
                f"microbatch {i}: with Pipeline(loss_count=...), loss_fn must return "
                f"(loss_sum, count), got {_describe(result)}"
            )
        if not isinstance(result, Tensor) or result.numel() != 1:
            raise PipelineError(
                f"microbatch {i}: loss_fn must return a scalar tensor or (loss_sum, count), "
                f"got {_describe(result)}"
            )
        if contract.weighting == "rows":
            if self.ignored:
                _refuse_ignored(self.fn)
            self._check_mean(result, output, i)
            if contract.probes_left > 0:
                self._probe(output, target, result)
        return result

    def _probe(self, output: Tensor | tuple[Tensor, ...], target: Tensor, value: Tensor) -> None:
        """Probe a scalar loss_fn (:meth:`LossContract.probe_mean`): a microbatch of one row
        is kept, detached, and probed with the next one (:meth:`LossContract.probe_pair`)."""
        kept, self.kept = self.kept, None  # released once probed, whatever comes of it
        rows, outputs = _rows(output, target), _tensors(output)
        later = (tuple(t.detach() for t in outputs), target.detach(), value.detach())
        if kept is not None and rows and self.contract.probe_pair(self.fn, kept, later):
            return
        if rows == 1:
            self.kept = later
        else:
            self.contract.probe_mean(self.fn, output, target, value)

    def _check_mean(self, result: Tensor, output: object, i: int) -> None:
        """Refuse a mean over no items beside a finite one: the batch's mean would skip it.

        A mean's only way to nan from finite inputs is 0/0, a microbatch that counts
        nothing (its targets all ignored); the whole batch's mean counts the other
        microbatches' items and is finite, while rows weighting carries the nan.  A nan
        output, or every microbatch empty, is nan in the whole batch too, and passes.  An
        inf cannot come from an empty mean, and is the whole batch's as well.
        """
        # One scalar read per microbatch: what it costs to refuse rather than be wrong (a
        # mask may hide float targets as well as labels: NaN-masked regression targets).
        if bool(torch.isfinite(result)):
            self.finite = i
            if self.empty is None:
                return
            empty, other = self.empty, i
        elif bool(torch.isnan(result)) and _all_finite(output):
            self.empty = i
            if self.finite is None:
                return
            empty, other = i, self.finite
        else:
            return
        raise PipelineError(
            f"microbatch {empty}: loss_fn returned nan for a finite output while microbatch "
            f"{other}'s loss is finite: a mean over no items (every target ignored?), which "
            f"the whole batch's mean would skip but a mean weighted by rows cannot; return "
            f"(loss_sum, count) with Pipeline(loss_count=...), or pass zeropipe.causal_lm_loss "
            f"or a torch loss module (nn.CrossEntropyLoss()) itself"
        )

    def _spread(self, spread: float, i: int) -> float:
        if self.spread is None:
            self.spread = spread
        elif spread != self.spread:
            raise PipelineError(
                f"microbatch {i}: {type(self.fn).__name__}'s target broadcasts to {spread:g} "
                f"loss elements per target element, but to {self.spread:g} in another "
                f"microbatch of this step, so their means cannot be combined exactly; give "
                f"the target the output's shape (target.expand_as(output))"
            )
        return spread

    def _sum_and_count(self, result: tuple[object, ...], i: int) -> Tensor:
        if self.contract.weighting != "count":
            raise PipelineError(
                f"microbatch {i}: loss_fn returned a tuple {_describe(result)}; a loss_fn that "
                f"returns (loss_sum, count) needs Pipeline(loss_count=fn), fn(target) -> the "
                f"count, so that the batch's total is known before the first backward"
            )
        if len(result) not in (2, 3) or not all(
            isinstance(t, Tensor) and t.numel() == 1 for t in result[::2]
        ):
            raise PipelineError(
                f"microbatch {i}: loss_fn must return (loss_sum, count) or (loss_sum, count, term) "
                f"with loss_sum and term scalar tensors, got {_describe(result)}"
            )
        got = _as_count(result[1], f"the count loss_fn returned for microbatch {i}")
        assert self.counts is not None  # "count" weighting always has counts
        expected = self.counts[i]
        if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9):
            raise PipelineError(
                f"microbatch {i}: loss_fn counted {got:g} item(s) but loss_count(target) says "
                f"{expected:g}; they must agree (the weights were taken from loss_count)"
            )
        if len(result) == 2:
            return cast(Tensor, result[0])
        assert self.term_scale is not None  # the "count" weighting always sets it
        return cast(Tensor, result[0]) + cast(Tensor, result[2]) * self.term_scale


def _tensors(output: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


def _rows(output: Tensor | tuple[Tensor, ...], target: Tensor) -> int:
    """The rows of a microbatch whose outputs and target are cut alike along dim 0, else 0."""
    rows = target.shape[0] if target.dim() > 0 else 0
    alike = all(isinstance(t, Tensor) and t.shape[:1] == (rows,) for t in _tensors(output))
    return rows if alike else 0


def _probed(
    fn: LossFn,
    several: bool,
    outputs: tuple[Tensor, ...],
    target: Tensor,
    dtype: torch.dtype | None,
) -> float | None:
    """``fn``'s value on detached ``outputs`` (a tuple if ``several``) and ``target``, leaving
    no trace (no graph, no RNG drawn); None when it fails or is no scalar: a loss that
    cannot take the probe's rows goes unprobed, not refused."""
    device = outputs[0].device
    try:
        with torch.no_grad(), preserved_rng(device), autocast(device, dtype):
            value = fn(outputs if several else outputs[0], target)
        return float(value) if isinstance(value, Tensor) and value.numel() == 1 else None
    except Exception:
        return None


def _self_counting(loss_fn: LossFn) -> tuple[LossFn, LossCountFn] | None:
    """A mean loss that also offers ``sum_and_count(output, target) -> (loss_sum, count)`` and
    ``count(target)`` is run through those, so the pipeline weights it by its own count."""
    if isinstance(loss_fn, nn.Module):
        return None
    summed, count = getattr(loss_fn, "sum_and_count", None), getattr(loss_fn, "count", None)
    if callable(summed) and callable(count):
        return summed, count
    return None


def _functional_module(loss_fn: LossFn) -> nn.Module | None:
    """``F.cross_entropy`` / ``F.nll_loss`` (or a partial of keywords its module takes) as
    that module, which calls it with the same arguments: ``None`` for anything else."""
    fn, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial) and not loss_fn.args:
        fn, keywords = loss_fn.func, dict(loss_fn.keywords)
    for func, module, accepted in _FUNCTIONAL:
        if fn is func and set(keywords) <= accepted:
            return module(**keywords)
    return None


def _holds_ignored(targets: Sequence[Tensor]) -> bool:
    """Whether integer targets hold -100: some items are then not counted, and the rows no
    longer say how many items each microbatch's mean covers."""
    flags = [
        (t == _IGNORE_INDEX).any()
        for t in targets
        if isinstance(t, Tensor) and t.dtype in _SIGNED and t.numel()
    ]
    return bool(flags) and bool(torch.stack(flags).any())  # one read, however many targets


def _refuse_ignored(loss_fn: LossFn) -> NoReturn:
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    raise PipelineError(
        f"loss_fn {name} returns a mean, weighted by rows, but the targets hold "
        f"{_IGNORE_INDEX} (ignored), so a microbatch's mean may count fewer items than its rows "
        f"and rows cannot weight it exactly; pass zeropipe.causal_lm_loss, "
        f"nn.CrossEntropyLoss() or F.cross_entropy itself, or a function returning "
        f"(loss_sum, count) with Pipeline(loss_count=...)"
    )


def _all_finite(output: object) -> bool:
    tensors = output if isinstance(output, tuple) else (output,)
    return all(
        bool(torch.isfinite(t).all())
        for t in tensors
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
    )


def _weighting(loss_fn: LossFn, loss_count: LossCountFn | None) -> Weighting:
    reduction = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    name = type(loss_fn).__name__
    if reduction is None:
        return "count" if loss_count is not None else "rows"
    if loss_count is not None:
        raise PipelineError(
            f"loss_count= is for a loss_fn that returns (loss_sum, count); {name} has a "
            f"reduction ({reduction!r}) and is normalised without it -- drop loss_count="
        )
    if reduction == "sum":
        return "sum"
    if reduction == "none":
        raise PipelineError(
            f"{name}(reduction='none') returns one loss per item, and a step needs one number: "
            f"use reduction='mean' or 'sum', or a function returning (loss.sum(), count) with "
            f"Pipeline(loss_count=...)"
        )
    known = type(loss_fn) in _CLASSES or type(loss_fn) in _ELEMENTWISE
    if reduction in ("mean", "batchmean") and known:
        if reduction == "batchmean" and not isinstance(loss_fn, nn.KLDivLoss):
            raise PipelineError(f"{name}: reduction='batchmean' is KLDivLoss's only")
        return "items"
    raise PipelineError(
        f"{name}(reduction={reduction!r}): zeropipe cannot tell what this loss's mean divides "
        f"by, so the microbatches' means cannot be combined exactly; use reduction='sum', or "
        f"a function returning (loss_sum, count) with Pipeline(loss_count=...)"
    )


def _items(module: nn.Module, target: Tensor, i: int) -> float:
    """How many items ``module``'s mean divides by on ``target`` (see the module docstring)."""
    if isinstance(module, _CLASSES):
        if torch.is_floating_point(target):  # class probabilities: one item per position
            classes = target.shape[1] if target.dim() >= 2 else target.numel()
            return target.numel() / max(classes, 1)
        kept = target[target != module.ignore_index]
        weight = getattr(module, "weight", None)
        if weight is not None:  # the mean is weighted: it divides by the targets' weight sum
            if kept.numel() and not 0 <= int(kept.min()) <= int(kept.max()) < len(weight):
                raise PipelineError(
                    f"microbatch {i}: {type(module).__name__}: target classes must lie in "
                    f"[0, {len(weight)}) or equal ignore_index={module.ignore_index}, got "
                    f"{int(kept.min())}..{int(kept.max())}"
                )
            return float(weight[kept].sum().item())
        return float(kept.numel())
    if isinstance(module, nn.KLDivLoss) and module.reduction == "batchmean":
        return float(target.shape[0]) if target.dim() > 0 else 1.0
    return float(target.numel())


def _spread(module: nn.Module, output: object, target: Tensor, i: int) -> float:
    """Loss elements per target element: how much wider than the target an element-wise
    loss broadcasts (1 when it does not).  A target whose rows are not the output's is
    refused: it would mix rows of different microbatches."""
    if not isinstance(module, _ELEMENTWISE) or not isinstance(output, Tensor):
        return 1.0
    shapes = [output.shape, target.shape]
    for extra in ("weight", "pos_weight"):  # per-element weights broadcast too
        w = getattr(module, extra, None)
        if isinstance(w, Tensor):
            shapes.append(w.shape)
    if all(s == output.shape for s in shapes):
        return 1.0  # the common case, without torch.broadcast_shapes' tens of microseconds
    try:
        wide = torch.broadcast_shapes(*shapes)
    except RuntimeError as exc:
        raise PipelineError(f"microbatch {i}: {type(module).__name__}: {exc}") from None
    if wide == target.shape == output.shape:
        return 1.0
    # Broadcasting aligns trailing dims: unless both have the broadcast's dims, and its rows
    # as their dim 0, one's rows meet the other's columns.
    if any(len(s) != len(wide) or s[0] != wide[0] for s in (output.shape, target.shape)):
        raise PipelineError(
            f"microbatch {i}: {type(module).__name__} broadcasts output {list(output.shape)} "
            f"and target {list(target.shape)} to {list(wide)}, which mixes rows of different "
            f"microbatches (dim 0 of both must be the rows); give the target one row per "
            f"output row, with as many dims"
        )
    batchmean = isinstance(module, nn.KLDivLoss) and module.reduction == "batchmean"
    if wide == target.shape or batchmean:  # batchmean divides by the rows, whatever the rest
        return 1.0
    return wide.numel() / target.numel() if target.numel() else 1.0


def _as_count(value: object, what: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise PipelineError(
                f"{what} must be a number, got a tensor of shape {list(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PipelineError(f"{what} must be a number, got {_describe(value)}")
    if not value >= 0:
        raise PipelineError(f"{what} must be >= 0, got {value!r}")
    return float(value)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return f"{type(value).__name__} {value!r}"
