"""Split backward: a stage's backward as two actions, I (input gradient) then W (weight gradients).

Zero-bubble schedules send the gradient w.r.t. a stage's *input* upstream as
early as possible (action I) and fill pipeline bubbles later with the weight
gradients (action W).  The two together do exactly the work of one full
backward B, and give the same ``.grad`` on every parameter.

How it works.  :func:`prepare_split` gives every plain ``nn.Linear`` of a
stage a forward (on the instance: its class stays ``nn.Linear``) whose
autograd node knows, *at backward time*, whether its :class:`WeightGradStash`
is deferring.  During I the stash is deferring:
each linear returns its input gradient (and bias gradient, a cheap sum) at
once and pushes ``(weight, input, grad_output)`` into the stash instead of
computing ``grad_output^T @ input``.  Autograd then frees the whole graph as
usual, so what survives until W is only those pairs -- bounded by the inputs
and output gradients of the linears, never the rest of the stage's
activations.  Every other parameter (LayerNorm, Embedding, frozen or
non-leaf weights, linears that were not prepared) gets its gradient during I
through plain autograd, which keeps the result exact without special cases.
W computes the deferred products and accumulates them into ``param.grad``::

    F   with stash.recording(stage):           x --> Linear1 --> GELU --> Linear2 --> out
            out = stage(x)                           saves x      saves h1   saves h2

    I   stash.input_backward(out, g)          x.grad <-- Linear1 <-- GELU <-- Linear2 <-- g
        (graph freed afterwards)                       |                     |
                                                       v                     v
        stash:  [(Linear2.weight, h2, g), (Linear1.weight, x, g1)]   <- all that survives

    W   stash.weight_backward()               Linear.weight.grad += g^T @ input   (per entry)

    B   torch.autograd.backward(out, g)       unchanged: a recorded graph whose stash is not
                                              deferring computes every gradient at once

Contract:

- Deferral is decided by an explicit stash captured at forward time (bound by
  ``stash.recording(module)``), never by module-level state.  One stash per
  (stage, microbatch); it is reusable after W or :meth:`WeightGradStash.clear`.
- I is ``torch.autograd.backward``: gradients land on leaves' ``.grad`` --
  the stage input (a leaf that requires grad, as a pipeline stage receives it)
  and every non-deferred parameter.  It returns nothing.
- W adds into ``param.grad`` (created if ``None``) in the parameter's dtype.
  Entries of the same parameter (a linear used twice, two linears sharing a
  weight) are summed first and added once, as autograd does.  Into an
  existing ``.grad`` W fuses product and sum (``addmm_``) unless the stash
  was built with ``fuse_accumulation=False``, which reproduces autograd's
  arithmetic bit for bit.  Tied weights
  whose other use is not a linear (an ``nn.Embedding``) get that part during
  I and the linear part during W.
- Under ``torch.autocast`` the casts are recorded as ordinary autograd ops
  outside the linear, so W computes in the autocast dtype and casts the
  result to the parameter's dtype, exactly like the cast's backward.
- Activation checkpointing inside a recorded stage keeps working: a prepared
  linear uses the same autograd node with or without a stash, so the
  recomputation saves what the forward saved.  (With reentrant checkpointing
  the recomputed linears are not deferred; their weights get gradients in I.)
- A weight with tensor hooks (``register_hook``, post-accumulate-grad hooks,
  registered any time before its backward) is never deferred, since W writes
  ``.grad`` past autograd: its gradient goes through autograd in I (or B) and
  its hooks run per backward as in torch (a one-line warning per linear says
  so).  Module hooks see input and output gradients, which I computes as usual.
- Tensors held by the stash must not be changed in place between I and W
  (their version counters are no longer checked).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.base import _compat
from zeropipe.base.storage import distinct_bytes
from zeropipe.core.errors import PipelineError

__all__ = [
    "WeightGradStash",
    "prepare_split",
    "split_linears",
    "unprepare_split",
    "weight_backward_together",
]


@dataclass(frozen=True)
class _Deferred:
    """One postponed weight-gradient product: ``param.grad += grad_output^T @ input``."""

    param: Tensor
    input: Tensor
    grad_output: Tensor


class WeightGradStash:
    """The deferred weight-gradient work of one (stage, microbatch), held between I and W.

    ``stage`` and ``microbatch`` only label error messages.

    ``fuse_accumulation`` (default on): where a parameter's ``.grad`` already
    exists (later microbatches of a step), W adds ``grad_output^T @ input``
    into it with one ``addmm_`` -- no temporary and one pass fewer over the
    gradient than autograd's ``mm`` then ``add_``, but a possibly different
    last bit.  Off, W repeats autograd's arithmetic and the untied gradients
    match a full backward bit for bit.

    ``grad_memory``: where a parameter's ``.grad`` is ``None``, W writes the
    new gradient into memory that :class:`GradMemory` kept from the last step
    (same values, no fresh pages to fault in); without it, W allocates.

    Lifecycle::

        with stash.recording(stage_module):   # F: bind this stash to the stage's linears
            out = stage_module(x)
        stash.input_backward(out, grad_out)   # I: input grads now, weight work stashed
        stash.weight_backward()               # W: weight grads into param.grad

    after which the stash is empty and can record the next microbatch.
    """

    def __init__(
        self,
        *,
        stage: int | None = None,
        microbatch: int | None = None,
        fuse_accumulation: bool = True,
        grad_memory: GradMemory | None = None,
    ) -> None:
        self.stage = stage
        self.microbatch = microbatch
        self.fuse_accumulation = fuse_accumulation
        self.grad_memory = grad_memory
        self._entries: list[_Deferred] = []
        self._deferring = False
        self._awaiting_weight = False  # I ran, W not yet
        self._weight_done = False  # W ran since the last recording / I

    # -- state -------------------------------------------------------------------------

    @property
    def deferring(self) -> bool:
        """True only while :meth:`input_backward` runs; linears read it in their backward."""
        return self._deferring

    @property
    def nbytes(self) -> int:
        """Bytes kept alive by the stash: distinct storages of its inputs and output grads.

        A tensor shared by several entries (one input fed to two linears, one
        gradient flowing into both) is counted once, because it is held once.
        """
        return distinct_bytes(t for e in self._entries for t in (e.input, e.grad_output))

    def __len__(self) -> int:
        """Number of deferred weight-gradient products (one per linear call)."""
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"WeightGradStash(stage={self.stage}, microbatch={self.microbatch}, "
            f"entries={len(self)}, nbytes={self.nbytes})"
        )

    def clear(self) -> None:
        """Drop any deferred work and forget I/W progress (e.g. after a failed step)."""
        self._entries.clear()
        self._deferring = False
        self._awaiting_weight = False
        self._weight_done = False

    # -- F -----------------------------------------------------------------------------

    @contextmanager
    def recording(
        self, module: nn.Module, linears: Sequence[nn.Module] | None = None
    ) -> Iterator[None]:
        """Bind this stash to the prepared linears of ``module`` for the forwards run inside.

        The binding is captured by each linear's autograd node, so the
        context may close before I runs.  ``linears``: ``module``'s prepared
        linears as :func:`split_linears` found them, for a caller that records
        the same module many times (default: looked up on every call).  Raises
        :class:`PipelineError` if ``module`` still has a plain ``nn.Linear``
        (forgot :func:`prepare_split`) or if this stash still holds deferred
        work from a previous microbatch.
        """
        if linears is None:
            linears = split_linears(module, self._where())
        if self._awaiting_weight:
            raise PipelineError(
                f"{self._where()}: cannot record a new forward while W of the previous one is "
                f"pending ({len(self)} deferred entries); run weight_backward() or clear() first"
            )
        self._weight_done = False
        previous = [m.__dict__.get(_STASH_ATTR) for m in linears]
        for m in linears:
            m.__dict__[_STASH_ATTR] = self
        try:
            yield
        finally:
            # Restore rather than clear, so nested recordings of sub-modules compose.
            for m, prev in zip(linears, previous, strict=True):
                if prev is None:
                    m.__dict__.pop(_STASH_ATTR, None)
                else:
                    m.__dict__[_STASH_ATTR] = prev

    # -- I -----------------------------------------------------------------------------

    def input_backward(
        self,
        outputs: Tensor | Sequence[Tensor],
        grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    ) -> None:
        """Action I: ``torch.autograd.backward(outputs, grad_outputs)`` with weight work deferred.

        Input gradients and all non-deferred parameter gradients land on
        ``.grad`` of their leaves; the graph is freed.  Raises
        :class:`PipelineError` if I already ran and W has not.
        """
        if self._awaiting_weight:
            raise PipelineError(
                f"{self._where()}: I (input_backward) ran twice without W in between; "
                "run weight_backward() or clear() first"
            )
        self._weight_done = False
        self._deferring = True
        try:
            torch.autograd.backward(outputs, grad_outputs)
        except BaseException:
            # Half a backward leaves a half-filled stash: running W on it would be wrong.
            self._entries.clear()
            raise
        finally:
            self._deferring = False
        self._awaiting_weight = True

    def _defer(self, param: Tensor, input: Tensor, grad_output: Tensor) -> None:
        self._entries.append(_Deferred(param, input, grad_output))

    # -- W -----------------------------------------------------------------------------

    def weight_backward(self) -> None:
        """Action W: accumulate every deferred weight gradient into ``param.grad``.

        Raises :class:`PipelineError` if I has not run, or W already ran for it.
        """
        weight_backward_together([self])

    def _check_due(self) -> None:
        if not self._awaiting_weight:
            what = "W (weight_backward) ran twice" if self._weight_done else "W before I"
            raise PipelineError(
                f"{self._where()}: {what}; weight gradients exist only after input_backward() "
                "and are consumed by the first weight_backward()"
            )

    def _take_entries(self) -> list[_Deferred]:
        """Hand over the deferred work for W (whose being due was checked)."""
        # Whatever happens next, the entries are spent: a retry must not add them twice.
        entries, self._entries = self._entries, []
        self._awaiting_weight = False
        self._weight_done = True
        return entries

    def _where(self) -> str:
        return f"split backward (stage {self.stage}, microbatch {self.microbatch})"


def weight_backward_together(stashes: Sequence[WeightGradStash]) -> None:
    """W of several microbatches at once: one product per parameter over all their rows.

    ``sum_k grad_output_k^T @ input_k`` is one matrix product of the stacked
    rows, which reads and writes the weight-sized gradient once instead of
    once per microbatch -- the dominant cost of W when microbatches are small
    (a few rows against a large weight).  The result equals running each
    stash's :meth:`~WeightGradStash.weight_backward` in turn, up to rounding;
    stashes built with ``fuse_accumulation=False`` are run in turn, exactly.
    """
    for stash in stashes:  # all checked before any is consumed
        stash._check_due()
    entries = [e for stash in stashes for e in stash._take_entries()]
    if not stashes or not entries:
        return
    fuse = all(stash.fuse_accumulation for stash in stashes)
    memory = stashes[0].grad_memory
    # Group by parameter (a tied weight, a linear called twice, the same linear in several
    # microbatches), so that each parameter is updated once, as autograd would.
    groups = _group_by_param(entries)
    del entries
    with torch.no_grad():
        for key in list(groups):
            # Popped so that each group's tensors are freed as soon as they are used and
            # memory falls during W instead of staying at its peak until the end.
            param, group = groups.pop(key)
            _accumulate(param, _stacked(group) if fuse else group, fuse=fuse, memory=memory)
            del group


def _stacked(group: list[_Deferred]) -> list[_Deferred]:
    """One entry whose rows are all of the group's (same dtypes), so W is one product."""
    if len(group) == 1 or len({(e.input.dtype, e.grad_output.dtype) for e in group}) > 1:
        return group
    return [
        _Deferred(
            group[0].param,
            torch.cat([_rows(e.input) for e in group]),
            torch.cat([_rows(e.grad_output) for e in group]),
        )
    ]


def _rows(t: Tensor) -> Tensor:
    # Leading dims (batch, seq, ...) are all rows of one matrix product; a matrix as it is
    # (a reshape to the same shape is a view all the same, and costs a call per use).
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _weight_grad(input: Tensor, grad_output: Tensor) -> Tensor:
    # Same product, in the same layout, as the native addmm backward, so results match bitwise
    # in the common case.
    return _rows(grad_output).t().mm(_rows(input))


def _group_by_param(entries: list[_Deferred]) -> dict[int, tuple[Tensor, list[_Deferred]]]:
    groups: dict[int, tuple[Tensor, list[_Deferred]]] = {}
    for e in entries:
        groups.setdefault(id(e.param), (e.param, []))[1].append(e)
    return groups


def _accumulate(
    param: Tensor, group: list[_Deferred], *, fuse: bool, memory: GradMemory | None
) -> None:
    """``param.grad += sum(grad_output^T @ input)`` over ``group``, in ``param``'s dtype."""
    grad = param.grad
    first = group[0]
    if fuse and grad is not None and len(group) == 1 and first.grad_output.dtype == grad.dtype:
        grad.addmm_(_rows(first.grad_output).t(), _rows(first.input))
        return
    # Otherwise autograd's own arithmetic: one product per use, summed (its input buffer),
    # then added to .grad (AccumulateGrad).
    if grad is None and memory is not None and first.grad_output.dtype == param.dtype:
        # The same product, written into kept memory instead of a new allocation.
        total = torch.mm(_rows(first.grad_output).t(), _rows(first.input), out=memory.take(param))
    else:
        total = _weight_grad(first.input, first.grad_output)
    for e in group[1:]:
        if fuse:
            total.addmm_(_rows(e.grad_output).t(), _rows(e.input))
        else:
            total.add_(_weight_grad(e.input, e.grad_output))
    total = total.to(param.dtype)
    if grad is None:
        param.grad = total
    else:
        grad.add_(total)


# -- the linear ----------------------------------------------------------------------------

_STASH_ATTR = "_split_stash"


class _LinearCall:
    """What a linear's autograd node needs beyond tensors: the leaf weight, its stash, its owner."""

    __slots__ = ("owner", "param", "stash")

    def __init__(
        self, param: Tensor, stash: WeightGradStash | None, owner: _SplitForward | None
    ) -> None:
        self.param = param
        self.stash = stash
        self.owner = owner


class _DeferrableLinearFn(torch.autograd.Function):
    """``F.linear`` whose weight gradient goes to a stash while that stash is deferring."""

    @staticmethod
    def forward(
        ctx: Any, input: Tensor, weight: Tensor, bias: Tensor | None, call: _LinearCall
    ) -> Tensor:
        # Save only what some gradient needs, like autograd's own addmm.  needs_input_grad
        # builds a tuple on every access: read it once.
        need_input, need_weight = ctx.needs_input_grad[:2]
        ctx.save_for_backward(input if need_weight else None, weight if need_input else None)
        ctx.call = call
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad_output: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        input, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        call: _LinearCall = ctx.call
        grad_input = grad_weight = grad_bias = None
        if need_input:
            grad_input = grad_output.matmul(weight)
        if need_bias:
            grad_bias = _rows(grad_output).sum(0)
        if need_weight:
            # Only a leaf can be written to directly in W; anything else (a parametrized
            # weight) must send its gradient back through autograd now.
            stash = call.stash
            if stash is not None and stash.deferring and call.param.is_leaf:
                if _has_tensor_hooks(call.param):
                    if call.owner is not None:
                        call.owner.warn_hooked(stash)
                    grad_weight = _weight_grad(input, grad_output)
                else:
                    stash._defer(call.param, input, grad_output)
            else:
                grad_weight = _weight_grad(input, grad_output)
        return grad_input, grad_weight, grad_bias, None


def _has_tensor_hooks(param: Tensor) -> bool:
    """Whether ``param`` has gradient hooks: read at backward time, as torch reads them.

    Deferred, its AccumulateGrad would run in I with no gradient (hooks called
    with ``None``, post-accumulate hooks seeing the previous ``.grad``).
    """
    return _compat.tensor_has_grad_hooks(param)


def _autocast_dtype(device_type: str, tensors: Sequence[Tensor | None]) -> torch.dtype | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    if not any(t is not None and _autocast_eligible(t) for t in tensors):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast_eligible(t: Tensor) -> bool:
    # Autocast's own rule: floating point, but float64 is left alone.
    return t.is_floating_point() and t.dtype != torch.float64


def _recorded_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stash: WeightGradStash | None,
    owner: _SplitForward | None = None,
) -> Tensor:
    call = _LinearCall(weight, stash, owner)
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):  # the common case, checked first: it is cheap
        return _DeferrableLinearFn.apply(input, weight, bias, call)
    dtype = _autocast_dtype(device_type, (input, weight, bias))
    if dtype is None:
        return _DeferrableLinearFn.apply(input, weight, bias, call)
    # Cast outside the Function so that the casts' backward (to the parameter dtype) is plain
    # autograd in B, and W can reproduce it with one .to(param.dtype).
    args = [
        t.to(dtype) if t is not None and _autocast_eligible(t) else t for t in (input, weight, bias)
    ]
    with torch.autocast(device_type, enabled=False):
        return _DeferrableLinearFn.apply(args[0], args[1], args[2], call)


class _SplitForward:
    """A prepared linear's forward, held in its instance ``__dict__`` as ``forward``.

    It shadows ``nn.Linear.forward`` while the class stays the user's, so
    ``type``, parameters, ``state_dict``, ``repr``, deepcopy and pickling are
    unchanged.  Its linear is held weakly: a strong reference would make every
    prepared linear a reference cycle, freed only by the cyclic collector.
    """

    __slots__ = ("_module", "name", "warned")

    def __init__(self, module: nn.Linear, name: str) -> None:
        self._module = weakref.ref(module)
        self.name = name  # in the module prepare_split was given: for the hooks warning
        self.warned = False

    def __call__(self, input: Tensor) -> Tensor:
        m = self._module()
        if m is None:
            raise PipelineError(
                f"split backward: the forward of linear {self.name or '<root>'} outlived its "
                "module (a shallow copy of a prepared linear?); call prepare_split on the copy"
            )
        weight, bias = m.weight, m.bias
        if not torch.is_grad_enabled():
            return F.linear(input, weight, bias)
        # The same autograd node whether a stash is bound or not: activation checkpointing
        # recomputes outside the recording context and hands the recomputed saved tensors to
        # the *original* node, so both must save the same things (plain F.linear would not).
        return _recorded_linear(input, weight, bias, m.__dict__.get(_STASH_ATTR), self)

    def warn_hooked(self, stash: WeightGradStash) -> None:
        """Say once per linear why its weight gradient is not deferred (its weight is hooked)."""
        if self.warned:
            return
        self.warned = True
        stage = "" if stash.stage is None else f" of stage {stash.stage}"
        warnings.warn(
            f"split backward: the weight of linear '{self.name or '<root>'}'{stage} has gradient "
            "hooks, so its gradient is computed by autograd in I (or B), not deferred to W; "
            "its hooks run as in torch",
            stacklevel=2,
        )

    def __reduce__(self) -> tuple[type[_SplitForward], tuple[nn.Linear | None, str]]:
        # deepcopy and pickle rebuild it bound to the copy of its module (memoised).
        return (_SplitForward, (self._module(), self.name))


def _prepared(m: nn.Module) -> bool:
    forward = m.__dict__.get("forward")
    return isinstance(forward, _SplitForward) and forward._module() is m


def _preparable(m: nn.Module) -> bool:
    """An exact ``nn.Linear`` running ``nn.Linear.forward``, not yet prepared."""
    if type(m) is not nn.Linear or _prepared(m):
        return False
    # A forward the user set on the instance is theirs; a shallow copy's is the original's.
    forward = m.__dict__.get("forward")
    return forward is None or isinstance(forward, _SplitForward)


def prepare_split(module: nn.Module, *, min_weight_bytes: int = 0) -> nn.Module:
    """Make every plain ``nn.Linear`` in ``module`` (itself included) deferrable; idempotent.

    Only exact ``nn.Linear`` instances are converted: subclasses may override
    ``forward`` (or, like attention's ``out_proj``, never call it), so they keep
    computing their weight gradient in I, which is still exact; so does a
    linear whose instance already has a ``forward`` of its own.  No class
    changes: the prepared forward is set on the instance.  Returns
    ``module`` itself.  Without a bound stash a prepared linear computes all
    its gradients in its backward, as ``nn.Linear`` does, with the same values.

    ``min_weight_bytes``: leave plain the linears whose weight is smaller; they
    compute their weight gradient in I (record with ``split_linears(module,
    allow_plain=True)``).
    """
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and _preparable(m) and _weight_bytes(m) >= min_weight_bytes:
            # Straight into __dict__: nn.Module.__setattr__ has nothing to register here.
            m.__dict__["forward"] = _SplitForward(m, name)
    return module


def _weight_bytes(linear: nn.Module) -> int:
    weight = linear.weight
    return weight.numel() * weight.element_size() if isinstance(weight, Tensor) else 0


def split_linears(
    module: nn.Module, where: str = "split backward", *, allow_plain: bool = False
) -> tuple[nn.Module, ...]:
    """The linears of ``module`` that :func:`prepare_split` made deferrable, in module order.

    One walk over the modules, for :meth:`WeightGradStash.recording`; a caller that
    records the same module for every microbatch looks them up once.  Raises
    :class:`PipelineError` naming any plain ``nn.Linear`` left unprepared, unless
    ``allow_plain`` (they were left plain on purpose).
    """
    modules = list(module.modules())
    if not allow_plain and any(_preparable(m) for m in modules):
        unprepared = [name for name, m in module.named_modules() if _preparable(m)]
        raise PipelineError(
            f"{where}: module has nn.Linear layers that are not prepared for split "
            f"backward ({', '.join(n or '<root>' for n in unprepared[:5])}); call "
            "prepare_split(module) once before recording"
        )
    return tuple(m for m in modules if _prepared(m))


def unprepare_split(module: nn.Module) -> nn.Module:
    """Undo :func:`prepare_split`: prepared linears run ``nn.Linear.forward`` again."""
    for m in module.modules():
        if isinstance(m.__dict__.get("forward"), _SplitForward):
            del m.__dict__["forward"]
            m.__dict__.pop(_STASH_ATTR, None)
    return module
