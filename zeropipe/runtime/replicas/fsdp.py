"""Pipeline stages sharded over the data-parallel group with FSDP2 (``fully_shard``).

``Pipeline(..., mesh=mesh, options=RuntimeOptions(dp_shard=True))``: instead of
every replica holding the whole of its stages' parameters and all-reducing their
gradients, each holds a 1/dp shard of every parameter (a ``DTensor``, what the
optimizer steps) and reduce-scatters the gradients into shards.  The composition is
torchtitan's / torch.distributed.pipelining's, with one difference: FSDP's
own forward and backward hooks never fire.  zeropipe runs a stage's forward
layer by layer, and its split backward writes the weight gradients (W)
outside autograd, later than any autograd hook could see them; so the runtime
drives FSDP explicitly::

    step start     unshard(): all-gather every shard of this rank's stages;
                   the modules now hold the full parameters, as plain tensors
    F B I W R      run on the full parameters; .grad accumulates on them over
                   all microbatches (no per-backward reduction)
    s REDUCE_GRAD  reduce-scatter (SUM) stage s's gradients into the shards'
                   .grad, free the full parameters and gradients (reshard)
    step end       wait for the reductions; sum the shards of parameters shared
                   with stages on other pipeline ranks (tied embeddings) over "pp"

Memory: during a step nothing is sharded -- a rank holds its stages' full
parameters from the step's start, and their full gradients, until each
stage's REDUCE_GRAD, as the replicated mode does, *plus* the shards (1/dp of
the parameters, and of the gradients when steps accumulate).  Sharding saves
memory between steps only: parameters, gradients and the optimizer state an
optimizer builds on them are 1/dp there.  It costs one all-gather per stage
per step.  Keeping the stages whole is required here, not only cheaper: the
forward, R and the backwards use the weights saved or captured at F, and no
FSDP hook re-gathers them; gathering and freeing around every F/B/I/W/R
action instead (``unshard()`` before, ``reshard()`` after) was tried on zbv,
2x2, float64 MLP: it ran, but every parameter's gradient was wrong (max
errors 0.02 to 0.25); the cause was not established.

FSDP's all-gathers and reduce-scatters are posted through the pipeline's
data-parallel endpoint (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
and waited on within ``RuntimeOptions.timeout``, watching for failed peers, like
every other collective of a step: a replica that fails ends its peers' waits.

Parameters used by several stages of this process (a V placement's tied
embedding) must be one FSDP parameter: those stages are sharded together,
as one unit (``fully_shard`` on a container of their modules), reduced once
the REDUCE_GRAD of every one of them has run.

A pipeline group of one process (a mesh whose "pp" dimension is 1) plays
every pipeline rank in this process: its stages are all here, and so is the
whole gradient of a parameter tied across ranks (nothing to sum over "pp").

Experts sharded over the replicas (expert parallelism inside dp:
``zeropipe.parallelize(stages, ep_mesh=)``) are a 1/ep share on each rank
already; the units over "dp" leave them out (``fully_shard(...,
ignored_params=)``).  With ep < dp the dp/ep replicas holding the same experts
shard them again, in units of their own over that mesh (2-D: "ep" inside, as
tensor parallelism is; :func:`same_experts_mesh` finds it beside "ep" in the
mesh "ep" was sliced from), so each holds 1/dp of them, as the cluster planner
prices them; their reduce-scatter sums their gradients over those replicas.  With
ep = dp nobody else holds them: they stay whole, nothing summed.  An ep mesh made
on its own (no such dimension) leaves them whole too, summed at each REDUCE_GRAD
over the replicas holding the same experts (``apart``), as the replicated mode
sums them.  ``clip_grad_norm_`` counts each expert once: its gradient is a DTensor
over "ep" (and those replicas), whose norm is gathered over them.

With a "cp" dimension the gradients are summed over dp x cp (each cp rank holds
other tokens of the same rows), so the stages are sharded over that flattened
mesh (torchtitan's ``dp_shard_cp``; :func:`zeropipe.runtime.mesh.resolve_mesh`
makes it): FSDP2's reduce-scatter sums over both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeropipe.base import _compat
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Schedule
from zeropipe.runtime.replicas.data_parallel import (
    GradReducer,
    Replicas,
    ShardedOverReplicas,
    reduction_order,
)
from zeropipe.runtime.step.stage import Stage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedReducer", "same_experts_mesh"]


class _Unit(nn.ModuleList):
    """Stages of one rank sharded together (they share parameters); never called itself."""

    def forward(self, *args: object) -> None:  # fully_shard refuses a container without one
        raise PipelineError("a sharded unit of stages is driven by the pipeline, not called")


class ShardedReducer(GradReducer):
    """FSDP2-sharded stages: ``post(stage)`` reduce-scatters, ``wait_all()`` finishes the step.

    Args:
        replicas: the data-parallel group (its ranks hold the shards).
        schedule: the schedule (each stage needs a REDUCE_GRAD on its rank).
        stages: the stages this process runs (of one pipeline rank, or of every
            rank when this process plays them all).
        shared: parameters used by stages on several pipeline ranks, in the
            order every pipeline rank lists them (before sharding).
        sum_over_pp: sums tensors in place over the pipeline group.
        device: where the stages compute.
        mesh: the DeviceMesh to shard over (a "dp" dimension of the user's mesh, or its
            "dp" and "cp" flattened, which FSDP2 needs when the parameters are
            tensor-parallel DTensors on its "tp" dimension); None: one built from the
            replicas' group.
        experts: the parameters sharded over the replicas already (experts under
            expert parallelism), left out of the units over ``mesh``: sharded again over
            the replicas holding the same ones (:func:`same_experts_mesh`), in units of
            their own, or else left whole.
        apart: the reducer of those experts' gradients (over the replicas holding the
            same experts), posted at every REDUCE_GRAD when they are left whole; None:
            nothing to sum.
    """

    def __init__(
        self,
        replicas: Replicas,
        schedule: Schedule,
        stages: Mapping[int, Stage],
        shared: Sequence[nn.Parameter],
        sum_over_pp: Callable[[list[Tensor]], None],
        device: torch.device,
        mesh: object | None = None,
        *,
        experts: ShardedOverReplicas | None = None,
        apart: GradReducer | None = None,
    ) -> None:
        super().__init__(replicas.endpoint, {}, apart)
        missing = _compat.fsdp_missing()
        if missing:
            raise PipelineError(
                f"dp_shard=True needs FSDP2 internals that torch {torch.__version__} lacks: "
                f"{', '.join(missing)} (zeropipe.base._compat checks them; torch 2.13 has them)"
            )
        from torch.distributed.device_mesh import DeviceMesh

        dp_mesh = (
            mesh
            if isinstance(mesh, DeviceMesh)
            else DeviceMesh.from_group(replicas.group, device.type)  # type: ignore[arg-type]
        )
        self.dp_size, self.dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        self.device = device
        self.sum_over_pp = sum_over_pp
        self.shared_shapes = [tuple(p.shape) for p in shared]
        self.shared_dtypes = [p.dtype for p in shared]
        # Where each shared parameter lives in this rank's stages, by name: sharding
        # replaces the parameter objects, the names stay.
        where: dict[int, tuple[nn.Module, str]] = {}
        index = {id(p): k for k, p in enumerate(shared)}
        for stage in stages.values():
            for name, p in stage.module.named_parameters(remove_duplicate=False):
                if id(p) in index:
                    where.setdefault(index[id(p)], (stage.module, name))
        for r in sorted({schedule.placement[s] for s in stages}):
            reduction_order(schedule, r, [s for s in stages if schedule.placement[s] == r])
        self.units: list[nn.Module] = []
        self.unit_of: dict[int, list[int]] = {}  # stage -> the indices of its units
        self.unit_stages: dict[int, frozenset[int]] = {}  # unit index -> its stages
        self.waiting: dict[int, set[int]] = {}  # this step: unit -> stages not yet at REDUCE_GRAD
        ids = experts.ids if experts is not None else frozenset()
        experts_mesh = (
            same_experts_mesh([p for st in stages.values() for p in st.parameters()], experts)
            if experts is not None
            else None
        )
        if experts_mesh is not None:  # FSDP2 sums them over the replicas holding them
            self.apart = None
        for group in _connected(stages):
            held = {p for s in group for p in stages[s].parameters() if id(p) in ids}
            self._add_unit(_Unit([stages[s].module for s in group]), group, dp_mesh, held)
            if held and experts_mesh is not None:
                self._add_unit(_Unit(_holding(stages, group, ids)), group, experts_mesh)
        self.shared_params: list[nn.Parameter | None] = [
            None if k not in where else where[k][0].get_parameter(where[k][1])
            for k in range(len(shared))
        ]
        self.posted: list[tuple[int, nn.Module]] = []
        self.reduced: list[int] = []  # the last step's REDUCE_GRADs that reduce-scattered

    def _add_unit(
        self,
        unit: nn.Module,
        stages: Sequence[int],
        mesh: DeviceMesh,
        ignored: AbstractSet[nn.Parameter] = frozenset(),
    ) -> None:
        """Shard ``unit`` (a container of modules of ``stages``) over ``mesh``, leaving out
        ``ignored``; it is reduced once the REDUCE_GRAD of every one of ``stages`` has run."""
        from torch.distributed.fsdp import fully_shard

        if ignored:
            _refuse_without_ignored_params(fully_shard)
            fully_shard(unit, mesh=mesh, reshard_after_forward=False, ignored_params=set(ignored))
        else:
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        # The loss weights are global shares already: the reduce-scatter must SUM.
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        _compat.fsdp_bounded_comms(unit, self._run)
        _compat.fsdp_lazy_init(unit)
        k = len(self.units)
        self.units.append(unit)
        for s in stages:
            self.unit_of.setdefault(s, []).append(k)
        self.unit_stages[k] = frozenset(stages)

    def _run(self, post: Callable[[], object], what: str) -> None:
        """Post a collective FSDP asks for and wait, within the pipeline's time limit."""
        work = self.endpoint.call(post, what)
        self.endpoint.wait(self.endpoint.pending([work], [(what, None)]))

    def unshard(self) -> None:
        """Gather the full parameters of every stage of this rank (start of a step)."""
        self.waiting = {k: set(group) for k, group in self.unit_stages.items()}
        for unit in self.units:
            unit.set_requires_gradient_sync(False)  # type: ignore[operator]
            unit.set_reshard_after_backward(False)  # type: ignore[operator]
            unit.set_is_last_backward(False)  # type: ignore[operator]
            unit.unshard()  # type: ignore[operator]

    def reshard(self) -> None:
        """Free the full parameters (after a forward-only step, or a failed one)."""
        for unit in self.units:
            unit.reshard()  # type: ignore[operator]

    def post(self, stage: int) -> None:
        units = self.unit_of.get(stage)
        if units is None:
            raise PipelineError(f"REDUCE_GRAD of stage {stage}: this rank does not run it")
        if self.apart is not None:  # the experts this stage's REDUCE_GRAD owns
            self.apart.post(stage)
        for k in units:
            waiting = self.waiting.get(k, set())
            waiting.discard(stage)
            if waiting:  # a unit is reduced once, when the last of its stages' gradients is final
                continue
            unit = self.units[k]
            unit.set_requires_gradient_sync(True)  # type: ignore[operator]
            unit.set_reshard_after_backward(True)  # type: ignore[operator]
            unit.set_is_last_backward(True)  # type: ignore[operator]
            _compat.fsdp_reduce_scatter(unit)
            self.posted.append((stage, unit))

    def wait_all(self) -> None:
        posted, self.posted = self.posted, []
        for _, unit in posted:
            _compat.fsdp_finish_backward(unit)
        self.reduced = list(dict.fromkeys(s for s, _ in posted))
        if self.apart is not None:
            self.apart.wait_all()
        if self.shared_shapes:
            self._sum_shared()

    def _sum_shared(self) -> None:
        """Sum over the pipeline ranks the shards of parameters tied across them.

        Every pipeline rank of this replica holds the same shard (same shape,
        same dp rank); a rank without the parameter contributes zeros.
        """
        grads = []
        for p, shape, dtype in zip(
            self.shared_params, self.shared_shapes, self.shared_dtypes, strict=True
        ):
            if p is None:
                grads.append(torch.zeros(self._local_shape(shape), dtype=dtype, device=self.device))
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local())  # type: ignore[attr-defined]
        self.sum_over_pp(grads)

    def _local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """This dp rank's shard of a parameter of ``shape``: FSDP2's ``torch.chunk`` on dim 0."""
        chunks = torch.chunk(torch.empty(shape[0], device="meta"), self.dp_size)
        rows = len(chunks[self.dp_rank]) if self.dp_rank < len(chunks) else 0
        return (rows, *shape[1:])


def same_experts_mesh(
    params: Iterable[nn.Parameter], experts: ShardedOverReplicas
) -> DeviceMesh | None:
    """The mesh of the replicas holding the same experts as this one (``experts.same_shard``):
    the dimension beside "ep" in the root mesh of the experts' DTensors whose ranks here are
    those replicas.  None when there are none to shard with (ep = dp) or no such dimension
    exists (an ep mesh made on its own): the experts then stay whole, summed apart."""
    if len(experts.same_shard) < 2:
        return None
    meshes = {id(p.device_mesh): p.device_mesh for p in params if id(p) in experts.ids}  # type: ignore[attr-defined]
    if len(meshes) != 1:
        return None
    (ep_mesh,) = meshes.values()
    root = _compat.root_mesh(ep_mesh)
    if root is None:
        return None
    for name in root.mesh_dim_names or ():
        if name in (ep_mesh.mesh_dim_names or ()):
            continue
        beside = root[name]
        if sorted(beside.mesh.flatten().tolist()) == sorted(experts.same_shard):
            return beside
    return None


def _holding(
    stages: Mapping[int, Stage], group: Sequence[int], ids: AbstractSet[int]
) -> list[nn.Module]:
    """The modules of ``group``'s stages that hold parameters in ``ids`` themselves."""
    out: list[nn.Module] = []
    for s in group:
        for m in stages[s].module.modules():
            if any(id(p) in ids for p in m.parameters(recurse=False)) and m not in out:
                out.append(m)
    return out


def _refuse_without_ignored_params(fully_shard: Callable[..., object]) -> None:
    """Refuse experts under ``dp_shard`` where ``fully_shard`` cannot leave them out."""
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise PipelineError(
            f"dp_shard=True with experts sharded over 'dp' (expert parallelism) needs "
            f"fully_shard(ignored_params=), which torch {torch.__version__} lacks: use "
            f"dp_shard=False, or a torch that has it (2.13 does)"
        )


def _connected(stages: Mapping[int, Stage]) -> list[list[int]]:
    """This rank's stages grouped by shared parameters (stages sharing one are one group)."""
    parent = {s: s for s in stages}

    def root(s: int) -> int:
        while parent[s] != s:
            s = parent[s]
        return s

    first: dict[int, int] = {}
    for s, stage in stages.items():
        for p in stage.parameters():
            other = first.setdefault(id(p), s)
            parent[root(s)] = root(other)
    groups: dict[int, list[int]] = {}
    for s in stages:
        groups.setdefault(root(s), []).append(s)
    return list(groups.values())
