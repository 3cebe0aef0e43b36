"""Recompute, activation offload and weight offload at run time, and the bytes they hold.

What a (stage, microbatch) keeps between its forward and its backward is
captured with ``torch.autograd.graph.saved_tensors_hooks`` into a
:class:`~zeropipe.runtime.memory.offload.SavedActivations` the runtime owns, so it can be counted, moved to
host memory and brought back::

    F       pack hook: every tensor autograd saves -> a handle in SavedActivations
    OFFLOAD each distinct storage (not parameters, not the caller's batch, not the
            stage's boundary tensors) copied to host; the device copy is dropped
    RELOAD  host -> device (async on an accelerator; the consumer waits on its event)
    B / I   unpack hook: handle -> tensor (the original, or a view of the reloaded bytes)

What counts as a *saved activation* (the bytes accounted per rank): the
distinct storages the forward's graph saved, excluding parameters and
buffers (weights), the caller's inputs and targets (held by the caller), and
the stage's boundary tensors -- its inputs and outputs, which the pipeline
holds as communication buffers until the backward whatever the schedule
does (the input is a leaf of the graph; the output is its root).  A
checkpointed forward saves nothing, so it holds 0 bytes; after I what stays
is the split-backward stash (``WeightGradStash.nbytes``).  These are exactly
the deltas of :func:`zeropipe.core.memory.memory_deltas` with ``act``/``act_w``/
``ckpt`` = the bytes measured here, which is what makes predicted and
measured peaks comparable (:func:`measured_costs`).

Counting once.  The hooks cost a few microseconds per saved tensor (a GPT
block saves about twenty), which is 5-15% of a small stage's forward.  A
forward's saved bytes depend on its inputs' shapes and dtypes, so by default
(``count_saved="once"``) a stage is hooked the first time it runs a forward on
inputs of a given signature, and later forwards of that signature reuse the
count and run without hooks.  A stage whose activations or weights the
schedule offloads is always hooked (offload needs the handles, and a saved
view of an offloaded weight must not pin its device copy);
``count_saved="always"`` hooks every forward, for models whose saved bytes
depend on the data itself.

Recompute (R).  A checkpointed F runs under ``torch.no_grad`` and keeps its
inputs (and its outputs, to send on).  R runs the same ``Stage.forward``
again with grad enabled.  RNG restoration needs no saved state: the runtime
seeds every layer's forward from ``(seed, step, microbatch, layer)``
(:func:`zeropipe.runtime.step.stage.seeded`), so the recomputation draws the same dropout
masks as the forward did.  Buffers a forward updates (BatchNorm's running
statistics, counters) are put back after R (:func:`kept_buffers`), so a
recomputed microbatch counts once, as in the model run without a pipeline;
:func:`is_recomputing` is also true while R runs, for layers with other side
effects (logging, external state).  With split
backward R records into the (stage, microbatch)'s weight-gradient stash, so
one recomputation serves both I and W.

Weight offload.  A stage whose schedule has weight OFFLOAD/RELOAD keeps its
parameters' bytes on the host and swaps each parameter's ``.data`` between
the host copy and a device copy (the parameter object stays the same, so the
optimizer and autograd's gradient accumulators keep pointing at it).
Gradients follow the parameters.  Saved views of parameters are stored as
``(parameter, view geometry)`` and rebuilt from the parameter's current
bytes, so an offloaded stage's graph does not pin the old device copy.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from zeropipe.base.device import Copier, peak_allocated_bytes, reset_peak_bytes
from zeropipe.base.storage import StorageKey, distinct_bytes, movable, storage_key
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.runtime.memory.offload import Saved, SavedActivations, StageWeights

if TYPE_CHECKING:
    from zeropipe.runtime.step.stage import MicrobatchState, Stage

__all__ = [
    "MemoryManager",
    "MemoryReport",
    "is_recomputing",
    "kept_buffers",
    "measured_costs",
    "recomputing",
]

# A flag, not a store: it carries no data, is set only for the duration of
# one R action by `recomputing()` and reset on exit (even on error), and a
# ContextVar is private to its thread / task, so concurrent pipelines do not
# see each other's recomputations.
_RECOMPUTING: ContextVar[bool] = ContextVar("zeropipe_recomputing", default=False)


def is_recomputing() -> bool:
    """True while an R action re-runs a checkpointed forward (so layers can skip side effects)."""
    return _RECOMPUTING.get()


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the block as a recomputation for :func:`is_recomputing`."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


@contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Leave ``module``'s buffers (values and objects) as the block found them.

    R runs a forward that F already ran: its buffer updates would count the
    microbatch twice.  Every buffer is copied (there is no cheap way to know
    which ones a forward touches; they are small next to the activations R
    rebuilds) and put back through ``.data``, so that the restore is not an
    in-place change for autograd: BatchNorm saves its running statistics for
    backward, and its kernel updates them without bumping their version, so
    a visible copy would fail R's own backward.  A buffer the block rebound
    to a new tensor gets its old object back.  No buffers: nothing is done.
    """
    kept = [
        (owner, name, buf, buf.detach().clone())
        for owner in module.modules()  # per owner, to undo a rebinding
        for name, buf in owner.named_buffers(recurse=False)
    ]
    try:
        yield
    finally:
        for owner, name, buf, copy in kept:
            if getattr(owner, name, None) is not buf:
                setattr(owner, name, buf)
            buf.data.copy_(copy)


# --- accounting ---------------------------------------------------------------------------


class KnownCount:
    """A forward whose saved bytes an earlier forward on inputs of the same signature counted.

    It runs without saved-tensor hooks, so nothing is tracked and nothing can be
    offloaded; it stands where a :class:`SavedActivations` would, at no cost per step.
    """

    counted = False
    signature: Hashable = None
    host_nbytes = 0

    def __init__(self, where: str, nbytes: int) -> None:
        self.where = where
        self.nbytes = nbytes

    def hooks(self) -> AbstractContextManager[None]:
        return nullcontext()

    def seal(self, boundary: Iterable[Tensor]) -> int:
        return self.nbytes

    def offload(self) -> None:
        raise PipelineError(
            f"{self.where}: this forward ran without saved-tensor hooks (its bytes were "
            f"known), so its activations cannot be offloaded"
        )

    def reload(self) -> None:
        """Nothing was offloaded."""

    def release(self) -> None:
        """Nothing is held."""


@dataclass(frozen=True)
class MemoryReport:
    """Per rank peaks of the last training step, in bytes (0 for ranks another process runs).

    ``saved``: saved activations; ``total``: saved activations plus resident
    parameters; ``weights``: resident parameters; ``host``: activations parked
    in host memory; ``allocated``: the device allocator's peak (None on CPU);
    ``recomputations``: R actions run.
    """

    saved: tuple[int, ...]
    total: tuple[int, ...]
    weights: tuple[int, ...]
    host: tuple[int, ...]
    allocated: int | None
    recomputations: int


class MemoryManager:
    """Per pipeline: the copy engine, the weight homes, and each step's byte accounting.

    Built by :class:`~zeropipe.runtime.pipeline.Pipeline`; the action handlers
    call it with the stage, microbatch and state they act on.  Nothing here
    outlives the pipeline.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, Stage],
        all_stages: Sequence[Stage],
        device: torch.device | None = None,
        count_saved: Literal["once", "always"] = "once",
    ) -> None:
        self.placement = schedule.placement
        self.num_ranks = schedule.num_ranks
        self.stages = stages
        first: dict[int, Kind] = {}
        for acts in schedule.actions:
            for a in acts:
                if a.is_weight_copy and a.stage in stages:
                    first.setdefault(a.stage, a.kind)
        self._fixed = device is not None or bool(first)
        self.device = device if device is not None else _device_of(stages, set(first))
        self.copier = Copier(self.device)
        self.weights: dict[int, StageWeights] = {}
        for s, stage in stages.items():
            kind = first.get(s)
            if kind is not None:
                others = [
                    p for other in all_stages if other is not stage for p in other.parameters()
                ]
                home = StageWeights(stage.parameters(), self.copier, index=s, shared=others)
                if kind is Kind.RELOAD:
                    home.start_offloaded()
                self.weights[s] = home
            elif device is not None:
                stage.module.to(device)  # resident all along: on the compute device
        self._param_bytes = {s: distinct_bytes(st.parameters()) for s, st in stages.items()}
        # Stages hooked on every forward: ``count_saved="always"``, or stages whose
        # activations or weights move (offload needs the handles; a saved view of an
        # offloaded weight must not pin the device copy).
        self._always = (
            set(stages)
            if count_saved == "always"
            else {
                a.stage
                for acts in schedule.actions
                for a in acts
                if a.kind in (Kind.OFFLOAD, Kind.RELOAD)
            }
        )
        # (stage, input signature) -> bytes its forward saved: kept across steps.
        self._counts: dict[tuple[int, Hashable], int] = {}
        zero = (0,) * self.num_ranks
        self.report = MemoryReport(zero, zero, zero, zero, None, 0)
        self._reset()

    # -- one step --------------------------------------------------------------------------
    def _reset(self) -> None:
        self._held: dict[tuple[int, int], int] = {}
        self._host: dict[tuple[int, int], int] = {}
        self._saved = [0] * self.num_ranks
        self._host_level = [0] * self.num_ranks
        self._weights = [0] * self.num_ranks
        for s, nbytes in self._param_bytes.items():
            home = self.weights.get(s)
            if home is None or home.resident:
                self._weights[self.placement[s]] += nbytes
        self._peak_saved = [0] * self.num_ranks
        self._peak_total = list(self._weights)
        self._peak_weights = list(self._weights)
        self._peak_host = [0] * self.num_ranks
        self._keep: frozenset[StorageKey] = frozenset()
        self._stage_keys: dict[int, frozenset[StorageKey]] = {}
        self._recomputations = 0
        self.act: dict[int, int] = {}  # per stage: most bytes a full forward saved
        self.act_w: dict[int, int] = {}  # per stage: most bytes a stash held from I to W

    def step_device(self) -> torch.device:
        """The device this step computes on (re-read from the parameters unless fixed)."""
        if not self._fixed:
            device = _device_of(self.stages, set())
            if device != self.device:
                self.device, self.copier = device, Copier(device)
        return self.device

    def begin_step(
        self, inputs: Sequence[Sequence[Tensor]], targets: Sequence[Tensor] | None
    ) -> None:
        """A training step starts: reset the accounting; note the caller's tensors."""
        self._reset()
        external = [t for mb in inputs for t in mb] + list(targets or ())
        self._keep = frozenset(storage_key(t) for t in external if movable(t))
        reset_peak_bytes(self.device)

    def end_step(self, publish: bool = True) -> None:
        """Wait for outstanding copies; publish the step's peaks as :attr:`report`."""
        self.copier.synchronize()
        if not publish:
            return
        self.report = MemoryReport(
            tuple(self._peak_saved),
            tuple(self._peak_total),
            tuple(self._peak_weights),
            tuple(self._peak_host),
            peak_allocated_bytes(self.device),
            self._recomputations,
        )

    # -- hooks the handlers call -----------------------------------------------------------
    def saving(self, s: int, i: int, inputs: Sequence[Tensor]) -> Saved:
        """A fresh container for (s, i)'s saved tensors (use its ``hooks()`` around the forward).

        If stage ``s`` already counted a forward on inputs like ``inputs`` (and
        is not always counted), a :class:`KnownCount` carries that count and no hooks.
        """
        where = f"stage {s} microbatch {i}"
        if s not in self._always:
            signature = tuple((t.shape, t.dtype, t.device) for t in inputs)
            known = self._counts.get((s, signature))
            if known is not None:
                return KnownCount(where, known)
        else:
            signature = None
        keep = self._stage_keys.get(s)
        home = self.weights.get(s)
        if keep is None:
            stage = self.stages[s]
            weights = [*stage.module.parameters(), *stage.module.buffers()]
            keep = frozenset(storage_key(t) for t in weights if movable(t)) | self._keep
            if home is None:
                # Weights that never move keep their storages all step; an offloaded
                # stage's change, and a freed address may be reused by an activation.
                self._stage_keys[s] = keep
        params = home.keys() if home is not None else {}
        return SavedActivations(where, self.copier, keep, params, signature=signature)

    def before_compute(self, s: int) -> None:
        """A compute action of stage ``s`` is about to run: its weights must have arrived."""
        home = self.weights.get(s)
        if home is not None:
            if not home.resident:
                raise PipelineError(
                    f"stage {s} runs a compute action while its weights are offloaded; "
                    f"the schedule must RELOAD them first"
                )
            home.ready()

    def after_forward(self, s: int, i: int, state: MicrobatchState, recompute: bool) -> None:
        """F or R of (s, i) finished: what does it hold?"""
        if recompute:
            self._recomputations += 1
        if state.saved is None:  # checkpointed forward: nothing saved
            self._set(s, i, 0)
            return
        boundary = [*state.inputs, *state.outputs]
        nbytes = state.saved.seal(boundary)
        if state.saved.counted and state.saved.signature is not None:
            self._counts[(s, state.saved.signature)] = nbytes
        self.act[s] = max(self.act.get(s, 0), nbytes)
        self._set(s, i, nbytes)

    def after_backward(self, s: int, i: int, state: MicrobatchState, kind: Kind) -> None:
        """B, I or W of (s, i) finished: after I the stash holds what W needs; else nothing."""
        if state.saved is not None:
            state.saved.release()
            state.saved = None
        if kind is Kind.I and state.stash is not None:
            nbytes = state.stash.nbytes
            self.act_w[s] = max(self.act_w.get(s, 0), nbytes)
            self._set(s, i, nbytes)
        else:
            self._set(s, i, 0)

    def offload_weights(self, s: int) -> None:
        """OFFLOAD of stage ``s``'s weights: point its parameters at their host copy."""
        home = self._weight_home(s)
        if home.resident:  # (a repeated OFFLOAD, after a failed step, moves nothing)
            self._weights[self.placement[s]] -= self._param_bytes[s]
        home.offload()

    def reload_weights(self, s: int) -> None:
        """RELOAD of stage ``s``'s weights: start copying them to the device."""
        home = self._weight_home(s)
        if not home.resident:
            self._weights[self.placement[s]] += self._param_bytes[s]
        home.reload()
        self._peak(self.placement[s])

    def offload_activations(self, s: int, i: int, state: MicrobatchState) -> None:
        """OFFLOAD of (s, i)'s saved activations to host memory."""
        if state.saved is not None:
            state.saved.offload()
            self._host_set(s, i, state.saved.host_nbytes)
            self._set(s, i, state.saved.nbytes)
        else:
            self._set(s, i, 0)

    def reload_activations(self, s: int, i: int, state: MicrobatchState) -> None:
        """RELOAD of (s, i)'s saved activations (asynchronous where there is a copy stream)."""
        if state.saved is not None:
            state.saved.reload()
            self._host_set(s, i, 0)
            self._set(s, i, state.saved.nbytes)

    def _weight_home(self, s: int) -> StageWeights:
        home = self.weights.get(s)
        if home is None:
            raise PipelineError(
                f"stage {s}: its weights are not offloaded by this process (it does not run "
                f"stage {s}, or the schedule has no weight OFFLOAD/RELOAD for it)"
            )
        return home

    # -- the ledger ------------------------------------------------------------------------
    def _set(self, s: int, i: int, nbytes: int) -> None:
        r = self.placement[s]
        self._saved[r] += nbytes - self._held.get((s, i), 0)
        self._held[(s, i)] = nbytes
        self._peak(r)

    def _host_set(self, s: int, i: int, nbytes: int) -> None:
        r = self.placement[s]
        self._host_level[r] += nbytes - self._host.get((s, i), 0)
        self._host[(s, i)] = nbytes
        self._peak_host[r] = max(self._peak_host[r], self._host_level[r])

    def _peak(self, r: int) -> None:
        self._peak_saved[r] = max(self._peak_saved[r], self._saved[r])
        self._peak_total[r] = max(self._peak_total[r], self._saved[r] + self._weights[r])
        self._peak_weights[r] = max(self._peak_weights[r], self._weights[r])

    def stage_bytes(self) -> dict[int, tuple[int, int, int]]:
        """Per stage run here: (act, act_w, parameter bytes) as the last training step measured."""
        return {
            s: (self.act.get(s, 0), self.act_w.get(s, 0), self._param_bytes[s]) for s in self.stages
        }


def _device_of(stages: dict[int, Stage], offloaded: set[int]) -> torch.device:
    """Where the stages compute: their parameters' device, offloaded stages' last."""
    order = sorted(stages, key=lambda s: s in offloaded)
    for s in order:
        for p in stages[s].parameters():
            return p.device
    return torch.device("cpu")


# --- predicted vs measured ----------------------------------------------------------------


def measured_costs(
    schedule: Schedule,
    stage_bytes: Mapping[int, tuple[int, int, int]],
    base: CostModel | None = None,
    *,
    weights: bool = False,
) -> CostModel:
    """A cost model in bytes whose memory figures are those a pipeline's last step measured.

    ``stage_bytes`` is :meth:`MemoryManager.stage_bytes` of the pipeline that
    ran ``schedule``: per stage, (act, act_w, parameter bytes).

    Per stage ``act`` = the most bytes a full forward (F or R) saved, ``act_w``
    = the most a split-backward stash held from I to W, ``ckpt`` = 0 (a
    checkpointed forward saves nothing beyond its boundary tensors), and, with
    ``weights``, ``weights`` = the stage's parameter bytes.  Times come from
    ``base`` (default: uniform).  Stages that never ran a full forward keep
    ``act = 0``: calibrate on a schedule without recomputation.
    """
    if base is None:
        base = CostModel.uniform_for(schedule)
    base.for_stages(schedule.num_stages)
    stages = list(base.stages)
    for s, (act, act_w, param_bytes) in stage_bytes.items():
        stages[s] = replace(
            stages[s],
            act=float(act),
            act_w=float(act_w),
            ckpt=0.0,
            weights=float(param_bytes) if weights else 0.0,
        )
    return replace(base, stages=tuple(stages), unit="bytes")
