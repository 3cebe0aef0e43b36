"""Where a :class:`~zeropipe.runtime.pipeline.Pipeline` runs: its groups, replicas and device.

``Pipeline(mesh=)`` resolved into process groups and this process's pipeline rank
(:class:`Where`); the data-parallel replicas; the check that every replica and
tensor-parallel peer builds the same pipeline; the device the stages compute on; with a
"cp" dimension, the loss on this process's share of the sequence and the check that the
stages are sharded as the mesh says.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zeropipe.base import _compat
from zeropipe.base.device import make_current, resolve_device, single_device
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Schedule
from zeropipe.runtime.replicas.data_parallel import Replicas
from zeropipe.runtime.step.stage import Stage

__all__ = [
    "Where",
    "check_context_parallel",
    "check_same_pipeline",
    "compute_device",
    "context_parallel_loss",
    "replicas_for",
    "resolve_mesh",
]


@dataclass(frozen=True)
class Where:
    """Where a pipeline runs: its process groups, and this process's rank in the pipeline."""

    distributed: bool
    rank: int
    world: int
    pp_group: object | None = None
    dp_group: object | None = None
    dp_mesh: object | None = None  # the mesh's "dp" (with "cp": dp x cp): FSDP2 shards over it
    tp_size: int = 1  # the mesh's "tp" dimension: the user's tensor parallelism
    tp_group: object | None = None
    # The mesh's "cp" dimension (context parallelism, applied to the stages by the user):
    # its ranks are replicas of the weights that hold different tokens of the same rows,
    # so ``dp_group`` then spans dp x cp.
    cp_size: int = 1
    cp_rank: int = 0


def resolve_mesh(mesh: object | None) -> Where:
    """``Pipeline(mesh=)`` as groups: a DeviceMesh, a ProcessGroup, ``"local"`` or None.

    A pipeline group of one process runs locally (that process plays every rank).
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if isinstance(mesh, str) and mesh == "local":
        return Where(False, 0, 1)
    if isinstance(mesh, str):
        raise PipelineError(
            f"mesh={mesh!r}: pass a DeviceMesh, a ProcessGroup, 'local' (this process plays "
            f"every rank) or None (torch.distributed's default group, when initialised)"
        )
    pp_group, dp_group, dp_mesh, tp_size, tp_group = None, None, None, 1, None
    cp_size, cp_rank = 1, 0
    if mesh is None:
        world = os.environ.get("WORLD_SIZE", "1")
        if not initialised and world.isdigit() and int(world) > 1:
            raise PipelineError(
                f"WORLD_SIZE={world} is set (as torchrun sets it) but torch.distributed is not "
                f"initialised, so each of the {world} processes would run the whole pipeline on "
                f"its own: call zeropipe.init_from_env() before building the Pipeline, or pass "
                f"mesh='local' to run every rank in each process on purpose"
            )
    elif hasattr(mesh, "get_group") and hasattr(mesh, "mesh_dim_names"):
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        unknown = [n for n in names if n not in ("pp", "dp", "cp", "tp")]
        if "pp" not in names or unknown or len(set(names)) != len(names):
            raise PipelineError(
                f"mesh has dimensions {names}; Pipeline needs one named 'pp' and, optionally, "
                f"'dp' (data parallel), 'cp' (context parallel) and 'tp' (tensor parallel; "
                f"both applied to the stages with zeropipe.parallelize): "
                f"init_device_mesh(device, (pp, dp, cp, tp), "
                f"mesh_dim_names=('pp', 'dp', 'cp', 'tp'))"
            )
        get_group = mesh.get_group
        pp_group = get_group("pp")
        if "dp" in names:
            dp_group, dp_mesh = get_group("dp"), mesh["dp"]  # type: ignore[index]
        if "tp" in names:
            tp_size, tp_group = int(mesh["tp"].size()), get_group("tp")  # type: ignore[index]
        if "cp" in names and int(mesh["cp"].size()) > 1:  # type: ignore[index]
            cp_size, cp_rank = int(mesh["cp"].size()), int(mesh.get_local_rank("cp"))  # type: ignore[index,attr-defined]
            dp_group = _replicas_over_dp_and_cp(mesh, names)
            # FSDP2 then shards over dp x cp, which sums the gradients (None: the
            # replicas' group, where torch cannot flatten a mesh).
            dp_mesh = _compat.flatten_mesh(mesh, ("dp", "cp") if "dp" in names else ("cp",))
    elif initialised and isinstance(mesh, dist.ProcessGroup):
        pp_group = mesh
    else:
        raise PipelineError(
            f"mesh must be a DeviceMesh (dims 'pp' and optionally 'dp', 'tp'), a ProcessGroup of "
            f"torch.distributed (initialised), 'local' or None; got {type(mesh).__name__}"
        )
    if not initialised:
        return Where(False, 0, 1)
    world_size = dist.get_world_size(pp_group)
    groups = (dp_group, dp_mesh, tp_size, tp_group, cp_size, cp_rank)
    if world_size == 1:
        return Where(False, 0, 1, None, *groups)
    return Where(True, dist.get_rank(pp_group), world_size, pp_group, *groups)


def _replicas_over_dp_and_cp(mesh: object, names: tuple[str, ...]) -> object:
    """The group that sums gradients, counts and losses: this process's dp x cp ranks
    (its "cp" group without "dp"), every such group made by its own members only."""
    import torch.distributed as dist

    if "dp" not in names:
        return mesh.get_group("cp")  # type: ignore[attr-defined]
    here = mesh.get_coordinate()  # type: ignore[attr-defined]
    along = tuple(slice(None) if n in ("dp", "cp") else here[i] for i, n in enumerate(names))
    ranks = sorted(int(r) for r in mesh.mesh[along].flatten().tolist())  # type: ignore[attr-defined]
    return dist.new_group(ranks, use_local_synchronization=True)


def context_parallel_loss(loss_fn: Callable[..., object], where: Where) -> Callable[..., object]:
    """``loss_fn`` on this process's share of the sequence when the mesh has a "cp"
    dimension: the loss's own ``context_parallel(rank, size)`` (``zeropipe.causal_lm_loss``
    has one); any other loss is refused, since it would pair the shard's logits with the
    whole rows' targets."""
    if where.cp_size == 1:
        return loss_fn
    shard = getattr(loss_fn, "context_parallel", None)
    if not callable(shard):
        raise PipelineError(
            f"a mesh with a 'cp' dimension of {where.cp_size} shards every sequence, but "
            f"loss_fn {loss_fn!r} cannot take one rank's tokens: pass "
            f"loss_fn=zeropipe.causal_lm_loss (or a loss with a context_parallel(rank, size) "
            f"method returning the shard's loss)"
        )
    return shard(where.cp_rank, where.cp_size)


def check_context_parallel(where: Where, modules: Sequence[object]) -> None:
    """Refuse a pipeline whose stages and mesh disagree about context parallelism: every
    stage sharded over as many cp ranks as the mesh's "cp" dimension, or none."""
    sizes = {getattr(getattr(m, "context_parallel", None), "size", 1) for m in modules}
    if sizes != {where.cp_size} and modules:
        raise PipelineError(
            f"the mesh's 'cp' dimension has {where.cp_size} rank(s) but the stages are "
            f"sharded over {sorted(sizes)}: call zeropipe.parallelize(stages, "
            f"cp_mesh=mesh['cp']) on the stages of a mesh with a 'cp' dimension, and only "
            f"on those"
        )


def replicas_for(
    dp_group: object | None, timeout: float, *, shard: bool = False
) -> Replicas | None:
    """The data-parallel replicas (None without a group, or with a group of one).

    ``shard`` (``RuntimeOptions.dp_shard``) needs them: it is refused without.
    """
    replicas = None
    if dp_group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError(
                "a mesh with a 'dp' dimension needs torch.distributed initialised first"
            )
        if dist.get_world_size(dp_group) > 1:  # type: ignore[arg-type]
            replicas = Replicas(dp_group, timeout)
    if shard and replicas is None:
        raise PipelineError(
            "RuntimeOptions(dp_shard=True) shards the stages over a data-parallel group: pass "
            "mesh= a DeviceMesh with a 'dp' dimension of more than one rank"
        )
    return replicas


def check_same_pipeline(
    where: Where, schedule: Schedule, stages: Sequence[Stage], timeout: float
) -> None:
    """Refuse, on every process, a pipeline whose schedule or cut differs from its peers'.

    The replicas ("dp") and the tensor-parallel peers ("tp") of a pipeline must run the
    same schedule on the same cut: tensor-parallel peers that do not would pair up
    the collectives of different layers and microbatches, silently.  Each process
    posts a digest of its schedule and stage sizes in the store and compares its
    peers' (within ``timeout`` seconds).
    """
    groups = [g for g in (where.pp_group, where.dp_group, where.tp_group) if g is not None]
    if where.dp_group is None and where.tp_group is None:
        return
    import torch.distributed as dist

    from zeropipe.base._compat import rendezvous_store

    peers = sorted({r for g in groups for r in dist.get_process_group_ranks(g)})  # type: ignore[arg-type]
    if len(peers) < 2:
        return
    me, store = dist.get_rank(), rendezvous_store()
    sizes = [sum(p.numel() for p in st.module.parameters()) for st in stages]
    what = (
        f"{schedule.name!r} on {schedule.num_ranks} rank(s), {schedule.microbatches} "
        f"microbatch(es), stages of {sizes} parameters"
    )
    digest = hashlib.blake2b((schedule.to_text() + repr(sizes)).encode(), digest_size=8).hexdigest()
    n = store.add(f"zeropipe/plans{me}", 1)  # the n-th pipeline of every process is this one
    store.set(f"zeropipe/plan{n}/{me}", json.dumps([digest, what]))
    keys = [f"zeropipe/plan{n}/{r}" for r in peers]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise PipelineError(
            f"process {me}: its replicas and tensor-parallel peers (processes {peers}) did not "
            f"all build the pipeline within {timeout:g} s ({type(exc).__name__}); build it on "
            f"every process"
        ) from exc
    for r in peers:
        theirs, their_what = json.loads(store.get(f"zeropipe/plan{n}/{r}"))
        if theirs != digest:
            raise PipelineError(
                f"process {me} builds {what}, but process {r} builds {their_what} (or the "
                f"same with another order of actions): the pipeline ranks, replicas and "
                f"tensor-parallel peers of one job must run the same schedule on the same "
                f"cut; plan once for every process (zeropipe.auto_plan broadcasts process "
                f"0's plan) or pass the same schedule and balance everywhere"
            )


def compute_device(
    device: torch.device | str | None,
    distributed: bool,
    group: object | None,
    stages: dict[int, Stage],
) -> torch.device | None:
    """Where this process's stages compute (None: where their parameters are, one device).

    An NCCL group implies GPU number ``LOCAL_RANK`` (:func:`zeropipe.base.device.resolve_device`),
    made the process's current device so that NCCL and the kernels agree on it.
    """
    backend = None
    if distributed:
        import torch.distributed as dist

        backend = str(dist.get_backend(group))  # type: ignore[arg-type]
    resolved = resolve_device(device, backend)
    if resolved is None:
        names = ", ".join(str(s) for s in sorted(stages))
        single_device(
            (p.device for st in stages.values() for p in st.parameters()),
            f"the parameters of stage(s) {names}",
        )
    elif distributed:
        make_current(resolved)
    return resolved
