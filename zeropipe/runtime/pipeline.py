"""``zeropipe.Pipeline``: run a schedule on real modules, one training step per call.

    pipe = Pipeline(model, "zbv", F.cross_entropy, microbatches=8)   # one process per rank
    loss = pipe.step(tokens, targets)       # .grad filled as loss.backward() on the batch
    optimizer.step()

    schedule = zeropipe.build_schedule("zbv", ranks=2, microbatches=8, group_w=2)
    pipe = Pipeline(model, schedule, F.cross_entropy)                # any schedule, any rank count

Local (one process plays every rank) or distributed (one process per rank,
torch.distributed already initialised, e.g. by torchrun or zeropipe.launch):
the same schedule, the same handlers, the same gradients.  In the
distributed case every rank builds the whole model and calls ``step`` with
the same batch; each keeps only the stages placed on it.

The schedule, built by :func:`zeropipe.core.passes.build.build_schedule` or searched by
:func:`zeropipe.planning.plan.auto_plan`, runs exactly as built.  Everything else a
pipeline is made of -- stages, transport, memory manager, reducer -- is built once, by
:func:`zeropipe.runtime.parts.build_parts`, into one frozen
:class:`~zeropipe.runtime.parts.Parts`.  One step, all in this file but the walk::

    step -> _prepare   the batch cut into microbatches (step/stage.py), their loss weights
                       (step/loss_contract.py), the StepContext
         -> _execute   the executor walks the schedule (step/executor.py), calling one
                       handler per action (step/handlers.py); the step ends on every rank
         -> _finish    the gradient sums no REDUCE_GRAD made; the loss (or the outputs)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.simulate import Event, Timeline
from zeropipe.runtime.memory.manager import MemoryManager, measured_costs
from zeropipe.runtime.options import RuntimeOptions
from zeropipe.runtime.parts import Parts, build_parts, checking_call
from zeropipe.runtime.replicas.data_parallel import Replicas, reductions_as_run
from zeropipe.runtime.replicas.fsdp import ShardedReducer
from zeropipe.runtime.replicas.grad_sums import (
    add_back,
    clip_grads,
    counted_once,
    loss_over_route_ends,
    reduce_shared,
    refuse_split_hooks,
    set_aside,
)
from zeropipe.runtime.step.executor import run_local, run_rank
from zeropipe.runtime.step.handlers import BoundaryMeta, StepContext
from zeropipe.runtime.step.loss_contract import LossContract, LossCountFn, LossFn
from zeropipe.runtime.step.stage import (
    Microbatches,
    Outputs,
    Stage,
    preserved_rng,
    step_microbatches,
)
from zeropipe.runtime.transport.base import Transport

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Batch", "Pipeline", "RuntimeOptions", "forward_only"]

Batch = Tensor | Sequence[Tensor] | Mapping[str, Tensor]
"""A step's inputs: a tensor, a tuple of tensors (the first stage's positional inputs), or a
dict of tensors (its keyword inputs, e.g. a split Hugging Face model's ``input_ids``,
``attention_mask`` and ``position_ids``); each cut into microbatches along dim 0."""


class Pipeline:
    """A model cut into stages and run under a schedule.

    Args:
        stages: an ``nn.Sequential`` (cut into the schedule's stages, by
            ``balance`` = layers per stage, or evenly) or one module per stage
            (:func:`zeropipe.split` cuts supported models).
        schedule: a :class:`~zeropipe.core.ir.Schedule` (run exactly as given) or a
            generator name, built with ``microbatches`` and one rank per process of
            the pipeline's group (in one process: ``len(stages) / chunks``, and not
            one rank of several chunks, which a built schedule says); for
            other ranks, chunks or grouped W, :func:`zeropipe.build_schedule` it;
            :func:`zeropipe.auto_plan` searches one for the model.
        loss_fn: ``loss_fn(output, target)``, called per microbatch, such that the
            step's loss and gradients are the whole batch's: a torch loss module
            or ``F.cross_entropy`` / ``F.nll_loss`` (items counted from the
            targets), a function returning ``(loss_sum, count)`` with
            ``loss_count``, or a mean over its microbatch, weighted by rows.
            :mod:`zeropipe.runtime.step.loss_contract` says how each is weighted and refuses
            what cannot be exact (a mean over labels holding -100, say).
        microbatches: how many microbatches a batch is cut into, with a schedule name.
        loss_count: ``loss_count(target) -> count`` for a ``loss_fn`` returning
            ``(loss_sum, count)``: the count of a microbatch's target, so that the
            batch's total (which seeds every backward) is known before the first
            one; each microbatch's returned count is checked against it.
        balance: layers per stage when cutting an ``nn.Sequential``.
        mesh: where it runs: a ``DeviceMesh`` with a "pp" dimension and
            optionally "dp" (replicas, each stepping on its own slice of the
            global batch: :mod:`zeropipe.runtime.replicas.data_parallel`), the pipeline's
            ``ProcessGroup``, or ``"local"`` (this process plays every rank).
            Default: torch.distributed's default group if initialised, else local.
        options: how it runs (:class:`~zeropipe.runtime.options.RuntimeOptions`):
            seed, device, the point-to-point protocol, sharding over "dp",
            timeouts, autocast.
    """

    @checking_call
    def __init__(
        self,
        stages: nn.Sequential | Sequence[nn.Module],
        schedule: Schedule | str = "1f1b",
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        loss_count: LossCountFn | None = None,
        balance: Sequence[int] | None = None,
        mesh: DeviceMesh | ProcessGroup | Literal["local"] | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        self.parts: Parts = build_parts(
            stages,
            schedule,
            loss_fn,
            microbatches=microbatches,
            loss_count=loss_count,
            balance=balance,
            mesh=mesh,
            options=options,
        )
        # What the steps change: their count, the shapes they learnt, what the last one measured.
        self._step = 0
        self._signature: tuple[object, ...] | None = None  # the shapes `boundary` follows
        self.boundary = BoundaryMeta()
        self.last_events: list[list[Event]] = []
        # Seconds this process blocked in RECV_F / RECV_B during the last step.
        self.last_waits: dict[Kind, float] = {}
        # eval_step's forward-only schedule, its dependencies and graph: built once, on first use.
        self._eval_plan: tuple[Schedule, Dependencies, Graph] | None = None

    # -- the parts, read-only (Parts says what each is) ------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.parts.schedule

    @property
    def stages(self) -> dict[int, Stage]:
        return self.parts.stages

    @property
    def all_stages(self) -> list[Stage]:
        return self.parts.all_stages

    @property
    def rank(self) -> int:
        return self.parts.where.rank

    @property
    def distributed(self) -> bool:
        return self.parts.where.distributed

    @property
    def device(self) -> torch.device | None:
        return self.parts.device

    @property
    def loss(self) -> LossContract | None:
        return self.parts.loss

    @property
    def memory(self) -> MemoryManager:
        return self.parts.memory

    @property
    def transport(self) -> Transport:
        return self.parts.transport

    @property
    def replicas(self) -> Replicas | None:
        return self.parts.replicas

    @property
    def sharded(self) -> ShardedReducer | None:
        return self.parts.sharded

    @property
    def shared(self) -> list[nn.Parameter]:
        return self.parts.shared

    @property
    def fused_weights(self) -> frozenset[Action]:
        return self.parts.fused_weights

    @property
    def graph(self) -> Graph:
        return self.parts.graph

    @property
    def grad_memory(self) -> GradMemory | None:
        return self.parts.grad_memory

    # -- public surface -------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of the stages this process runs (what its optimizer should step)."""
        seen: dict[int, nn.Parameter] = {}
        for stage in self.parts.stages.values():
            for p in stage.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @property
    def steps_done(self) -> int:
        """Training steps run so far: with ``seed``, what dropout is seeded by.

        Set it when resuming (:func:`zeropipe.load_checkpoint` does), so that the
        steps after a resume draw the randomness an uninterrupted run would.
        """
        return self._step

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PipelineError(f"steps_done must be a whole number >= 0, got {value!r}")
        self._step = value

    @property
    def dp_size(self) -> int:
        """How many processes sum this pipeline's gradients: its data-parallel replicas (1
        without a ``dp_group``); with a "cp" dimension, its dp x cp processes, whose cp
        processes of a replica share one slice of the batch (:attr:`batch_slice`)."""
        return 1 if self.replicas is None else self.replicas.size

    @property
    def dp_rank(self) -> int:
        """This process's replica, ``0 .. dp_size - 1`` (with a "cp" dimension, among the dp
        x cp processes; the slice of the batch it feeds is :attr:`batch_slice`)."""
        return 0 if self.replicas is None else self.replicas.rank

    @property
    def batch_slice(self) -> tuple[int, int]:
        """``(index, count)``: this process feeds slice ``index`` of the global batch cut into
        ``count`` (``x.tensor_split(count)[index]``).  One slice per data-parallel replica;
        the cp processes of a replica share its slice (each shards the sequences itself);
        ``(0, 1)`` without replicas."""
        cp = self.parts.where.cp_size
        return self.dp_rank // cp, self.dp_size // cp

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Scale every gradient so that their global norm is at most ``max_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` on the unpipelined model: the norm
        is taken over the gradients of every stage on every pipeline rank (a
        parameter shared by several stages, such as a tied embedding, counted
        once), after the step has summed them across data-parallel replicas,
        so every rank and replica computes the same norm and scales alike.  A DTensor
        gradient (tensor parallelism, dp_shard) counts as the whole parameter's.
        Returns that norm (a float64 scalar on every rank).
        """
        if self.sharded is not None and self.sharded.shared_shapes:
            raise PipelineError(
                "clip_grad_norm_ with dp_shard=True and parameters shared across pipeline "
                "ranks (tied embeddings) is not supported yet: untie them, or clip without "
                "dp_shard"
            )
        counted = self.parameters()
        if self.distributed and self.shared:
            counted = counted_once(counted, self.all_stages, self.schedule.placement, self.rank)
        return clip_grads(
            self.parameters(),
            counted,
            max_norm,
            norm_type,
            error_if_nonfinite,
            self.transport.reduce_shared if self.distributed else None,
            self.schedule.num_ranks,
            self.rank,
        )

    def step(self, inputs: Batch | Microbatches, target: Tensor | None = None) -> Tensor:
        """One training step: forward and backward of every microbatch; returns the loss.

        ``inputs`` is the batch, cut into the pipeline's microbatches along dim 0 (and
        ``target`` with it), or a :class:`~zeropipe.runtime.step.stage.Microbatches` of
        microbatches already made, each its own shape, holding their targets.
        """
        if self.parts.loss is None:
            raise PipelineError("Pipeline(loss_fn=...) is needed for a training step")
        if (inputs.targets if isinstance(inputs, Microbatches) else target) is None:
            raise PipelineError(
                "a training step needs targets: pipe.step(inputs, target), or "
                "pipe.step(Microbatches(inputs=[...], targets=[...]))"
            )
        if self.parts.tied:
            refuse_split_hooks(self.parts.tied)  # a hook on a parameter of several stages
        loss = self._run(inputs, target, training=True)
        if not isinstance(loss, Tensor):
            raise PipelineError("the step produced no loss (the last stage never ran its forward)")
        return loss

    @torch.no_grad()
    def eval_step(
        self, inputs: Batch | Microbatches, target: Tensor | None = None
    ) -> Outputs | None:
        """Forward only: the loss if ``target`` is given, else the last stage's output.

        The output is a tensor, or a tuple when the last stage returns several; for
        :class:`~zeropipe.runtime.step.stage.Microbatches` (whose targets, when it holds
        some, give the loss) a list of those, one per microbatch.
        In a distributed pipeline it exists on the last stage's rank only (other
        ranks get ``None``); the loss is returned on every rank.
        """
        return self._run(inputs, target, training=False)

    def timeline(self) -> Timeline:
        """The measured timeline of the last step (this process's ranks), in seconds.

        Each event's ``wait`` is the time it spent blocked for received data
        (``last_waits`` sums them per receive kind); the bubble rates count it as idle.

        ``peak_memory`` is per rank, in bytes: saved activations plus resident
        parameters (compare with ``simulate(pipe.schedule, pipe.measured_costs(weights=True))``).
        """
        if not self.last_events:
            raise PipelineError("no step has run yet")
        events = self.last_events
        peaks = [float(b) for b in self.memory.report.total]
        return Timeline(
            self.schedule, events, peak_memory=peaks, memory_unit="bytes", measured=True
        )

    def measured_costs(self, base: CostModel | None = None, *, weights: bool = False) -> CostModel:
        """A cost model in bytes whose memory figures are those the last step measured.

        Times come from ``base`` (default: the schedule's default costs); see
        :func:`zeropipe.runtime.memory.manager.measured_costs`.
        """
        return measured_costs(self.schedule, self.memory.stage_bytes(), base, weights=weights)

    def release_grad_memory(self) -> None:
        """Stop keeping weight-gradient memory between steps; what ``.grad`` holds stays."""
        if self.grad_memory is not None:
            self.grad_memory.clear()

    @property
    def peak_saved_bytes(self) -> list[int]:
        """Per rank: the peak bytes of saved activations in the last training step."""
        return list(self.memory.report.saved)

    # -- one step -------------------------------------------------------------------
    def _forward_plan(self) -> tuple[Schedule, Dependencies, Graph]:
        if self._eval_plan is None:
            schedule = forward_only(self.parts.schedule)
            deps = Dependencies(schedule)
            self._eval_plan = (schedule, deps, Graph(schedule, deps))
        return self._eval_plan

    def _run(
        self, inputs: Batch | Microbatches, target: Tensor | None, training: bool
    ) -> Outputs | None:
        """One step: prepared, executed, finished; a failed one told to the peers."""
        parts = self.parts
        # In one process a failed step can be caught and the next batch run: the gradients
        # must then be those before the step, not some microbatches' worth added to them.
        # (A distributed failure ends the step on every rank, whose transport is then spent.)
        before = _grads_before(self.parameters()) if training and not self.distributed else []
        try:
            step = self._prepare(inputs, target, training)
            return self._finish(step, self._execute(step))
        except BaseException as exc:
            # A lost tensor-parallel peer: the error to raise is its, recorded before it left.
            cause = parts.transport.culprit(exc)
            # Peers may be blocked on this rank; the transport tells them why it stopped.
            parts.transport.fail(exc if cause is None else cause)
            if parts.replicas is not None:
                parts.replicas.fail(exc if cause is None else cause)
            _restore_grads(before)
            if cause is not None:
                raise cause from exc
            raise

    def _prepare(
        self, inputs: Batch | Microbatches, target: Tensor | None, training: bool
    ) -> _Step:
        """The batch cut into microbatches, their loss weights and the step's context.

        Also opens the step: the transport learns its shapes, the memory manager starts
        counting, and the gradients of earlier steps are set aside where the step's end
        sums some (so that the sums add only this step's).
        """
        parts = self.parts
        rows_weighted = parts.loss is not None and parts.loss.weighting == "rows"
        names, micro_inputs, sizes, targets, signature = step_microbatches(
            inputs, target, parts.schedule.microbatches, parts.device, rows_weighted
        )
        self._name_inputs(names)
        # Boundary shapes follow from the shapes of the step's inputs: learnt again when
        # those change (every rank sees the same batch, so every rank agrees).
        if self._signature != signature:
            self._signature = signature
            self.boundary.reset()
        replicas, rows = parts.replicas, sum(sizes)
        # Only the last stage computes the loss; its rank has the whole batch's targets, so
        # the weights (which may count items in every target) exist before any backward.
        step_loss = (
            parts.loss.for_step(targets, sizes, total=None if replicas is None else replicas.total)
            if parts.loss is not None and targets is not None and parts.owns_last
            else None
        )
        schedule, deps, graph = (
            (parts.schedule, parts.deps, parts.graph) if training else self._forward_plan()
        )
        parts.transport.start_step(schedule, signature, step=self._step)
        ctx = StepContext(
            step=self._step,
            seed=parts.options.seed,
            training=training,
            stages=parts.stages,
            deps=deps,
            transport=parts.transport,
            boundary=self.boundary,
            inputs=micro_inputs,
            targets=targets,
            weights=step_loss.weights if step_loss is not None else [n / rows for n in sizes],
            loss=step_loss,
            device=parts.memory.step_device(),
            memory=parts.memory,
            input_first=parts.options.input_first,
            grad_memory=parts.grad_memory if training else None,
            fused_weights=parts.fused_weights if training else frozenset(),
            reducer=parts.reducer if training else None,
            first_microbatch=0 if replicas is None else replicas.rank * schedule.microbatches,
            beside=parts.pairs.submit if parts.pairs is not None else None,
        )
        # Summed at the step's end: a replica's every parameter, a distributed pipeline's
        # shared ones; earlier steps' gradients on them are set aside meanwhile.
        summed = self.parameters() if replicas is not None else []
        if self.distributed:
            summed = [*summed, *parts.shared]
        held = training and any(p.grad is not None for p in summed)
        earlier = set_aside(summed) if held else {}
        if training:
            parts.memory.begin_step(micro_inputs, targets)
        return _Step(ctx, graph, earlier, given=isinstance(inputs, Microbatches))

    def _name_inputs(self, names: tuple[str, ...] | None) -> None:
        """A dict batch's names, for the first stage's call (on the rank that holds it)."""
        first = self.parts.stages.get(0)
        if first is None:
            return
        if names is not None and first.layer_keys is not None:
            raise PipelineError(
                f"a dict batch ({', '.join(names)}) is passed to the first stage by name, but "
                f"that stage is a slice of an nn.Sequential, whose layers take positional "
                f"inputs: pass a tensor or a tuple, or a first stage that takes those keywords "
                f"(a split Hugging Face model)"
            )
        first.input_names = names

    def _execute(self, step: _Step) -> Tensor | None:
        """Run the step's schedule; returns its loss (None without a target).

        The executor walks the schedule -- this rank's actions, or in one process every
        rank's in the graph's order -- and calls one handler per action.  Then the step
        ends on every rank: the reductions across replicas waited for, the transport's end
        of step (which gives every rank the loss), the loss summed over the replicas.
        """
        parts, ctx = self.parts, step.ctx
        schedule, sharded = step.graph.schedule, parts.sharded
        if sharded is not None:
            sharded.unshard()
        try:
            norms = parts.norms.step() if parts.norms is not None else nullcontext()
            with preserved_rng(ctx.device), norms:
                if self.distributed:
                    mine = run_rank(ctx, schedule, self.rank)
                    self.last_events = [
                        mine if r == self.rank else [] for r in range(schedule.num_ranks)
                    ]
                else:
                    self.last_events = run_local(ctx, step.graph)
                loss = None
                if ctx.targets is not None and parts.owns_last:
                    # Each microbatch's loss where its route ends (DualPipe: two ranks).
                    loss = sum(
                        (ctx.losses[i] * ctx.weights[i] for i in sorted(ctx.losses)),
                        torch.zeros(()),
                    )
                if ctx.reducer is not None:
                    ctx.reducer.wait_all()
                    self.last_events = reductions_as_run(self.last_events, ctx.reducer.last)
                own, loss = loss, parts.transport.finish_step(loss)
                if self.distributed and parts.schedule.routes:
                    loss = loss_over_route_ends(
                        own, loss, parts.transport.reduce_shared, ctx.device
                    )
                if parts.replicas is not None and loss is not None:
                    parts.replicas.sum_([loss], "the data-parallel sum of the step's loss")
                self.last_waits = dict(ctx.waited)
                parts.memory.end_step(publish=ctx.training)
        finally:
            for stage in parts.stages.values():
                stage.state.clear()
            if sharded is not None and not ctx.training:
                sharded.reshard()
        return loss

    def _finish(self, step: _Step, loss: Tensor | None) -> Outputs | None:
        """A training step counted, with the gradient sums no REDUCE_GRAD made: shared
        parameters' across ranks and replicas, then the earlier steps' gradients added back.
        Returns the loss, or (no target) the last stage's outputs, None on other ranks."""
        parts, ctx = self.parts, step.ctx
        if ctx.training:
            self._step += 1
            if parts.shared:
                across_ranks = parts.transport.reduce_shared if self.distributed else None
                reduce_shared(parts.shared, self.parameters(), parts.replicas, across_ranks)
            if step.earlier:
                add_back(self.parameters(), step.earlier)
        if ctx.targets is None:
            if self.distributed and parts.schedule.routes:
                raise PipelineError(
                    f"schedule {parts.schedule.name!r} ends its microbatches' routes on several "
                    f"ranks, which each hold their own outputs only: give a target (the loss "
                    f"is summed over them), or run the model in one process"
                )
            if not parts.owns_last:
                return None
            outs = [ctx.outputs[i] for i in range(len(ctx.inputs))]
            if step.given:  # each its own shape: one output per microbatch
                return [o[0] if len(o) == 1 else o for o in outs]
            cat = tuple(torch.cat([o[k] for o in outs]) for k in range(len(outs[0])))
            return cat[0] if len(cat) == 1 else cat
        if loss is None:
            last_rank = parts.schedule.placement[-1]
            raise PipelineError(f"rank {last_rank} owns the last stage but computed no loss")
        return loss


@dataclass
class _Step:
    """One step between its phases: what :meth:`Pipeline._prepare` made for the others."""

    ctx: StepContext
    graph: Graph  # the schedule the step runs (forward-only for eval_step) and its order
    earlier: dict[int, Tensor]  # the gradients of earlier steps, set aside until the sums
    given: bool = False  # its microbatches were given made (Microbatches), not cut here


# -- a step that fails in one process leaves .grad as it found it ------------------
GradBefore = tuple[nn.Parameter, Tensor | None, Tensor | None]


def _grads_before(params: Sequence[nn.Parameter]) -> list[GradBefore]:
    """Each parameter, its ``.grad`` tensor and a copy of its values, for :func:`_restore_grads`.

    Only gradients that exist are copied: after ``zero_grad()`` (``set_to_none``, its
    default) a step copies nothing.  The tensor itself is kept so that a caller holding
    ``p.grad`` still sees the gradient after a failed step.
    """
    return [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in params]


def _restore_grads(before: Sequence[GradBefore]) -> None:
    """Put back every ``.grad`` as :func:`_grads_before` found it (must not raise)."""
    with torch.no_grad():
        for p, grad, values in before:
            if grad is not None and values is not None:
                grad.copy_(values)
            p.grad = grad


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards and their transfers: what ``eval_step`` runs."""
    # Weight copies stay: an offloaded stage must still have its weights to run F.
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return schedule.replace_actions(
        [[a for a in acts if a.kind in keep or a.is_weight_copy] for acts in schedule.actions]
    )
