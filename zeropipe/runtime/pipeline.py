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
:func:`zeropipe.planning.plan.auto_plan`, runs exactly as built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fuse import fused_weights
from zeropipe.core.simulate import Event, Timeline
from zeropipe.runtime.assembly import (
    build_stages,
    check_materialised,
    check_same_pipeline,
    check_stages,
    checking_call,
    compute_device,
    distributed_transport,
    named_ranks,
    prepare_linears,
    replica_reducer,
    replicas_for,
    resolve_mesh,
    shared_parameters,
    split_params,
)
from zeropipe.runtime.memory.manager import MemoryManager, measured_costs
from zeropipe.runtime.options import RuntimeOptions
from zeropipe.runtime.replicas.data_parallel import Replicas, reductions_as_run
from zeropipe.runtime.replicas.fsdp import ShardedReducer
from zeropipe.runtime.replicas.grad_sums import (
    add_back,
    clip_grads,
    counted_once,
    grads_before,
    reduce_shared,
    refuse_split_hooks,
    restore_grads,
    set_aside,
)
from zeropipe.runtime.step.batch import forward_only, split_step, step_signature
from zeropipe.runtime.step.batch_norm import DeferredNorms
from zeropipe.runtime.step.executor import run_local, run_rank
from zeropipe.runtime.step.handlers import BoundaryMeta, StepContext
from zeropipe.runtime.step.loss_contract import LossContract, LossCountFn, LossFn
from zeropipe.runtime.step.rng import preserved_rng
from zeropipe.runtime.transport.base import LocalTransport, Transport

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Pipeline", "RuntimeOptions"]


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
        check_stages(stages)
        self.options = options if options is not None else RuntimeOptions()
        if not isinstance(self.options, RuntimeOptions):
            raise PipelineError(
                f"options must be a RuntimeOptions, got {type(self.options).__name__}"
            )
        dp_shard = self.options.dp_shard
        self.loss_fn = loss_fn
        # How microbatch losses combine into the batch's; refuses what cannot be exact.
        self.loss = (
            None
            if loss_fn is None
            else LossContract(loss_fn, loss_count, autocast=self.options.autocast)
        )
        self.seed = self.options.seed
        self.grad_memory = GradMemory() if self.options.keep_grad_memory else None
        self._step = 0
        self._signature: tuple[object, ...] | None = None
        where = resolve_mesh(mesh)
        process_group = where.pp_group
        self.distributed, self.rank, world = where.distributed, where.rank, where.world
        # The data-parallel replicas, when there are several.
        self.replicas: Replicas | None = replicas_for(where.dp_group, self.options.timeout)
        if dp_shard and self.replicas is None:
            raise PipelineError(
                "RuntimeOptions(dp_shard=True) shards the stages over a data-parallel group: pass "
                "mesh= a DeviceMesh with a 'dp' dimension of more than one rank"
            )
        try:
            self.schedule = build_schedule(
                schedule,
                ranks=named_ranks(schedule, stages, microbatches, world),
                microbatches=microbatches,
                reduce_grad=self.replicas is not None,
            )
        except ScheduleError as exc:
            raise PipelineError(str(exc)) from exc
        if self.distributed and self.schedule.num_ranks != world:
            raise PipelineError(
                f"schedule {self.schedule.name!r} has {self.schedule.num_ranks} rank(s) but the "
                f"pipeline's process group has {world}; launch {self.schedule.num_ranks} "
                f"processes or build the schedule for {world} ranks "
                f"(zeropipe.build_schedule(name, ranks={world}, microbatches=...))"
            )
        if dp_shard and any(a.is_weight_copy for acts in self.schedule.actions for a in acts):
            raise PipelineError(
                f"dp_shard=True with weight OFFLOAD/RELOAD in schedule {self.schedule.name!r}: "
                f"the weights would be both sharded and offloaded; use one or the other"
            )
        self.all_stages = build_stages(stages, self.schedule.num_stages, balance)
        check_same_pipeline(where, self.schedule, self.all_stages, self.options.timeout)
        self.deps = Dependencies(self.schedule)
        self.graph = Graph(self.schedule, self.deps)
        self.fused_weights = fused_weights(self.schedule)
        mine = (
            self.schedule.stages_of(self.rank)
            if self.distributed
            else range(self.schedule.num_stages)
        )
        self.stages = {s: self.all_stages[s] for s in mine}
        check_materialised(self.stages)  # only this process's: other ranks' may stay on meta
        # Deferred BatchNorms update their running statistics once per step (batch_norm.py).
        self.norms = DeferredNorms({s: stage.module for s, stage in self.stages.items()})
        self.device = compute_device(
            self.options.device, self.distributed, process_group, self.stages
        )
        prepare_linears(self.stages, self.schedule)
        for stage in self.stages.values():
            stage.autocast = self.options.autocast
        self.tied = split_params(self.all_stages)  # used by several stages, on any rank
        self.shared = shared_parameters(self.tied, self.schedule.placement)  # by several ranks
        if self.replicas is not None and not dp_shard:
            self.replicas.reducer = replica_reducer(
                self.replicas,
                self.schedule,
                self.all_stages,
                self.shared,
                self.rank,
                self.distributed,
            )
        self.boundary = BoundaryMeta()
        self.transport: Transport = (
            distributed_transport(
                self.schedule,
                self.rank,
                process_group,
                self.options.timeout,
                self.options.p2p,
                self.device,
            )
            if self.distributed
            else LocalTransport()
        )
        self.last_events: list[list[Event]] = []
        # eval_step's forward-only schedule, its dependencies and graph: built once, on first use.
        self._eval_plan: tuple[Schedule, Dependencies, Graph] | None = None
        # Seconds this process blocked in RECV_F / RECV_B during the last step.
        self.last_waits: dict[Kind, float] = {}
        # Saved-activation accounting, activation/weight offload: one per pipeline.
        self.memory = MemoryManager(
            self.schedule,
            self.stages,
            self.all_stages,
            self.device,
            self.options.count_saved,
        )
        if self.memory.weights:
            # A gradient kept for reuse would hold, on the device, the memory that weight
            # offload frees: every offloaded stage's gradients at once.
            self.grad_memory = None
        # Sharded last: the memory manager counts the full parameters a step holds.
        self.sharded: ShardedReducer | None = None
        if self.replicas is not None and dp_shard:
            self.sharded = ShardedReducer(
                self.replicas,
                self.schedule,
                self.stages,
                # In one process playing every pipeline rank a tied parameter is whole here.
                self.shared if self.distributed else [],
                self.transport.reduce_shared,
                self.device or next((p.device for p in self.parameters()), torch.device("cpu")),
                where.dp_mesh,
            )
            self.replicas.reducer = self.sharded
            self.shared = []  # their shards are summed over the pipeline ranks by the reducer
            self.grad_memory = None  # FSDP frees the full gradients itself at REDUCE_GRAD

    # -- public surface -------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of the stages this process runs (what its optimizer should step)."""
        seen: dict[int, nn.Parameter] = {}
        for stage in self.stages.values():
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
        """How many data-parallel replicas run this pipeline (1 without a ``dp_group``)."""
        return 1 if self.replicas is None else self.replicas.size

    @property
    def dp_rank(self) -> int:
        """This process's replica, ``0 .. dp_size - 1``: the slice of the global batch it gets."""
        return 0 if self.replicas is None else self.replicas.rank

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

    def step(self, inputs: Tensor | Sequence[Tensor], target: Tensor) -> Tensor:
        """One training step: forward and backward of every microbatch; returns the loss."""
        if self.loss_fn is None:
            raise PipelineError("Pipeline(loss_fn=...) is needed for a training step")
        refuse_split_hooks(self.tied)  # a hook on a parameter of several stages
        loss = self._run(inputs, target, training=True)
        if not isinstance(loss, Tensor):
            raise PipelineError("the step produced no loss (the last stage never ran its forward)")
        return loss

    @torch.no_grad()
    def eval_step(
        self, inputs: Tensor | Sequence[Tensor], target: Tensor | None = None
    ) -> Tensor | tuple[Tensor, ...] | None:
        """Forward only: the loss if ``target`` is given, else the last stage's output.

        The output is a tensor, or a tuple when the last stage returns several.
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
            schedule = forward_only(self.schedule)
            deps = Dependencies(schedule)
            self._eval_plan = (schedule, deps, Graph(schedule, deps))
        return self._eval_plan

    def _run(
        self, inputs: Tensor | Sequence[Tensor], target: Tensor | None, training: bool
    ) -> Tensor | tuple[Tensor, ...] | None:
        # In one process a failed step can be caught and the next batch run: the gradients
        # must then be those before the step, not some microbatches' worth added to them.
        # (A distributed failure ends the step on every rank, whose transport is then spent.)
        before = grads_before(self.parameters()) if training and not self.distributed else []
        try:
            return self._run_step(inputs, target, training)
        except BaseException as exc:
            # A lost tensor-parallel peer: the error to raise is its, recorded before it left.
            cause = self.transport.culprit(exc)
            # Peers may be blocked on this rank; the transport tells them why it stopped.
            self.transport.fail(exc if cause is None else cause)
            if self.replicas is not None:
                self.replicas.fail(exc if cause is None else cause)
            restore_grads(before)
            if cause is not None:
                raise cause from exc
            raise

    def _run_step(
        self, inputs: Tensor | Sequence[Tensor], target: Tensor | None, training: bool
    ) -> Tensor | tuple[Tensor, ...] | None:
        m = self.schedule.microbatches
        micro_inputs, sizes, targets = split_step(inputs, target, m, self.device)
        batch = sum(sizes)
        # Boundary shapes follow from the shapes of the step's inputs: learnt again when
        # those change (every rank sees the same batch, so every rank agrees).
        signature = step_signature(micro_inputs, target)
        if self._signature != signature:
            self._signature = signature
            self.boundary.reset()
        owns_last = self.schedule.num_stages - 1 in self.stages
        # Only the last stage computes the loss; its rank has the whole batch's targets, so
        # the weights (which may count items in every target) exist before any backward.
        replicas = self.replicas
        step_loss = (
            self.loss.for_step(targets, sizes, total=None if replicas is None else replicas.total)
            if self.loss is not None and targets is not None and owns_last
            else None
        )
        schedule, deps, graph = (
            (self.schedule, self.deps, self.graph) if training else self._forward_plan()
        )
        self.transport.start_step(schedule, signature, step=self._step)
        ctx = StepContext(
            step=self._step,
            seed=self.seed,
            training=training,
            stages=self.stages,
            deps=deps,
            transport=self.transport,
            boundary=self.boundary,
            inputs=micro_inputs,
            targets=targets,
            weights=step_loss.weights if step_loss is not None else [n / batch for n in sizes],
            loss=step_loss,
            device=self.memory.step_device(),
            memory=self.memory,
            input_first=self.options.input_first,
            grad_memory=self.grad_memory if training else None,
            fused_weights=self.fused_weights if training else frozenset(),
            reducer=replicas.reducer if replicas is not None and training else None,
            first_microbatch=0 if replicas is None else replicas.rank * m,
        )
        last_rank = schedule.placement[-1]
        # The sums after (or during) the step add only this step's contributions: that of
        # the shared parameters of a distributed pipeline and every parameter of a replica.
        summed = self.parameters() if self.replicas is not None else []
        if self.distributed:
            summed = [*summed, *self.shared]
        earlier = set_aside(summed) if training else {}
        if training:
            self.memory.begin_step(micro_inputs, targets)
        if self.sharded is not None:
            self.sharded.unshard()
        try:
            with preserved_rng(ctx.device), self.norms.step():
                if self.distributed:
                    mine = run_rank(ctx, schedule, self.rank)
                    self.last_events = [
                        mine if r == self.rank else [] for r in range(schedule.num_ranks)
                    ]
                else:
                    self.last_events = run_local(ctx, graph)
                loss = None
                if target is not None and owns_last:
                    loss = sum((ctx.losses[i] * ctx.weights[i] for i in range(m)), torch.zeros(()))
                if ctx.reducer is not None:
                    ctx.reducer.wait_all()
                    self.last_events = reductions_as_run(self.last_events, ctx.reducer.last)
                loss = self.transport.finish_step(loss)
                if replicas is not None and loss is not None:
                    replicas.sum_([loss], "the data-parallel sum of the step's loss")
                self.last_waits = dict(ctx.waited)
                self.memory.end_step(publish=training)
        finally:
            for stage in self.stages.values():
                stage.state.clear()
            if self.sharded is not None and not training:
                self.sharded.reshard()
        if training:
            self._step += 1
            reduce_shared(
                self.shared,
                self.parameters(),
                self.replicas,
                self.transport.reduce_shared if self.distributed else None,
            )
            add_back(self.parameters(), earlier)
        if target is None:
            if not owns_last:
                return None
            outs = [ctx.outputs[i] for i in range(m)]
            cat = tuple(torch.cat([o[k] for o in outs]) for k in range(len(outs[0])))
            return cat[0] if len(cat) == 1 else cat
        if loss is None:
            raise PipelineError(f"rank {last_rank} owns the last stage but computed no loss")
        return loss
