"""How a :class:`~zeropipe.runtime.pipeline.Pipeline` is assembled from its arguments.

The process groups (a mesh, or pipeline and data-parallel groups), the executor,
the rank count of a named schedule, the stages, the parameters shared across
ranks, the compute device and the transport: each a function of the
constructor's arguments, checked here with errors that name the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from zeropipe.base.device import make_current, resolve_device, single_device
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Schedule
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.data_parallel import Replicas
from zeropipe.runtime.stage import Stage, split_sequential
from zeropipe.runtime.transport import Transport

__all__ = [
    "build_stages",
    "compute_device",
    "distributed_transport",
    "executor_mode",
    "named_ranks",
    "replicas_for",
    "resolve_groups",
    "shared_parameters",
]


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


def resolve_groups(
    pp_group: object | None,
    dp_group: object | None,
    mesh: object | None,
    process_group: object | None,
) -> tuple[object | None, object | None]:
    """The pipeline group and the data-parallel group, from the groups or from a mesh."""
    if process_group is not None:
        if pp_group is not None:
            raise PipelineError("pass pp_group= only (process_group= is its former name)")
        warnings.warn(
            "Pipeline(process_group=...) is now pp_group=...", DeprecationWarning, stacklevel=3
        )
        pp_group = process_group
    if mesh is None:
        return pp_group, dp_group
    if pp_group is not None or dp_group is not None:
        raise PipelineError("pass either mesh= or pp_group=/dp_group=, not both")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    get_group = getattr(mesh, "get_group", None)
    if get_group is None:
        raise PipelineError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    unknown = [n for n in names if n not in ("pp", "dp")]
    if "pp" not in names or unknown:
        raise PipelineError(
            f"mesh has dimensions {names}; Pipeline needs one named 'pp' and at most one "
            f"more, named 'dp' (init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp')))"
        )
    return get_group("pp"), (get_group("dp") if "dp" in names else None)


def replicas_for(dp_group: object | None, timeout: float) -> Replicas | None:
    """The data-parallel replicas (None without a group, or with a group of one)."""
    if dp_group is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise PipelineError("dp_group= needs torch.distributed initialised first")
    if dist.get_world_size(dp_group) == 1:  # type: ignore[arg-type]
        return None
    return Replicas(dp_group, timeout)


def executor_mode(executor: str, group: object | None) -> tuple[bool, int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if executor == "local":
        return False, 0, 1
    if executor == "distributed":
        if not initialised:
            raise PipelineError(
                "executor='distributed' needs torch.distributed initialised first: run under "
                "torchrun, or use zeropipe.launch(...)"
            )
    elif executor != "auto":
        raise PipelineError(f"executor must be 'auto', 'local' or 'distributed', got {executor!r}")
    if not initialised:
        return False, 0, 1
    world = dist.get_world_size(group)  # type: ignore[arg-type]
    if executor == "auto" and world == 1:
        return False, 0, 1
    return True, dist.get_rank(group), world  # type: ignore[arg-type]


def named_ranks(
    name: str,
    stages: nn.Sequential | Sequence[nn.Module],
    microbatches: int | None,
    ranks: int | None,
    chunks: int | None,
    world: int,
) -> int:
    """The rank count a named schedule is built for: given, the world, or stages / chunks."""
    if name == "auto":
        raise PipelineError(
            "Pipeline(..., 'auto'): plan first, then run the plan -- "
            "plan = zeropipe.auto_plan(model, ranks, microbatches, sample=(inputs, target), "
            "loss_fn=...) (or costs=...); Pipeline(model, plan.schedule, loss_fn=..., "
            "balance=plan.balance)"
        )
    if microbatches is None:
        raise PipelineError(f"Pipeline(..., {name!r}) needs microbatches=")
    if ranks is not None:
        return ranks
    if world > 1:
        return world
    if isinstance(stages, nn.Sequential):
        raise PipelineError("with an nn.Sequential and a schedule name, pass ranks= (and balance=)")
    gen = GENERATORS.get(name)
    v = chunks if chunks is not None else (gen.default_chunks if gen else 1)
    if len(stages) % v:
        raise PipelineError(
            f"{len(stages)} stage modules cannot be spread as {v} chunk(s) per rank"
        )
    return len(stages) // v


def build_stages(
    stages: nn.Sequential | Sequence[nn.Module], num: int, balance: Sequence[int] | None
) -> list[Stage]:
    if isinstance(stages, nn.Sequential):
        # Cut even when it has exactly one layer per stage: each stage is then a
        # one-layer slice seeded by the layer's index, like any other cut.
        return split_sequential(stages, num, balance)
    modules = list(stages)
    if balance is not None:
        raise PipelineError("balance= applies to an nn.Sequential, not to a list of stage modules")
    if len(modules) != num:
        raise PipelineError(
            f"the schedule has {num} stages but {len(modules)} stage module(s) were given; "
            f"give one module per stage (ranks x chunks) or an nn.Sequential to cut"
        )
    for i, mod in enumerate(modules):
        if not isinstance(mod, nn.Module):
            raise PipelineError(f"stage {i} is a {type(mod).__name__}, not an nn.Module")
    return [Stage(s, m, None) for s, m in enumerate(modules)]


def shared_parameters(stages: list[Stage], placement: Sequence[int]) -> list[nn.Parameter]:
    """Parameters used by stages on more than one rank (tied embeddings), in a stable order.

    A parameter whose stages all run on one rank (the first and last stage of
    a V placement) has its whole gradient there already: it needs no all-reduce.
    """
    ranks: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for stage in stages:
        for p in stage.parameters():
            ranks.setdefault(id(p), set()).add(placement[stage.index])
            params.setdefault(id(p), p)
    return [params[k] for k, r in ranks.items() if len(r) > 1]


def distributed_transport(
    schedule: Schedule,
    rank: int,
    group: object | None,
    timeout: float,
    p2p: str,
    device: torch.device | None,
) -> Transport:
    import torch.distributed as dist

    from zeropipe.runtime.distributed import DistributedTransport
    from zeropipe.runtime.ordered import OrderedTransport

    backend = str(dist.get_backend(group))  # type: ignore[arg-type]
    if p2p == "tagged" and backend != "gloo":
        raise PipelineError(
            f"p2p='tagged' runs over gloo only, but the process group uses {backend!r}: "
            f"{backend} matches messages in issue order and ignores tags; use p2p='ordered' "
            f"(or the default, 'auto')"
        )
    if p2p == "ordered" or backend != "gloo":
        return OrderedTransport(schedule, rank, group=group, timeout=timeout, device=device)
    return DistributedTransport(schedule, rank, group=group, timeout=timeout)
