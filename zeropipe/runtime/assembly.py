"""How a :class:`~zeropipe.runtime.pipeline.Pipeline` is assembled from its arguments.

Where it runs (a mesh, a group, or this process alone), the rank count of a named
schedule, the stages, the parameters shared across ranks, the compute device and the
transport: each a function of the constructor's arguments, checked here with errors
that name the fix.
"""

from __future__ import annotations

import datetime
import difflib
import functools
import hashlib
import inspect
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch import nn

from zeropipe.autograd.split_backward import prepare_split, split_linears
from zeropipe.base import _compat
from zeropipe.base.device import make_current, resolve_device, single_device
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.passes.build import check_count
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.replicas.data_parallel import GradReducer, Replicas, reduction_owners
from zeropipe.runtime.step.stage import Stage, split_sequential
from zeropipe.runtime.transport.base import Transport

__all__ = [
    "PLAIN_BELOW_BYTES",
    "SplitParam",
    "Where",
    "build_stages",
    "check_call",
    "check_materialised",
    "check_same_pipeline",
    "check_stages",
    "checking_call",
    "compute_device",
    "distributed_transport",
    "named_ranks",
    "prepare_linears",
    "replica_reducer",
    "replicas_for",
    "resolve_mesh",
    "shared_parameters",
    "split_params",
]


# On a stage whose schedule has no I or W (every backward a B), an ``nn.Linear`` whose
# weight is smaller than this stays plain: its weight gradient comes from autograd
# inside B.  Larger ones record for split backward anyway, because B then adds their
# weight gradients into ``.grad`` with one fused product, into memory kept from the
# last step, where autograd computes, allocates and adds.  Where that pays depends on
# the rows of a microbatch: about 256 KiB at 8 rows, about 1 MiB at 128 (one thread on
# the 2-vCPU VM, 2026-11-25, ``python benchmarks/plain_linears.py``).  The lower is
# taken: recording where plain would do costs a few percent, the reverse up to 20%.
PLAIN_BELOW_BYTES = 256 * 1024


def prepare_linears(stages: dict[int, Stage], schedule: Schedule) -> None:
    """Record the stages' linears for split backward where the split buys something.

    Every linear of a stage whose backward the schedule splits (runs I or W of);
    on a stage that only runs B, those of at least ``PLAIN_BELOW_BYTES``.  None of a
    ``torch.compile``'d stage module: dynamo traces a linear's backward when it
    compiles the forward, so W could defer nothing; its weight gradients come in I.
    """
    split = {a.stage for acts in schedule.actions for a in acts if a.kind in (Kind.I, Kind.W)}
    for s, stage in stages.items():
        if _compat.uncompiled(stage.module) is not stage.module:
            # Left plain rather than traced: a recorded linear's forward is an object dynamo
            # guards on by identity, which recompiles the stage for every layer.
            stage.linears = ()
            continue
        prepare_split(stage.module, min_weight_bytes=0 if s in split else PLAIN_BELOW_BYTES)
        stage.linears = split_linears(stage.module, allow_plain=True)


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


@dataclass(frozen=True)
class Where:
    """Where a pipeline runs: its process groups, and this process's rank in the pipeline."""

    distributed: bool
    rank: int
    world: int
    pp_group: object | None = None
    dp_group: object | None = None
    dp_mesh: object | None = None  # the mesh's "dp" dimension: FSDP2 shards over it
    tp_size: int = 1  # the mesh's "tp" dimension: the user's tensor parallelism
    tp_group: object | None = None


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
        unknown = [n for n in names if n not in ("pp", "dp", "tp")]
        if "pp" not in names or unknown or len(set(names)) != len(names):
            raise PipelineError(
                f"mesh has dimensions {names}; Pipeline needs one named 'pp' and, optionally, "
                f"'dp' (data parallel) and 'tp' (tensor parallel, applied to the stages by "
                f"the user): init_device_mesh(device, (pp, dp, tp), "
                f"mesh_dim_names=('pp', 'dp', 'tp'))"
            )
        get_group = mesh.get_group
        pp_group = get_group("pp")
        if "dp" in names:
            dp_group, dp_mesh = get_group("dp"), mesh["dp"]  # type: ignore[index]
        if "tp" in names:
            tp_size, tp_group = int(mesh["tp"].size()), get_group("tp")  # type: ignore[index]
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
    if world_size == 1:
        return Where(False, 0, 1, None, dp_group, dp_mesh, tp_size, tp_group)
    rank = dist.get_rank(pp_group)
    return Where(True, rank, world_size, pp_group, dp_group, dp_mesh, tp_size, tp_group)


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


def replica_reducer(
    replicas: Replicas,
    schedule: Schedule,
    stages: Sequence[Stage],
    shared: Sequence[nn.Parameter],
    rank: int,
    distributed: bool,
) -> GradReducer:
    """Which REDUCE_GRAD sums each of this process's parameters across replicas."""
    exclude = {id(p) for p in shared}
    ranks = [rank] if distributed else range(schedule.num_ranks)
    owners: dict[int, list[nn.Parameter]] = {}
    for r in ranks:
        params = {s: list(stages[s].parameters()) for s in schedule.stages_of(r)}
        owners.update(reduction_owners(schedule, r, params, exclude=exclude))
    return GradReducer(replicas.endpoint, owners)


def replicas_for(dp_group: object | None, timeout: float) -> Replicas | None:
    """The data-parallel replicas (None without a group, or with a group of one)."""
    if dp_group is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise PipelineError(
            "a mesh with a 'dp' dimension needs torch.distributed initialised first"
        )
    if dist.get_world_size(dp_group) == 1:  # type: ignore[arg-type]
        return None
    return Replicas(dp_group, timeout)


def named_ranks(
    name: Schedule | str,
    stages: nn.Sequential | Sequence[nn.Module],
    microbatches: int | None,
    world: int,
) -> int | None:
    """The rank count a named schedule is built for: the world, or stages / chunks.

    None for a :class:`~zeropipe.core.ir.Schedule`, which has its own.  In one process,
    a name of several chunks per rank given just one rank's stages is refused: a
    pipeline of one rank is said with a built schedule, never guessed.
    """
    if not isinstance(name, str):
        return None
    if name == "auto":
        raise PipelineError(
            "Pipeline(..., 'auto'): plan first, then run the plan -- "
            "plan = zeropipe.auto_plan(model, ranks, microbatches, sample=(inputs, target), "
            "loss_fn=...) (or costs=...); Pipeline(model, plan.schedule, loss_fn, "
            "balance=plan.balance)"
        )
    if microbatches is None:
        raise PipelineError(f"Pipeline(..., {name!r}) needs microbatches=")
    try:
        # Before the messages below, which would suggest the same bad value back.
        microbatches = check_count("microbatches", microbatches)
    except ScheduleError as exc:
        raise PipelineError(str(exc)) from None
    if world > 1:
        return world
    if isinstance(stages, nn.Sequential):
        raise PipelineError(
            f"in one process, an nn.Sequential and the name {name!r} do not say how many "
            f"ranks: build the schedule first, Pipeline(model, "
            f"zeropipe.build_schedule({name!r}, ranks=R, microbatches={microbatches}), loss_fn)"
        )
    gen = GENERATORS.get(name)
    v = gen.default_chunks if gen else 1
    if len(stages) % v:
        raise PipelineError(
            f"{len(stages)} stage modules cannot be spread as {v} chunk(s) per rank; build "
            f"the schedule with zeropipe.build_schedule({name!r}, ranks=..., chunks=..., "
            f"microbatches={microbatches})"
        )
    if v > 1 and len(stages) == v:
        # Whoever cut a model into 2 stages for zbv meant 2 ranks, not a pipeline of one.
        shape = " (a V)" if name in ("zbv", "dualpipev") else ""
        raise PipelineError(
            f"{name} holds {v} stages per rank{shape}; {v} stages make 1 rank: split into "
            f"{2 * v} stages for 2 ranks, or pass zeropipe.build_schedule({name!r}, ranks=1, "
            f"microbatches={microbatches}) to say you mean one rank"
        )
    return len(stages) // v


def check_stages(stages: object) -> None:
    """Refuse, in one line, a ``stages`` argument that is neither cut nor cuttable."""
    inner = _compat.uncompiled(stages) if isinstance(stages, nn.Module) else stages
    if inner is not stages and isinstance(inner, nn.Sequential):  # compiled whole: uncuttable
        raise PipelineError(
            "Pipeline got a torch.compile'd nn.Sequential, which it cannot cut into stages: "
            "compile each stage instead, Pipeline([torch.compile(s) for s in "
            "zeropipe.split(model, n)], schedule, loss_fn)"
        )
    if isinstance(stages, nn.Sequential) or (
        isinstance(stages, Sequence | nn.ModuleList) and not isinstance(stages, str)
    ):
        return
    what = type(stages).__name__
    raise PipelineError(
        f"Pipeline needs an nn.Sequential (cut into stages) or a list of one nn.Module per "
        f"stage, got a single {what}: cut it with zeropipe.split(model, n) (nn.Sequential and "
        f"the supported Hugging Face models) or pass [stage0, stage1, ...]"
    )


def check_call(args: tuple[object, ...], kwargs: dict[str, object], names: Sequence[str]) -> None:
    """Refuse, in one line, a constructor call that would go wrong: a keyword not among
    ``names`` (with the closest of them, as Python 3.12+ suggests it), microbatches
    passed by position, a ``loss_fn`` that is no loss."""
    unknown = next((k for k in kwargs if k not in names), None)
    if unknown is not None:
        close = difflib.get_close_matches(unknown, names, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"Pipeline.__init__() got an unexpected keyword argument {unknown!r}{hint}")
    if len(args) > 3:
        raise PipelineError(
            f"Pipeline takes at most 3 positional arguments (stages, schedule, loss_fn), got "
            f"{len(args)}; microbatches= and the rest are keywords: "
            f"Pipeline(model, 'zbv', loss_fn, microbatches=8)"
        )
    loss_fn = args[2] if len(args) > 2 else kwargs.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise PipelineError(
            f"loss_fn must be callable, got {type(loss_fn).__name__} {loss_fn!r}; the third "
            f"positional argument is loss_fn (microbatches= is a keyword)"
        )
    if isinstance(loss_fn, type):  # calling a class builds a module, never a loss
        short = loss_fn.__qualname__
        where = f"{loss_fn.__module__}.{short}"
        if getattr(nn, short, None) is loss_fn:  # torch's own, spelt as users import it
            where, short = f"torch.nn.{short}", f"nn.{short}"
        raise PipelineError(
            f"loss_fn is the class {where}, not a loss: pass an instance, {short}()"
        )


def check_materialised(stages: dict[int, Stage]) -> None:
    """Refuse a stage this process runs whose parameters or buffers are on the meta device.

    Only this process's stages: a rank that builds the model on meta may materialise just
    its own stages (``zeropipe train --model-path`` does), and the others stay on meta.
    """
    for s, stage in sorted(stages.items()):
        module = _compat.uncompiled(stage.module)
        named: list[tuple[str, str, torch.Tensor]] = [
            ("parameter", *p) for p in module.named_parameters()
        ]
        named += [("buffer", *b) for b in module.named_buffers()]
        meta = next(((what, name) for what, name, t in named if t.is_meta), None)
        if meta is not None:
            raise PipelineError(
                f"stage {s}'s {meta[0]} {meta[1]!r} is on the meta device (the model was built "
                f"under torch.device('meta')?), which holds no values to compute with: "
                f"materialise it first, model.to_empty(device=...) then initialise it "
                f"(reset_parameters()) or model.load_state_dict(...)"
            )


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


SplitParam = tuple[nn.Parameter, str, list[int]]  # a parameter, its name, the stages using it


def split_params(stages: Sequence[Stage]) -> list[SplitParam]:
    """Parameters used by more than one stage, on any rank (a tied embedding): each with its
    name in the first stage using it and the stages' indices."""
    used: dict[int, SplitParam] = {}
    for stage in stages:
        for name, p in stage.module.named_parameters():
            used.setdefault(id(p), (p, name, []))[2].append(stage.index)
    return [entry for entry in used.values() if len(entry[2]) > 1]


def shared_parameters(split: Sequence[SplitParam], placement: Sequence[int]) -> list[nn.Parameter]:
    """Of the parameters used by several stages (:func:`split_params`), those whose stages run
    on more than one rank (tied embeddings), in a stable order.

    A parameter whose stages all run on one rank (the first and last stage of
    a V placement) has its whole gradient there already: it needs no all-reduce.
    """
    return [p for p, _, used in split if len({placement[s] for s in used}) > 1]


def distributed_transport(
    schedule: Schedule,
    rank: int,
    group: object | None,
    timeout: float,
    p2p: str,
    device: torch.device | None,
) -> Transport:
    import torch.distributed as dist

    from zeropipe.runtime.transport.ordered import OrderedTransport
    from zeropipe.runtime.transport.tagged import DistributedTransport

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


_P = ParamSpec("_P")
_R = TypeVar("_R")


def checking_call(init: Callable[_P, _R]) -> Callable[_P, _R]:
    """``Pipeline.__init__``, its call checked first by :func:`check_call`."""
    names = [n for n in inspect.signature(init).parameters if n != "self"]

    @functools.wraps(init)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        check_call(args[1:], kwargs, names)
        return init(*args, **kwargs)

    return checked
