"""The action handlers: one function per action kind, in one dispatch table.

The executors walk a schedule and call ``HANDLERS[action.kind](ctx, action)``;
an unknown kind is a :class:`~zeropipe.core.errors.PipelineError`, and a new kind
means a new entry here, not a new branch in a loop.  Data flow between
stages (same rank: hand the tensor over; other rank: through the transport)
follows the dependency model in :mod:`zeropipe.core.deps`.

A full backward B whose stage-input gradient goes upstream produces that gradient
first and sends it at once (:func:`backward_input_first`): the upstream rank waits for
it, while parameter-only work (weight transposes, side branches such as a bias or norm
that feeds nothing else) can run after it.  A post-accumulate-grad hook on the input
leaves posts the SEND_B the moment every input gradient exists -- still inside
``backward`` -- so the send overlaps the remaining parameter work; optionally the nodes
on paths to the inputs also run first (:func:`zeropipe.autograd.priority.prioritize_toward`)::

    outputs --> ... --> Linear1 --> x (stage input)      x.grad ready -> on_ready(x.grad) -> isend
                 \\--> weight-only nodes                  run after, overlapping the send
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.autograd.priority import prioritize_toward
from zeropipe.autograd.split_backward import WeightGradStash, weight_backward_together
from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind
from zeropipe.runtime.memory.manager import MemoryManager, kept_buffers, recomputing
from zeropipe.runtime.replicas.data_parallel import GradReducer
from zeropipe.runtime.step.loss_contract import StepLoss
from zeropipe.runtime.step.stage import MicrobatchState, Stage, detach_for_stage
from zeropipe.runtime.transport.base import Transport

__all__ = ["HANDLERS", "BoundaryMeta", "StepContext", "backward_input_first"]


class BoundaryMeta:
    """Shapes and dtypes of each stage's outputs, learnt on first use and then checked."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}

    def reset(self) -> None:
        self._known.clear()

    def check(self, stage: int, mb: int, tensors: Sequence[Tensor]) -> None:
        got = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if (stage, mb) not in self._known:
            _refuse_dtensors(stage, tensors)
        expected = self._known.setdefault((stage, mb), got)
        if got != expected:
            raise PipelineError(
                f"stage {stage} microbatch {mb}: boundary output mismatch: expected "
                f"{_describe(expected)}, got {_describe(got)} (shapes and dtypes crossing a stage "
                f"boundary must stay the same from step to step)"
            )


def _refuse_dtensors(stage: int, tensors: Sequence[Tensor]) -> None:
    """A stage boundary carries plain tensors: a DTensor output is refused, naming the fix."""
    for k, t in enumerate(tensors):
        placements = getattr(t, "placements", None)
        if placements is not None:
            raise PipelineError(
                f"stage {stage} returned a DTensor (output {k}, placements {tuple(placements)}); "
                f"stage boundaries carry this rank's plain tensor: let the stage's last parallel "
                f"style return its local shard (use_local_output=True, e.g. "
                f"RowwiseParallel(output_layouts=Shard(1), use_local_output=True)) and the next "
                f"stage's first rebuild it (SequenceParallel, ColwiseParallel(input_layouts="
                f"Shard(1)) or PrepareModuleInput do)"
            )


def _describe(meta: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in meta)


@dataclass
class StepContext:
    """Everything one step's handlers share.  Built fresh per step by the pipeline."""

    step: int
    seed: int
    training: bool
    stages: dict[int, Stage]  # the stages this process runs
    deps: Dependencies
    transport: Transport
    boundary: BoundaryMeta
    inputs: list[tuple[Tensor, ...]]  # per microbatch, into stage 0
    targets: list[Tensor] | None  # per microbatch, for the loss
    # Per microbatch: what seeds its backward, so that the step's loss and gradients are the
    # whole batch's (see zeropipe.runtime.step.loss_contract); the step's loss is sum(weights[i] * losses[i]).
    weights: list[float]
    loss: StepLoss | None  # None: the pipeline has no loss_fn
    device: torch.device
    losses: dict[int, Tensor] = field(default_factory=dict)  # unweighted (a sum or a mean)
    outputs: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)  # eval, last stage
    memory: MemoryManager | None = None  # saved-activation accounting, offload, weight homes
    input_first: bool = True  # B: input gradient first, its send posted at once
    grad_memory: GradMemory | None = None  # weight-gradient memory kept between steps
    # W actions whose rank runs a W of the same stage next: they run together with it.
    fused_weights: frozenset[Action] = frozenset()
    pending_weights: dict[int, list[int]] = field(default_factory=dict)  # stage -> microbatches
    waited: dict[Kind, float] = field(default_factory=dict)  # seconds blocked in RECV_F / RECV_B
    blocked: float = 0.0  # the same, all kinds together: the executor's per-action waits
    # Posts REDUCE_GRAD's all-reduce over the data-parallel group; None: no such group
    # (or one of one process), where a stage's gradients are already the batch's.
    reducer: GradReducer | None = None
    # This replica's first microbatch in the global batch: what dropout and other
    # randomness are seeded by, so that replicas draw differently.
    first_microbatch: int = 0
    # Runs an overlapped pair's backward half beside its forward, returning at once an event
    # set when it is done (the pipeline's ``pairs.PairWorker.submit``); None: each pair's
    # halves one after the other.
    beside: Callable[[Callable[[], None]], threading.Event] | None = None

    def receive(self, action: Action) -> tuple[Tensor, ...]:
        """Wait for a posted receive, counting the time blocked."""
        start = time.perf_counter()
        data = self.transport.wait_recv(action)
        took = time.perf_counter() - start
        self.waited[action.kind] = self.waited.get(action.kind, 0.0) + took
        self.blocked += took
        return data

    def last(self, mb: int) -> int:
        """The stage that computes ``mb``'s loss: the last of its route."""
        return self.deps.last_stage(mb)

    def state(self, stage: int, mb: int) -> MicrobatchState:
        try:
            return self.stages[stage].state[mb]
        except KeyError:
            raise PipelineError(
                f"stage {stage} microbatch {mb} has no forward state here"
            ) from None


def _forward(ctx: StepContext, action: Action) -> None:
    s, i = action.stage, _mb(action)
    if s == ctx.deps.first_stage(i):
        inputs = ctx.inputs[i]
    elif not ctx.deps.crosses(s - 1, s):
        inputs = detach_for_stage(ctx.state(s - 1, i).outputs)
    else:
        inputs = detach_for_stage(ctx.receive(Action(Kind.RECV_F, s, i)))
    if not ctx.training:
        inputs = tuple(t.detach() for t in inputs)
    state = MicrobatchState(inputs=inputs)
    ctx.stages[s].state[i] = state
    # A checkpointed forward keeps only its inputs (and outputs, to send on); R redoes it.
    checkpointed = ctx.training and ctx.deps.checkpointed(s, i)
    _run_forward(ctx, s, i, state, grad=ctx.training and not checkpointed)
    if s < ctx.last(i):
        ctx.boundary.check(s, i, state.outputs)


def _recompute(ctx: StepContext, action: Action) -> None:
    """R: the checkpointed forward again, with grad, the same seeds, and the split stash.

    F already updated the stage's buffers (running statistics) for this
    microbatch; R puts them back as it found them.
    """
    s, i = action.stage, _mb(action)
    state = ctx.state(s, i)
    with recomputing(), kept_buffers(ctx.stages[s].module):
        _run_forward(ctx, s, i, state, grad=True, recompute=True)


def _run_forward(
    ctx: StepContext, s: int, i: int, state: MicrobatchState, *, grad: bool, recompute: bool = False
) -> None:
    """The stage's forward (and, on the last stage, the loss) for F and R."""
    stage = ctx.stages[s]
    if ctx.memory is not None:
        ctx.memory.before_compute(s)
    # Every forward with grad records for split backward: I and W use it, and so
    # does B, which runs as I, the input gradient's send, then W (see _backward).
    # Linears the pipeline left plain (small ones, on a stage that only runs B) get
    # their weight gradients from autograd, inside I or B.
    stash = WeightGradStash(stage=s, microbatch=i, grad_memory=ctx.grad_memory) if grad else None
    saved = ctx.memory.saving(s, i, state.inputs) if grad and ctx.memory is not None else None
    last = s == ctx.last(i) and ctx.targets is not None
    # Only the contexts that change something are entered: each costs a few microseconds
    # per action, which on small stages is a visible share of the step.
    with (
        torch.set_grad_enabled(grad) if grad != torch.is_grad_enabled() else nullcontext(),
        stash.recording(stage.module, stage.linears)
        if stash is not None and stage.linears != ()
        else nullcontext(),
        saved.hooks() if saved is not None and saved.counted else nullcontext(),
    ):
        outputs = stage.forward(
            state.inputs, ctx.seed, ctx.step, ctx.first_microbatch + i, ctx.device
        )
        loss = _loss(ctx, outputs, i) if last else None
    state.stash, state.saved = stash, saved
    if loss is None:
        state.outputs = outputs
        if s == ctx.last(i):
            ctx.outputs[i] = tuple(t.detach() for t in outputs)
    else:
        if not recompute:
            ctx.losses[i] = loss.detach().reshape(())
        # The root of this microbatch's backward; its weight seeds the backward (_backward)
        # instead of being one more autograd node here.
        state.loss, state.outputs = (loss if grad else None), ()
    if ctx.memory is not None and ctx.training:
        ctx.memory.after_forward(s, i, state, recompute)


def _loss(ctx: StepContext, outputs: tuple[Tensor, ...], i: int) -> Tensor:
    """Microbatch ``i``'s loss, unweighted; ``ctx.weights[i]`` makes it the batch's share."""
    if ctx.loss is None or ctx.targets is None:
        raise PipelineError("a target was given but the pipeline has no loss_fn")
    return ctx.loss.compute(outputs[0] if len(outputs) == 1 else outputs, ctx.targets[i], i)


def _backward(ctx: StepContext, action: Action) -> None:
    s, i = action.stage, _mb(action)
    state = ctx.state(s, i)
    if ctx.memory is not None:
        ctx.memory.before_compute(s)
    if s == ctx.last(i):
        if state.loss is None:
            raise PipelineError(f"{action}: the last stage has no loss to differentiate")
        roots: list[Tensor] = [state.loss]
        # d(weight x loss)/d(loss) = weight: the same seed autograd would give a product.
        grads: list[Tensor | None] = [torch.full_like(state.loss, ctx.weights[i])]
    else:
        if not ctx.deps.crosses(s + 1, s):
            downstream = ctx.state(s + 1, i)
            incoming: Sequence[Tensor | None] = downstream.input_grads or ()
            downstream.input_grads = None
            _release(ctx, s + 1, i, done="")
        else:
            incoming = ctx.receive(Action(Kind.RECV_B, s, i))
        roots, grads = [], []
        differentiable = [t for t in state.outputs if _carries_grad(t)]
        if len(incoming) != len(differentiable):
            raise PipelineError(
                f"{action}: got {len(incoming)} gradient(s) for {len(differentiable)} floating-point "
                f"output(s) of stage {s}"
            )
        for out, g in zip(differentiable, incoming, strict=True):
            if g is not None and out.requires_grad:
                roots.append(out)
                grads.append(g)
    if state.stash is None:
        raise PipelineError(f"{action}: the forward was not recorded for backward")
    early = action.kind is Kind.B and s > ctx.deps.first_stage(i) and ctx.deps.crosses(s - 1, s)
    if roots:
        if ctx.input_first and early:
            _input_backward_first(ctx, state, Action(Kind.SEND_B, s, i), roots, grads)
        else:
            state.stash.input_backward(roots, grads)
    if not roots:  # no gradient reached this stage's outputs: nothing to defer
        state.stash.clear()
        state.stash = None
    elif action.kind is Kind.B:
        # B = I + W in one action: the input gradient exists (and is on its way
        # upstream) before any weight gradient is computed, and W adds into
        # .grad in one fused step, cheaper than autograd's compute-then-add.
        state.stash.weight_backward()
        state.stash = None
    if s > ctx.deps.first_stage(i):
        # An input the stage ignored has no gradient; upstream still expects one.
        state.input_grads = tuple(
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in state.inputs
            if _carries_grad(t)
        )
    state.inputs, state.outputs, state.loss = (), (), None
    if ctx.memory is not None:
        ctx.memory.after_backward(s, i, state, action.kind)
    _release(ctx, s, i, done="W" if action.kind is Kind.B else "I")


def _input_backward_first(
    ctx: StepContext,
    state: MicrobatchState,
    send: Action,
    roots: list[Tensor],
    grads: list[Tensor | None],
) -> None:
    """I of a B whose input gradient goes upstream: marked first, and sent from inside.

    The early send is posted only when the gradient hook runs on this thread
    (CPU autograd); an accelerator's backward runs on the engine's device
    thread, where communication must not be issued, and then SEND_B posts it.
    """
    me = threading.get_ident()
    floats = [t for t in state.inputs if _carries_grad(t)]
    stash = state.stash
    assert stash is not None  # checked by the caller

    def ready(input_grads: tuple[Tensor, ...]) -> None:
        if threading.get_ident() == me and len(input_grads) == len(floats):
            ctx.transport.send(send, input_grads)
            state.sent_early = True

    # Not prioritized: with split backward the weight products are deferred to W, so
    # what I runs besides the input path is only small parameter work (norms, biases),
    # while marking walks the whole stage graph -- about a millisecond per B on a
    # transformer block, more than it could save.
    backward_input_first(roots, grads, floats, ready, prioritized=False, run=stash.input_backward)


def backward_input_first(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    on_ready: Callable[[tuple[Tensor, ...]], None],
    *,
    prioritized: bool = True,
    run: Callable[[list[Tensor], list[Tensor | None]], None] | None = None,
) -> bool:
    """Backward of ``roots``; ``on_ready(input grads)`` as soon as they all exist.

    Returns whether ``on_ready`` was called (it is not when some input gets no
    gradient at all; the caller then sends zeros itself after backward).
    ``run(roots, grads)`` is the backward to run (default: plain autograd; the
    runtime passes a split stash's input backward).
    """
    leaves = [t for t in inputs if t.requires_grad and t.grad_fn is None]
    if not roots:
        return False
    if prioritized and leaves:
        prioritize_toward(list(roots), leaves)
    waiting = {id(t) for t in leaves}
    fired = False

    def hook(t: Tensor) -> None:
        nonlocal fired
        waiting.discard(id(t))
        if not waiting and not fired:
            fired = True
            on_ready(tuple(x.grad for x in leaves if x.grad is not None))

    handles = [t.register_post_accumulate_grad_hook(hook) for t in leaves]
    try:
        (run or torch.autograd.backward)(list(roots), list(grads))
    finally:
        for h in handles:
            h.remove()
    return fired and len(leaves) == len(inputs)


def _weight(ctx: StepContext, action: Action) -> None:
    s, i = action.stage, _mb(action)
    state = ctx.state(s, i)
    if state.stash is None and "I" not in state.seen:
        raise PipelineError(f"{action}: no deferred weight gradients (was the forward split?)")
    if action in ctx.fused_weights:
        # The next compute action of this rank is a W of the same stage: both become one
        # product per weight there, which reads and writes each weight gradient once.
        ctx.pending_weights.setdefault(s, []).append(i)
        return
    if ctx.memory is not None:
        ctx.memory.before_compute(s)
    group = [*ctx.pending_weights.pop(s, []), i]
    states = [ctx.state(s, k) for k in group]
    weight_backward_together([st.stash for st in states if st.stash is not None])
    for k, st in zip(group, states, strict=True):
        st.stash = None
        if ctx.memory is not None:
            ctx.memory.after_backward(s, k, st, action.kind)
        _release(ctx, s, k, done="W")


def _send(ctx: StepContext, action: Action) -> None:
    s, i = action.stage, _mb(action)
    state = ctx.state(s, i)
    if action.kind is Kind.SEND_F:
        tensors = tuple(t.detach() for t in state.outputs)
    else:
        if state.input_grads is None:
            raise PipelineError(f"{action}: stage {s} has no input gradient for microbatch {i} yet")
        tensors = state.input_grads
        state.input_grads = None
        _release(ctx, s, i, done="")
        if state.sent_early:  # posted from inside B the moment it existed
            return
    ctx.transport.send(action, tensors)


def _recv(ctx: StepContext, action: Action) -> None:
    ctx.transport.post_recv(action)


def _offload(ctx: StepContext, action: Action) -> None:
    """OFFLOAD: (s, i)'s saved activations, or stage s's weights, to host memory."""
    memory = _memory(ctx, action)
    s, i = action.stage, action.microbatch
    if i is None:
        memory.offload_weights(s)
    else:
        memory.offload_activations(s, i, ctx.state(s, i))


def _reload(ctx: StepContext, action: Action) -> None:
    """RELOAD: bring them back (asynchronously where the device has a copy stream)."""
    memory = _memory(ctx, action)
    s, i = action.stage, action.microbatch
    if i is None:
        memory.reload_weights(s)
    else:
        memory.reload_activations(s, i, ctx.state(s, i))


def _reduce_grad(ctx: StepContext, action: Action) -> None:
    """REDUCE_GRAD: stage s's gradients are final on this rank; reduce them across replicas."""
    if ctx.reducer is not None and ctx.training:
        ctx.reducer.post(action.stage)


def _memory(ctx: StepContext, action: Action) -> MemoryManager:
    if ctx.memory is None:
        raise PipelineError(f"{action}: this step has no memory manager (build it with Pipeline)")
    return ctx.memory


def _mb(action: Action) -> int:
    if action.microbatch is None:
        raise PipelineError(f"{action} needs a microbatch")
    return action.microbatch


def _carries_grad(t: Tensor) -> bool:
    return torch.is_floating_point(t) or t.is_complex()


def _release(ctx: StepContext, s: int, i: int, done: str) -> None:
    state = ctx.stages[s].state.get(i)
    if state is None:
        return
    if done:
        state.seen.add(done)
    finished = "W" in state.seen and state.stash is None and state.input_grads is None
    if finished:
        del ctx.stages[s].state[i]


HANDLERS: dict[Kind, Callable[[StepContext, Action], None]] = {
    Kind.F: _forward,
    Kind.B: _backward,
    Kind.I: _backward,
    Kind.W: _weight,
    Kind.SEND_F: _send,
    Kind.SEND_B: _send,
    Kind.RECV_F: _recv,
    Kind.RECV_B: _recv,
    Kind.R: _recompute,
    Kind.OFFLOAD: _offload,
    Kind.RELOAD: _reload,
    Kind.REDUCE_GRAD: _reduce_grad,
}
