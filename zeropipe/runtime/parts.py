"""What a :class:`~zeropipe.runtime.pipeline.Pipeline` is built of, and how.

:func:`build_parts` turns the constructor's arguments into one frozen :class:`Parts`,
building each part once, in one order that a reader can follow from top to bottom::

    options -> where it runs, the loss contract (of this process's tokens under "cp"),
    replicas -> schedule -> stages (all, then this process's, prepared) -> shared
    parameters -> transport -> memory manager -> reducer -> gradient memory

Where it runs, the replicas and the compute device are resolved by
:mod:`zeropipe.runtime.mesh`; the rest is here, each checked with errors that name
the fix: the call itself (keywords, positional arguments, ``loss_fn``), a named
schedule's rank count, the stages, which linears record for split backward, the
parameters shared across ranks, the reducer and the transport.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch import nn

from zeropipe.autograd.grad_memory import GradMemory
from zeropipe.autograd.split_backward import prepare_split, split_linears
from zeropipe.base import _compat
from zeropipe.core.deps import Dependencies, Graph
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.build import build_schedule, check_count
from zeropipe.core.passes.fuse import fused_weights
from zeropipe.core.schedules import GENERATORS
from zeropipe.runtime.memory.manager import MemoryManager
from zeropipe.runtime.mesh import (
    Where,
    check_context_parallel,
    check_same_pipeline,
    compute_device,
    context_parallel_loss,
    replicas_for,
    resolve_mesh,
)
from zeropipe.runtime.options import RuntimeOptions, options_or_default
from zeropipe.runtime.replicas.data_parallel import (
    GradReducer,
    Replicas,
    experts_reducer,
    reduction_owners,
    sharded_over_replicas,
)
from zeropipe.runtime.replicas.fsdp import ShardedReducer
from zeropipe.runtime.step.batch_norm import DeferredNorms
from zeropipe.runtime.step.executor import LocalTransport
from zeropipe.runtime.step.loss_contract import LossContract, LossCountFn, LossFn
from zeropipe.runtime.step.pairs import PairWorker
from zeropipe.runtime.step.stage import Stage, split_sequential
from zeropipe.runtime.transport.base import Transport

__all__ = [
    "PLAIN_BELOW_BYTES",
    "Parts",
    "SplitParam",
    "build_parts",
    "build_stages",
    "check_call",
    "check_materialised",
    "check_stages",
    "checking_call",
    "distributed_transport",
    "named_ranks",
    "prepare_linears",
    "reducer_for",
    "schedule_for",
    "shared_parameters",
    "split_params",
]

SplitParam = tuple[nn.Parameter, str, list[int]]  # a parameter, its name, the stages using it


@dataclass(frozen=True)
class Parts:
    """What a pipeline is built of: each part made once by :func:`build_parts`, in the
    order of these fields, from the constructor's arguments and the parts above it."""

    options: RuntimeOptions
    where: Where  # the process groups, and this process's pipeline rank
    loss: LossContract | None  # how microbatch losses make the batch's; None: no loss_fn
    replicas: Replicas | None  # the data-parallel group, when it holds several processes
    schedule: Schedule
    all_stages: list[Stage]  # every stage of the model, whichever rank runs it
    deps: Dependencies
    graph: Graph  # the order a local step runs every rank's actions in
    fused_weights: frozenset[Action]  # W actions run together with their stage's next W
    stages: dict[int, Stage]  # those this process runs, prepared for split backward
    owns_last: bool  # whether they hold the last stage, which computes the loss
    norms: DeferredNorms | None  # their deferred BatchNorms; None: they hold none
    device: torch.device | None  # where they compute; None: where their parameters are
    tied: list[SplitParam]  # parameters used by several stages (a hook on one is refused)
    # Those of ``tied`` whose gradients the step's end sums: used by stages on several
    # ranks, unless the sharded reducer sums their shards itself.
    shared: list[nn.Parameter]
    transport: Transport
    memory: MemoryManager  # saved-activation accounting, activation and weight offload
    # REDUCE_GRAD's sum across the replicas (a ShardedReducer with dp_shard); None: none.
    reducer: GradReducer | None
    sharded: ShardedReducer | None  # the reducer, when it shards the stages (dp_shard)
    grad_memory: GradMemory | None  # weight-gradient memory kept between steps
    # Runs the backward halves of overlapped pairs at once with their forwards; None: the
    # schedule has no pairs, or RuntimeOptions(overlap=False) runs them in sequence.
    pairs: PairWorker | None


def build_parts(
    stages: nn.Sequential | Sequence[nn.Module],
    schedule: Schedule | str,
    loss_fn: LossFn | None,
    *,
    microbatches: int | None,
    loss_count: LossCountFn | None,
    balance: Sequence[int] | None,
    mesh: object | None,
    options: RuntimeOptions | None,
) -> Parts:
    """The parts of ``Pipeline(stages, schedule, loss_fn, ...)``, each built once, in the
    order of :class:`Parts`' fields."""
    check_stages(stages)
    opts = options_or_default(options)
    where = resolve_mesh(mesh)
    if loss_fn is not None:  # with a "cp" dimension: the loss of this process's tokens
        loss_fn = context_parallel_loss(loss_fn, where)
    loss = None if loss_fn is None else LossContract(loss_fn, loss_count, autocast=opts.autocast)
    replicas = replicas_for(where.dp_group, opts.timeout, shard=opts.dp_shard)
    plan = schedule_for(schedule, stages, microbatches, where, replicas, opts.dp_shard)
    all_stages = with_copies(
        build_stages(stages, plan.num_stages - len(plan.copies), balance, len(plan.copies)), plan
    )
    check_context_parallel(where, [st.module for st in all_stages])
    check_same_pipeline(where, plan, all_stages, opts.timeout)
    deps = Dependencies(plan)
    ran_here = plan.stages_of(where.rank) if where.distributed else range(plan.num_stages)
    mine = {s: all_stages[s] for s in ran_here}
    check_materialised(mine)  # only this process's: other ranks' may stay on meta
    # Deferred BatchNorms update their running statistics once per step (batch_norm.py).
    norms = DeferredNorms({s: stage.module for s, stage in mine.items()})
    device = compute_device(opts.device, where.distributed, where.pp_group, mine)
    prepare_linears(mine, plan)
    for stage in mine.values():
        stage.autocast = opts.autocast
    tied = split_params(all_stages)
    across_ranks = shared_parameters(tied, plan.placement)
    transport: Transport = (
        distributed_transport(plan, where.rank, where.pp_group, opts.timeout, opts.p2p, device)
        if where.distributed
        else LocalTransport()
    )
    memory = MemoryManager(plan, mine, all_stages, device, opts.count_saved)
    # After the memory manager, which counts the full parameters a step holds (FSDP shards them).
    reducer = reducer_for(
        replicas, plan, all_stages, mine, across_ranks, where, transport, device, opts.dp_shard
    )
    # A gradient kept for reuse would hold, on the device, the memory that weight offload
    # frees (every offloaded stage's gradients at once); FSDP frees full gradients itself.
    keep_grads = opts.keep_grad_memory and not memory.weights and not opts.dp_shard
    return Parts(
        options=opts,
        where=where,
        loss=loss,
        replicas=replicas,
        schedule=plan,
        all_stages=all_stages,
        deps=deps,
        graph=Graph(plan, deps),
        fused_weights=fused_weights(plan),
        stages=mine,
        owns_last=any(deps.last_stage(i) in mine for i in range(plan.microbatches)),
        norms=norms if norms.norms else None,
        device=device,
        tied=tied,
        # With dp_shard the sharded reducer sums the shards of parameters shared by ranks.
        shared=[] if opts.dp_shard else across_ranks,
        transport=transport,
        memory=memory,
        reducer=reducer,
        sharded=reducer if isinstance(reducer, ShardedReducer) else None,
        grad_memory=GradMemory() if keep_grads else None,
        pairs=PairWorker() if opts.overlap and plan.overlaps else None,
    )


def schedule_for(
    schedule: Schedule | str,
    stages: nn.Sequential | Sequence[nn.Module],
    microbatches: int | None,
    where: Where,
    replicas: Replicas | None,
    dp_shard: bool,
) -> Schedule:
    """The schedule to run: ``schedule`` built (a name generated for :func:`named_ranks`
    ranks, REDUCE_GRAD added for replicas), checked against where it runs."""
    try:
        built = build_schedule(
            schedule,
            ranks=named_ranks(schedule, stages, microbatches, where.world),
            microbatches=microbatches,
            reduce_grad=replicas is not None,
        )
    except ScheduleError as exc:
        raise PipelineError(str(exc)) from exc
    if where.distributed and built.num_ranks != where.world:
        raise PipelineError(
            f"schedule {built.name!r} has {built.num_ranks} rank(s) but the pipeline's "
            f"process group has {where.world}; launch {built.num_ranks} processes or build "
            f"the schedule for {where.world} ranks "
            f"(zeropipe.build_schedule(name, ranks={where.world}, microbatches=...))"
        )
    if dp_shard and any(a.is_weight_copy for acts in built.actions for a in acts):
        raise PipelineError(
            f"dp_shard=True with weight OFFLOAD/RELOAD in schedule {built.name!r}: "
            f"the weights would be both sharded and offloaded; use one or the other"
        )
    return built


def reducer_for(
    replicas: Replicas | None,
    schedule: Schedule,
    all_stages: Sequence[Stage],
    stages: dict[int, Stage],
    shared: Sequence[nn.Parameter],
    where: Where,
    transport: Transport,
    device: torch.device | None,
    dp_shard: bool,
) -> GradReducer | None:
    """What each REDUCE_GRAD sums across the replicas (None without replicas).

    With ``dp_shard`` a :class:`ShardedReducer` over this process's ``stages``; else a
    :class:`GradReducer` of each parameter at the REDUCE_GRAD of the last stage using it,
    ``shared`` parameters left to the step's end.  Either way experts sharded over the
    replicas (expert parallelism inside dp) are summed apart, over the replicas holding
    the same experts only, and FSDP2 leaves them whole.
    """
    if replicas is None:
        return None
    every = [p for st in all_stages for p in st.parameters()]
    experts = sharded_over_replicas(every, replicas.group)
    ranks = [where.rank] if where.distributed else range(schedule.num_ranks)
    owners: dict[int, list[nn.Parameter]] = {}
    apart: dict[int, list[nn.Parameter]] = {}
    for r in ranks:
        params = {s: list(all_stages[s].parameters()) for s in schedule.stages_of(r)}
        if not dp_shard:
            exclude = {id(p) for p in shared} | experts.ids
            owners.update(reduction_owners(schedule, r, params, exclude=exclude))
        held = {s: [p for p in ps if id(p) in experts.ids] for s, ps in params.items()}
        apart.update(reduction_owners(schedule, r, held))
    apart_reducer = experts_reducer(experts, apart, replicas.endpoint.timeout)
    if not dp_shard:
        return GradReducer(replicas.endpoint, owners, apart_reducer)
    first_param = next((p for st in stages.values() for p in st.parameters()), None)
    return ShardedReducer(
        replicas,
        schedule,
        stages,
        # In one process playing every pipeline rank a tied parameter is whole here.
        shared if where.distributed else [],
        transport.reduce_shared,
        device or (first_param.device if first_param is not None else torch.device("cpu")),
        where.dp_mesh,
        experts=experts if experts.ids else None,
        apart=apart_reducer,
    )


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
    stages: nn.Sequential | Sequence[nn.Module],
    num: int,
    balance: Sequence[int] | None,
    copies: int = 0,
) -> list[Stage]:
    """``num`` stages from a model to cut or one module per stage (``copies``: how many
    more the schedule runs as copies of these, named in the refusal of a wrong count)."""
    if isinstance(stages, nn.Sequential):
        # Cut even when it has exactly one layer per stage: each stage is then a
        # one-layer slice seeded by the layer's index, like any other cut.
        return split_sequential(stages, num, balance)
    modules = list(stages)
    if balance is not None:
        raise PipelineError("balance= applies to an nn.Sequential, not to a list of stage modules")
    if len(modules) != num:
        raise PipelineError(
            f"the schedule has {num} stages"
            + (f" (and {copies} copies of them, run on their modules)" if copies else "")
            + f" but {len(modules)} stage module(s) were given; "
            f"give one module per stage (ranks x chunks) or an nn.Sequential to cut"
        )
    for i, mod in enumerate(modules):
        if not isinstance(mod, nn.Module):
            raise PipelineError(f"stage {i} is a {type(mod).__name__}, not an nn.Module")
    return [Stage(s, m, None) for s, m in enumerate(modules)]


def with_copies(originals: list[Stage], schedule: Schedule) -> list[Stage]:
    """The stages of ``schedule``: ``originals`` (the model's), then each copy (DualPipe's
    second direction) running the module of the stage it copies.

    A copy shares its original's parameters, so :func:`split_params` finds them used by
    two stages: in one process both add into the same ``.grad``; on two ranks the step's
    end sums them as it sums any parameter tied across ranks.
    """
    copies = dict(schedule.copies)
    out = list(originals)
    for s in range(len(originals), schedule.num_stages):
        if s not in copies:
            raise PipelineError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages, {len(copies)} of "
                f"them copies, but stage {s} is neither given nor a copy"
            )
        original = originals[copies[s]]
        copy = Stage(original.index, original.module, original.layer_keys)
        copy.index = s
        out.append(copy)
    return out


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
