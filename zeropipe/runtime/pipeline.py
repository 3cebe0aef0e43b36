"""``zeropipe.Pipeline``: run a schedule on real modules, one training step per call.

    pipe = Pipeline(model, "zbv", microbatches=8, loss_fn=F.cross_entropy, ranks=2)
    loss = pipe.step(tokens, targets)       # .grad filled as loss.backward() on the batch
    optimizer.step()

Local (one process plays every rank) or distributed (one process per rank,
torch.distributed already initialised, e.g. by torchrun or zeropipe.launch):
the same schedule, the same handlers, the same gradients.  In the
distributed case every rank builds the whole model and calls ``step`` with
the same batch; each keeps only the stages placed on it.

The schedule comes from :func:`zeropipe.core.build.build_schedule` (a name is
generated, W grouped, lowered, validated) and runs exactly as built; a plan
searched for the model comes from :func:`zeropipe.planning.plan.auto_plan`.  The
runtime's own knobs are one :class:`RuntimeOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.autograd.split import prepare_split, split_linears
from zeropipe.base.device import check_autocast
from zeropipe.core.build import build_schedule
from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.fuse import fused_weights
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.simulate import Event, Timeline
from zeropipe.runtime.assembly import (
    build_stages,
    compute_device,
    distributed_transport,
    executor_mode,
    named_ranks,
    replicas_for,
    resolve_groups,
    shared_parameters,
)
from zeropipe.runtime.collectives import grad_norm
from zeropipe.runtime.data_parallel import (
    GradReducer,
    Replicas,
    reduction_owners,
    reductions_as_run,
)
from zeropipe.runtime.executor import run_local, run_rank
from zeropipe.runtime.fsdp import ShardedReducer
from zeropipe.runtime.handlers import BoundaryMeta, StepContext
from zeropipe.runtime.loss import LossContract, LossCountFn, LossFn
from zeropipe.runtime.memory import MemoryManager, measured_costs
from zeropipe.runtime.rng import preserved_rng
from zeropipe.runtime.stage import as_tuple
from zeropipe.runtime.transport import LocalTransport, Transport

__all__ = ["PLAIN_BELOW_BYTES", "Pipeline", "RuntimeOptions"]

# On a stage whose schedule has no I or W (every backward a B), an ``nn.Linear`` whose
# weight is smaller than this stays plain: its weight gradient comes from autograd
# inside B.  Larger ones record for split backward anyway, because B then adds their
# weight gradients into ``.grad`` with one fused product, into memory kept from the
# last step, where autograd computes, allocates and adds.  Where that pays depends on
# the rows of a microbatch: about 256 KiB at 8 rows, about 1 MiB at 128 (one thread on
# the 2-vCPU VM, 2026-11-25, ``python benchmarks/plain_linears.py``).  The lower is
# taken: recording where plain would do costs a few percent, the reverse up to 20%.
PLAIN_BELOW_BYTES = 256 * 1024


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime executes a schedule; none but ``autocast`` changes the gradients.

    Attributes:
        input_first: in a full backward B, produce the stage-input gradient
            before parameter-only work (backward priority) and post its send
            from inside the backward.
        keep_grad_memory: W writes a weight gradient whose ``.grad`` is ``None``
            (after ``optimizer.zero_grad()``) into the memory it used last step,
            when nothing else still refers to it, instead of allocating: on a
            CPU a fresh weight-sized allocation is paid again in page faults,
            on the critical path.  The gradient memory then stays allocated
            between steps (``Pipeline.release_grad_memory()`` frees it).
        count_saved: ``"once"`` counts the bytes of saved activations
            (``Pipeline.peak_saved_bytes``) through saved-tensor hooks the first
            time a stage runs a forward on inputs of a given shape and dtype,
            and reuses that count afterwards: the hooks cost a few microseconds
            per saved tensor.  ``"always"`` hooks every forward, for models
            whose saved bytes depend on the data, not only on the shapes.
            Stages whose activations or weights the schedule offloads are always
            hooked.
        timeout: seconds a rank waits for a peer before failing (distributed).
        autocast: ``torch.bfloat16`` runs every stage's forward, its recompute
            and the loss under ``torch.autocast`` (on the compute device's type);
            the backward runs outside it, as torch recommends.  Parameters and
            their ``.grad`` keep their dtype (float32).  ``None``: no autocast.
            Unlike the other options, this one changes the arithmetic (as
            autocast does in a model run without a pipeline).
    """

    input_first: bool = True
    keep_grad_memory: bool = True
    count_saved: Literal["once", "always"] = "once"
    timeout: float = 300.0
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_autocast(self.autocast)
        if self.count_saved not in ("once", "always"):
            raise PipelineError(f"count_saved must be 'once' or 'always', got {self.count_saved!r}")
        if not self.timeout > 0:
            raise PipelineError(f"timeout must be > 0 seconds, got {self.timeout!r}")


class Pipeline:
    """A model cut into stages and run under a schedule.

    Args:
        stages: an ``nn.Sequential`` (cut into the schedule's stages, by
            ``balance`` = layers per stage, or evenly) or one module per stage.
        schedule: a :class:`~zeropipe.core.ir.Schedule` (compute-only, or lowered
            and then run exactly as given) or a generator name (``zeropipe
            schedules`` lists them).  For a schedule searched for this model,
            use :func:`zeropipe.planning.plan.auto_plan` and pass its ``schedule``.
        microbatches: how many microbatches a batch is cut into (needed with a name).
        loss_fn: ``loss_fn(output, target)``, called per microbatch; the step's
            loss and gradients are those of the whole batch when it is one of
            (:mod:`zeropipe.runtime.loss` says how each is weighted):
            a torch loss module (``nn.CrossEntropyLoss(ignore_index=...,
            weight=...)``, ``nn.MSELoss(reduction="sum")``, ...), whose items are
            counted from the targets; a function returning ``(loss_sum, count)``,
            with ``loss_count``; or a function returning a mean over its
            microbatch, weighted by rows -- exact only when every row counts the
            same number of items.  What cannot be made exact
            (``reduction="none"``, a mean-reduced module of unknown kind) is refused.
        loss_count: ``loss_count(target) -> count`` for a ``loss_fn`` returning
            ``(loss_sum, count)``: the count of a microbatch's target, so that the
            batch's total (which seeds every backward) is known before the first
            one; each microbatch's returned count is checked against it.
        ranks: pipeline ranks for a named schedule (default: the world size when
            distributed, else ``len(stages) / chunks``).
        chunks: stages per rank for a named schedule (default: the generator's).
        group_w: split every B into I then W and gather each rank's W of a
            stage in runs of this many (:func:`zeropipe.core.fuse.group_weights`),
            which the runtime runs as one product per weight, reading and
            writing each weight gradient once per run instead of once per
            microbatch; costs up to ``group_w - 1`` microbatches' W-parts
            (the linears' inputs and output gradients) of memory per stage.
        balance: layers per stage when cutting an ``nn.Sequential``.
        seed: dropout and other randomness are seeded per (seed, step,
            microbatch, layer), identical whatever the schedule or rank count.
        device: where the stages compute; the stages this process runs are moved
            there.  Default: GPU number ``LOCAL_RANK`` on an NCCL process group, else
            where their parameters are (which must then be one device).  A device
            type alone (no index) means index ``LOCAL_RANK`` (0 when unset).
            Needed when weight OFFLOAD/RELOAD keep the parameters on the host.
            Inputs and targets given to ``step`` are moved to it.
        executor: ``"local"``, ``"distributed"`` or ``"auto"`` (distributed when
            torch.distributed is initialised with more than one process).
        pp_group: the pipeline's process group: one rank per schedule rank
            (default: the world, or the mesh's "pp" dimension).
        dp_group: the data-parallel group: the ranks that run the same
            pipeline rank of other replicas of the pipeline.  Each replica
            calls ``step`` with its own slice of the global batch; the
            microbatches are weighted by the global batch's item count and
            each stage's gradients are summed across replicas by the schedule's
            REDUCE_GRAD action (added when the group has more than one rank),
            posted as soon as the stage's gradients are final, so that every
            replica ends the step with the global batch's gradient and loss
            (:mod:`zeropipe.runtime.data_parallel`).
        mesh: a ``DeviceMesh`` with a "pp" dimension and optionally a "dp"
            dimension, instead of ``pp_group`` / ``dp_group``.
        dp_shard: shard the stages this process runs over the data-parallel
            group with FSDP2 (``fully_shard``) instead of replicating them: their
            parameters and ``.grad`` become ``DTensor`` shards between steps
            (the optimizer steps the shards), gathered whole at the start of a
            step and reduce-scattered (summed) at each stage's REDUCE_GRAD
            (:mod:`zeropipe.runtime.fsdp`).  Needs a data-parallel group of more
            than one rank and the distributed executor; no weight offload.
        process_group: the former name of ``pp_group``.
        p2p: how boundary tensors cross processes: ``"ordered"`` issues every
            message in one order both ends agree on, in ``batch_isend_irecv``
            groups (:mod:`zeropipe.runtime.ordered`; the only mode NCCL can
            run); ``"tagged"`` matches messages by tag in any order (gloo only,
            :mod:`zeropipe.runtime.distributed`); ``"auto"``: ordered on NCCL,
            tagged on gloo, where it measured faster (docs/benchmarks.md).
        options: the runtime's knobs (:class:`RuntimeOptions`).
    """

    def __init__(
        self,
        stages: nn.Sequential | Sequence[nn.Module],
        schedule: Schedule | str = "1f1b",
        microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        *,
        loss_count: LossCountFn | None = None,
        ranks: int | None = None,
        chunks: int | None = None,
        group_w: int = 1,
        balance: Sequence[int] | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        executor: Literal["auto", "local", "distributed"] = "auto",
        pp_group: object | None = None,
        dp_group: object | None = None,
        mesh: object | None = None,
        process_group: object | None = None,
        p2p: Literal["auto", "ordered", "tagged"] = "auto",
        options: RuntimeOptions | None = None,
        dp_shard: bool = False,
    ) -> None:
        if p2p not in ("auto", "ordered", "tagged"):
            raise PipelineError(f"p2p must be 'auto', 'ordered' or 'tagged', got {p2p!r}")
        self.options = options if options is not None else RuntimeOptions()
        if not isinstance(self.options, RuntimeOptions):
            raise PipelineError(
                f"options must be a RuntimeOptions, got {type(self.options).__name__}"
            )
        self.loss_fn = loss_fn
        # How microbatch losses combine into the batch's; refuses what cannot be exact.
        self.loss = (
            None
            if loss_fn is None
            else LossContract(loss_fn, loss_count, autocast=self.options.autocast)
        )
        self.seed = seed
        self.grad_memory = GradMemory() if self.options.keep_grad_memory else None
        self._step = 0
        self._signature: tuple[object, ...] | None = None
        process_group, dp_group = resolve_groups(pp_group, dp_group, mesh, process_group)
        self.distributed, self.rank, world = executor_mode(executor, process_group)
        # The data-parallel replicas, when there are several.
        self.replicas: Replicas | None = replicas_for(dp_group, self.options.timeout)
        if dp_shard and (self.replicas is None or not self.distributed):
            raise PipelineError(
                "dp_shard=True shards the stages over a data-parallel group: pass mesh= with a "
                "'dp' dimension (or dp_group=) of more than one rank, and run one process per "
                "pipeline rank (the distributed executor)"
            )
        if isinstance(schedule, str):
            ranks = named_ranks(schedule, stages, microbatches, ranks, chunks, world)
        try:
            self.schedule = build_schedule(
                schedule,
                ranks=ranks,
                microbatches=microbatches,
                chunks=chunks,
                group_w=group_w,
                reduce_grad=self.replicas is not None,
            )
        except ScheduleError as exc:
            raise PipelineError(str(exc)) from exc
        if self.distributed and self.schedule.num_ranks != world:
            raise PipelineError(
                f"schedule {self.schedule.name!r} has {self.schedule.num_ranks} rank(s) but the "
                f"process group has {world}; launch {self.schedule.num_ranks} processes or pass "
                f"ranks={world}"
            )
        if dp_shard and any(a.is_weight_copy for acts in self.schedule.actions for a in acts):
            raise PipelineError(
                f"dp_shard=True with weight OFFLOAD/RELOAD in schedule {self.schedule.name!r}: "
                f"the weights would be both sharded and offloaded; use one or the other"
            )
        self.all_stages = build_stages(stages, self.schedule.num_stages, balance)
        self.deps = Dependencies(self.schedule)
        self.graph = Graph(self.schedule, self.deps)
        self.fused_weights = fused_weights(self.schedule)
        mine = (
            self.schedule.stages_of(self.rank)
            if self.distributed
            else range(self.schedule.num_stages)
        )
        self.stages = {s: self.all_stages[s] for s in mine}
        self.device = compute_device(device, self.distributed, process_group, self.stages)
        split = _split_stages(self.schedule)
        for s, stage in self.stages.items():
            least = 0 if s in split else PLAIN_BELOW_BYTES
            prepare_split(stage.module, min_weight_bytes=least)
            stage.linears = split_linears(stage.module, allow_plain=True)
            stage.autocast = self.options.autocast
        self.shared = shared_parameters(self.all_stages, self.schedule.placement)
        if self.replicas is not None and not dp_shard:
            self.replicas.reducer = self._reducer(self.replicas)
        self.boundary = BoundaryMeta()
        self.transport: Transport = (
            distributed_transport(
                self.schedule, self.rank, process_group, self.options.timeout, p2p, self.device
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
            self.sharded = self._sharded_reducer(self.replicas)
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
        so every rank and replica computes the same norm and scales alike.
        Returns that norm (a float64 scalar on every rank).
        """
        if self.sharded is not None:
            raise PipelineError(
                "clip_grad_norm_ with dp_shard=True is not supported yet: the gradients are "
                "DTensor shards; use torch.nn.utils.clip_grad_norm_ on pipe.parameters() per "
                "pipeline rank only if the stages share no parameter"
            )
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise PipelineError(f"norm_type must be > 0 (or inf), got {norm_type}")
        grads = [p.grad.detach() for p in self._norm_parameters() if p.grad is not None]
        total = grad_norm(
            grads,
            norm_type,
            self.transport.reduce_shared if self.distributed else None,
            self.schedule.num_ranks,
            self.rank,
        )
        if error_if_nonfinite and not torch.isfinite(total):
            raise PipelineError(
                f"the total norm of order {norm_type:g} of the gradients is {total.item()}; "
                f"pass error_if_nonfinite=False to scale them anyway"
            )
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if coef < 1.0:  # every copy of a shared parameter's gradient, counted once or not
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
        return total

    def _norm_parameters(self) -> list[nn.Parameter]:
        """This process's parameters, a shared one only on the lowest rank that holds it."""
        mine = self.parameters()
        if not self.distributed or not self.shared:
            return mine
        first: dict[int, int] = {}
        for stage in self.all_stages:
            for p in stage.parameters():
                rank = self.schedule.placement[stage.index]
                first[id(p)] = min(first.get(id(p), rank), rank)
        return [p for p in mine if first[id(p)] == self.rank]

    def step(self, inputs: Tensor | Sequence[Tensor], target: Tensor) -> Tensor:
        """One training step: forward and backward of every microbatch; returns the loss."""
        if self.loss_fn is None:
            raise PipelineError("Pipeline(loss_fn=...) is needed for a training step")
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
        :func:`zeropipe.runtime.memory.measured_costs`.
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
            schedule = _forward_only(self.schedule)
            deps = Dependencies(schedule)
            self._eval_plan = (schedule, deps, Graph(schedule, deps))
        return self._eval_plan

    def _run(
        self, inputs: Tensor | Sequence[Tensor], target: Tensor | None, training: bool
    ) -> Tensor | tuple[Tensor, ...] | None:
        try:
            return self._run_step(inputs, target, training)
        except BaseException as exc:
            # Peers may be blocked on this rank; the transport tells them why it stopped.
            self.transport.fail(exc)
            if self.replicas is not None:
                self.replicas.fail(exc)
            raise

    def _run_step(
        self, inputs: Tensor | Sequence[Tensor], target: Tensor | None, training: bool
    ) -> Tensor | tuple[Tensor, ...] | None:
        m = self.schedule.microbatches
        if self.device is not None:  # the caller's batch, on the device the stages compute on
            inputs = tuple(t.to(self.device) for t in as_tuple(inputs, "inputs"))
            if isinstance(target, Tensor):
                target = target.to(self.device)
        micro_inputs, sizes = _split_batch(as_tuple(inputs, "inputs"), m)
        batch = sum(sizes)
        targets = None if target is None else _split_target(target, m, sizes)
        # Boundary shapes follow from the shapes of the step's inputs: learnt again when
        # those change (every rank sees the same batch, so every rank agrees).
        signature = _signature(micro_inputs, target)
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
        self.transport.start_step(schedule, signature)
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
        earlier = self._set_aside_grads() if training else {}
        if training:
            self.memory.begin_step(micro_inputs, targets)
        if self.sharded is not None:
            self.sharded.unshard()
        try:
            with preserved_rng(ctx.device):
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
            self._reduce_shared()
            self._add_back(earlier)
        if target is None:
            if not owns_last:
                return None
            outs = [ctx.outputs[i] for i in range(m)]
            cat = tuple(torch.cat([o[k] for o in outs]) for k in range(len(outs[0])))
            return cat[0] if len(cat) == 1 else cat
        if loss is None:
            raise PipelineError(f"rank {last_rank} owns the last stage but computed no loss")
        return loss

    def _set_aside_grads(self) -> dict[int, Tensor]:
        """Take gradients of earlier steps off the parameters that this step sums across ranks.

        The sums after (or during) the step must add only this step's
        contributions; what ``.grad`` already held (steps accumulated without
        ``zero_grad``) is added back afterwards, once.  That is the shared
        parameters of a distributed pipeline, and every parameter of a
        data-parallel replica.
        """
        params = self.parameters() if self.replicas is not None else []
        if self.distributed:
            params = [*params, *self.shared]
        earlier = {}
        for p in params:
            if p.grad is not None:
                earlier[id(p)] = p.grad
                p.grad = None
        return earlier

    def _add_back(self, earlier: dict[int, Tensor]) -> None:
        if not earlier:
            return
        for p in self.parameters():  # a shared parameter this rank does not own stays unset
            before = earlier.get(id(p))
            if before is not None and p.grad is not None:
                p.grad = before.add_(p.grad)

    def _reduce_shared(self) -> None:
        """Sum the gradients that no REDUCE_GRAD summed: shared parameters, across ranks."""
        if not self.shared:
            return
        owned = {id(p) for p in self.parameters()}
        if self.replicas is not None:
            # Used by stages on several pipeline ranks (or, in one process, several
            # schedule ranks): summed across replicas here, once the step is over.
            late = [p for p in self.shared if id(p) in owned and p.requires_grad]
            for p in late:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if late:
                self.replicas.sum_(
                    [p.grad for p in late if p.grad is not None],
                    "the data-parallel sum of shared parameters' gradients",
                )
        if not self.distributed:
            return
        # Every rank holds the whole model, but only ranks running a stage that
        # uses a shared parameter own its gradient.  The others contribute a
        # fresh zero buffer and keep nothing: a .grad left on their copy would
        # never be zeroed by their optimizer and would leak into the next sum.
        grads = []
        for p in self.shared:
            if id(p) not in owned:
                grads.append(torch.zeros_like(p))
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self.transport.reduce_shared(grads)

    def _sharded_reducer(self, replicas: Replicas) -> ShardedReducer:
        """FSDP2 on this process's stages (their parameters become DTensor shards)."""
        device = self.device
        if device is None:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
        return ShardedReducer(
            replicas,
            self.schedule,
            self.rank,
            self.stages,
            self.shared,
            lambda grads: self.transport.reduce_shared(grads),
            device,
        )

    def _reducer(self, replicas: Replicas) -> GradReducer:
        """Which REDUCE_GRAD sums each of this process's parameters across replicas."""
        shared = {id(p) for p in self.shared}
        ranks = [self.rank] if self.distributed else range(self.schedule.num_ranks)
        owners: dict[int, list[nn.Parameter]] = {}
        for r in ranks:
            params = {s: list(self.all_stages[s].parameters()) for s in self.schedule.stages_of(r)}
            owners.update(reduction_owners(self.schedule, r, params, exclude=shared))
        return GradReducer(replicas.endpoint, owners)


def _split_batch(inputs: tuple[Tensor, ...], m: int) -> tuple[list[tuple[Tensor, ...]], list[int]]:
    for k, t in enumerate(inputs):
        if t.dim() == 0:
            name = "the input" if len(inputs) == 1 else f"input {k}"
            raise PipelineError(
                f"{name} is 0-dimensional (a scalar); the batch is cut into microbatches along "
                f"dim 0, so give it a batch dimension (e.g. x.reshape(1) or x.unsqueeze(0))"
            )
    batch = len(inputs[0])
    if any(len(t) != batch for t in inputs):
        raise PipelineError(f"inputs disagree on the batch size: {[len(t) for t in inputs]}")
    if batch < m:
        raise PipelineError(
            f"a batch of {batch} cannot be cut into {m} microbatches; use a larger batch"
        )
    parts = [torch.tensor_split(t, m, dim=0) for t in inputs]
    micro = [tuple(p[i] for p in parts) for i in range(m)]
    return micro, [len(mb[0]) for mb in micro]


def _split_target(target: Tensor, m: int, sizes: list[int]) -> list[Tensor]:
    if not isinstance(target, Tensor):
        raise PipelineError(f"target must be a tensor, got {type(target).__name__}")
    if target.dim() == 0:
        raise PipelineError(
            "the target is 0-dimensional (a scalar); it is cut into microbatches along dim 0 "
            "like the inputs, so give it one row per input row (e.g. y.reshape(1))"
        )
    targets = list(torch.tensor_split(target, m, dim=0))
    if [len(t) for t in targets] != sizes:
        raise PipelineError(f"target has {len(target)} rows but inputs have {sum(sizes)}")
    return targets


def _forward_only(schedule: Schedule) -> Schedule:
    # Weight copies stay: an offloaded stage must still have its weights to run F.
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    return schedule.replace_actions(
        [[a for a in acts if a.kind in keep or a.is_weight_copy] for acts in schedule.actions]
    )


def _signature(micro_inputs: list[tuple[Tensor, ...]], target: Tensor | None) -> tuple[object, ...]:
    """The shapes and dtypes of a step's microbatches and target (what boundary shapes follow)."""
    first, last = micro_inputs[0], micro_inputs[-1]
    meta = tuple((t.dtype, tuple(t.shape)) for t in (*first, *last))
    return (meta, None if target is None else (target.dtype, tuple(target.shape)))


def _split_stages(schedule: Schedule) -> set[int]:
    """The stages whose backward the schedule splits (runs I or W of, not only B)."""
    split = (Kind.I, Kind.W)
    return {a.stage for acts in schedule.actions for a in acts if a.kind in split}
