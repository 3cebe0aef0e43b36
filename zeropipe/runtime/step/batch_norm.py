"""Deferred BatchNorm: a pipelined step updates running statistics once, as the whole batch would.

A stage sees a step's batch one microbatch at a time.  ``nn.BatchNorm`` in
training mode then normalises each microbatch by that microbatch's own
statistics (inherent to microbatching: the loss differs from a whole-batch
forward's) and also updates ``running_mean`` / ``running_var`` once per
microbatch, so a step of m microbatches moves them m times and adds m to
``num_batches_tracked``, where one forward of the whole batch adds 1.

:class:`DeferredBatchNorm` keeps the per-microbatch normalisation but, inside
a pipeline step, only records each microbatch's per-channel count, mean and
sum of squared deviations; when the step ends the pipeline commits them, and
the running statistics move once, by the mean and unbiased variance of all
the step's rows -- what one ``nn.BatchNorm`` forward on the whole batch does::

    Pipeline.step:  begin ── F(0) ── F(1) ── R(1) ── F(2) ... F(m-1) ── commit
                             +(0)    +(1)    skip    +(2)     +(m-1)    running_* once,
                                                                        num_batches_tracked += 1

R re-runs a forward that F already counted (:func:`is_recomputing` is true
during it), so it adds nothing.  A step that fails discards what it recorded.
Outside a pipeline step (a forward the user calls, a model never given to a
:class:`~zeropipe.runtime.pipeline.Pipeline`) the module is an ordinary
BatchNorm: every training forward updates the running statistics at once.
In eval mode it normalises by the running statistics and records nothing.

The pipeline learns which modules to commit when it is built
(:class:`DeferredNorms`, one per pipeline, over the stages this process runs):
convert with :func:`deferred_batch_norm` before building the pipeline.  Each
stage's statistics stay on the rank that runs it, so nothing crosses ranks;
with data-parallel replicas each replica's statistics are those of its own
slice of the global batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.runtime.memory.manager import is_recomputing

__all__ = ["DeferredBatchNorm", "DeferredNorms", "deferred_batch_norm"]

# The input ranks each BatchNorm class accepts (as its own check does).
_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}
# What updates its running statistics per microbatch in a pipeline (the lazy forms become
# BatchNorm1d/2d/3d at their first forward; SyncBatchNorm is one too).
_PLAIN = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)


class _Moments:
    """Per-channel count, mean and sum of squared deviations, merged one batch at a time.

    Merged by Chan et al.'s pairwise update rather than as sums of x and x^2,
    which lose the variance to cancellation when the mean is large next to it.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, x: Tensor, dtype: torch.dtype) -> None:
        x = x.detach().to(dtype)
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        m2 = var * n
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.count * n / total)
        self.count = total


class DeferredBatchNorm(nn.Module):
    """BatchNorm whose running statistics a pipeline updates once per step.

    Normalises like ``nn.BatchNorm1d/2d/3d`` (training: by the batch it is
    given, one microbatch in a pipeline; eval: by the running statistics) and
    has the same parameters, buffers and ``state_dict`` keys.  Inside a
    :class:`~zeropipe.runtime.pipeline.Pipeline` step its running statistics
    are updated once, at the step's end, by the mean and unbiased variance of
    every row the step gave it: as one whole-batch ``nn.BatchNorm`` forward
    would update them (``momentum=None``, the cumulative average, included).
    Elsewhere each training forward updates them, as ``nn.BatchNorm`` does.

    Build one with :func:`deferred_batch_norm` (which converts a model's
    BatchNorms) or :meth:`from_batch_norm`.  ``dims``: the input ranks
    accepted (None: any rank from 2 up).  The running statistics are always
    tracked.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        *,
        dims: tuple[int, ...] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum, self.affine = (
            num_features,
            eps,
            momentum,
            affine,
        )
        self.dims = dims
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        else:  # registered as None, as nn.BatchNorm does
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.register_buffer("running_mean", torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.ones(num_features, device=device, dtype=dtype))
        self.register_buffer(
            "num_batches_tracked", torch.zeros((), dtype=torch.long, device=device)
        )
        # None outside a pipeline step; the step's recorded microbatches inside one.
        self.pending: _Moments | None = None

    @classmethod
    def from_batch_norm(
        cls, bn: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d
    ) -> DeferredBatchNorm:
        """The deferred form of ``bn`` (an ``nn.BatchNorm1d/2d/3d``), sharing its tensors.

        The same parameter and buffer objects (an optimizer built on ``bn``'s
        parameters keeps stepping them), ``eps``, ``momentum``, ``affine`` and
        training mode.
        """
        dims = _DIMS.get(type(bn))
        mean, var, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
        if dims is None or mean is None or var is None or count is None:
            raise PipelineError(
                f"DeferredBatchNorm.from_batch_norm takes an nn.BatchNorm1d/2d/3d that tracks "
                f"running statistics, got {type(bn).__name__}"
                + ("" if dims is None else " with track_running_stats=False")
            )
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, dims=dims, device="meta")
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean, new.running_var, new.num_batches_tracked = mean, var, count
        new.train(bn.training)
        return new

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"
        )

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if not self.training:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if self.pending is None:  # not in a pipeline step: nn.BatchNorm's update, now
            factor = self._count_batch()
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                True,
                factor,
                self.eps,
            )
        if not is_recomputing():  # an R: its F counted this microbatch already
            dtype = torch.promote_types(x.dtype, self.running_mean.dtype)
            self.pending.add(x, dtype)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    # -- the step's boundaries, called by DeferredNorms ----------------------------------
    def begin(self) -> None:
        """Start recording a step's microbatches instead of updating at each forward."""
        self.pending = _Moments()

    def commit(self) -> None:
        """Update the running statistics once with what the step recorded; stop recording."""
        moments, self.pending = self.pending, None
        if moments is None or moments.mean is None or moments.m2 is None:
            return  # no training forward this step (eval mode, or the module was not used)
        # F.batch_norm refuses a microbatch of one value per channel, so count >= 2 here.
        var = moments.m2 / (moments.count - 1)
        with torch.no_grad():
            factor = self._count_batch()
            for buf, value in ((self.running_mean, moments.mean), (self.running_var, var)):
                # The order of torch's own kernel: momentum * batch + (1 - momentum) * running.
                buf.copy_(value.to(buf.dtype) * factor + buf * (1.0 - factor))

    def discard(self) -> None:
        """Forget what a failed step recorded; the running statistics stay as they were."""
        self.pending = None

    def _count_batch(self) -> float:
        """Count one batch in ``num_batches_tracked``; the factor its statistics move by."""
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _check_input(self, x: Tensor) -> None:
        if x.dim() < 2 or (self.dims is not None and x.dim() not in self.dims):
            wanted = " or ".join(f"{d}-D" for d in self.dims or (2,))
            raise PipelineError(
                f"DeferredBatchNorm({self.num_features}) expects {wanted} input"
                f"{' or more' if self.dims is None else ''}, got {x.dim()}-D of shape "
                f"{tuple(x.shape)}"
            )


def deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Swap every ``nn.BatchNorm1d/2d/3d`` in ``module`` for a :class:`DeferredBatchNorm`.

    In place; returns ``module`` (or its replacement when ``module`` is itself
    a BatchNorm).  Each replacement shares its BatchNorm's parameters and
    buffers (see :meth:`DeferredBatchNorm.from_batch_norm`); a BatchNorm that
    appears twice becomes one module that appears twice.  Left alone:
    BatchNorms with ``track_running_stats=False`` (nothing to defer),
    subclasses (their own ``forward`` would be lost), lazy ones not yet
    initialised, ``SyncBatchNorm``.  Convert before building the pipeline,
    which finds the deferred modules of its stages when it is built.
    """
    return _converted(module, {})


def _converted(module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
    if id(module) in done:
        return done[id(module)]
    new = module
    if (
        isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
        and type(module) in _DIMS
        and module.track_running_stats
    ):
        new = DeferredBatchNorm.from_batch_norm(module)
    else:
        for name, child in list(module.named_children()):
            replacement = _converted(child, done)
            if replacement is not child:
                setattr(module, name, replacement)
    done[id(module)] = new
    return new


class DeferredNorms:
    """The deferred BatchNorms of a pipeline's stages on this process, stepped together.

    Built once per pipeline from its stage modules (``{stage index: module}``);
    also warns, once, when those hold a plain BatchNorm in training mode,
    which in a pipeline updates its running statistics once per microbatch.
    """

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        found: dict[int, DeferredBatchNorm] = {}
        plain: list[str] = []
        for s, module in stages.items():
            for name, m in module.named_modules():
                if isinstance(m, DeferredBatchNorm):
                    found.setdefault(id(m), m)
                elif isinstance(m, _PLAIN) and m.training and m.track_running_stats:
                    where = f"{name!r} of stage {s}" if name else f"stage {s}"
                    plain.append(f"{type(m).__name__} {where}")
        self.norms = list(found.values())
        if plain:
            more = f" (and {len(plain) - 1} more)" if len(plain) > 1 else ""
            warnings.warn(
                f"{plain[0]}{more} is in training mode: in a pipeline a BatchNorm normalises "
                f"each microbatch by its own statistics and updates running_mean/running_var "
                f"once per microbatch (num_batches_tracked grows by the microbatch count each "
                f"step); zeropipe.deferred_batch_norm(model) before building the Pipeline "
                f"updates them once per step, as a whole-batch forward would (docs/guide.md, "
                f"'BatchNorm in a pipeline')",
                UserWarning,
                # DeferredNorms <- build_parts <- Pipeline.__init__ <- its argument check <- caller
                stacklevel=5,
            )

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step: the modules record its microbatches, then commit (or, if it fails, discard)."""
        if not self.norms:
            yield
            return
        for norm in self.norms:
            norm.begin()
        try:
            yield
        except BaseException:
            for norm in self.norms:
                norm.discard()
            raise
        for norm in self.norms:
            norm.commit()
