"""Pipelines replicated across a data-parallel group: the gradient reduction.

Each replica of the pipeline runs the same schedule on its own slice of the
global batch.  The loss contract weights each replica's microbatches by the
*global* item count (:func:`global_count`), so a replica's gradient is its
share of the global batch's gradient, and the sum over replicas is exactly
that gradient, whatever the slices hold (equal rows, or token counts that
differ per slice).  The sum is posted per stage by the schedule's
REDUCE_GRAD action, as soon as the stage's last backward on this rank has
run, so it overlaps the compute of the stages still running::

    rank's actions:  ... 1W7  1REDUCE_GRAD  0W6  0W7  0REDUCE_GRAD
                              └─ all-reduce of stage 1's grads ─┐ (in flight)
                                                  wait_all() at the end of the step

A parameter used by several stages on one rank (a V placement's tied
embedding) is reduced by the REDUCE_GRAD that comes last among them, once.

Experts sharded over the replicas (expert parallelism inside data parallelism:
``zeropipe.parallelize(stages, ep_mesh=)`` over "dp", or over blocks of ep
consecutive replicas) are summed only over the replicas that hold the same
experts (none when ep = dp): every replica's tokens were sent to the replicas
holding their experts, so each shard's gradient already holds its block's tokens
(:func:`sharded_over_replicas`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.simulate import Event
from zeropipe.runtime.transport.endpoint import Endpoint, all_reduce, connect, flatten, unflatten

__all__ = [
    "GradReducer",
    "Reduction",
    "Replicas",
    "ShardedOverReplicas",
    "experts_reducer",
    "reduction_order",
    "reduction_owners",
    "reductions_as_run",
    "sharded_over_replicas",
]


@dataclass
class Reduction:
    """One stage's posted all-reduce: flat buffers per dtype, the work, when it ran."""

    stage: int
    grads: list[list[Tensor]]  # per flat buffer, the .grad tensors it was cut from
    flats: list[Tensor]
    works: list[object]
    posted: float
    done: list[float] = field(default_factory=list)  # completion time (perf_counter), if seen


def reduction_order(schedule: Schedule, rank: int, stages: Iterable[int]) -> list[int]:
    """The stages of ``rank``'s REDUCE_GRAD actions, in order; every one of ``stages`` has one."""
    order = [a.stage for a in schedule.actions[rank] if a.kind is Kind.REDUCE_GRAD]
    missing = sorted(set(stages) - set(order))
    if missing:
        raise PipelineError(
            f"rank {rank}: stage(s) {missing} have no REDUCE_GRAD action, so their gradients "
            f"would never be reduced across data-parallel replicas; build the schedule with "
            f"reduce_grad=True (Pipeline does this when given a data-parallel group)"
        )
    return order


def reduction_owners(
    schedule: Schedule,
    rank: int,
    params: Mapping[int, Sequence[nn.Parameter]],
    exclude: AbstractSet[int] = frozenset(),
) -> dict[int, list[nn.Parameter]]:
    """Which stage's REDUCE_GRAD reduces each parameter of ``rank``: the last one using it.

    ``params[s]`` are stage ``s``'s parameters (the stages on ``rank``);
    parameters whose ``id`` is in ``exclude`` (shared with another rank's
    stages, reduced at the end of the step) are left out.  A stage with no
    REDUCE_GRAD in the schedule is refused: its gradients would never be reduced.
    """
    order = reduction_order(schedule, rank, params)
    owner: dict[int, int] = {}
    for s in order:  # later REDUCE_GRADs overwrite: a shared parameter goes to the last
        for p in params[s]:
            owner[id(p)] = s
    out: dict[int, list[nn.Parameter]] = {s: [] for s in params}
    seen: set[int] = set()
    for s in params:
        for p in params[s]:
            if id(p) not in seen and id(p) not in exclude and p.requires_grad:
                seen.add(id(p))
                out[owner[id(p)]].append(p)
    return out


@dataclass(frozen=True)
class ShardedOverReplicas:
    """Parameters sharded over the replicas (experts under expert parallelism, ep inside dp).

    ``ids``: those parameters (DTensors sharded over all the replicas or over a block of
    them); ``same_shard``: the global ranks of the replicas holding this process's shard
    of them, in order (this process alone when ep = dp).
    """

    ids: frozenset[int]
    same_shard: tuple[int, ...]


def sharded_over_replicas(params: Iterable[nn.Parameter], group: object) -> ShardedOverReplicas:
    """Which of ``params`` the replicas (``group``) hold in shards, and who shares this one's.

    A DTensor sharded over the replicas' ranks (an expert of a mixture sharded over
    "ep" = "dp") holds on each replica other experts, whose gradient every replica's
    tokens already reached: summing it over the replicas would add different experts
    together.  Sharded over a block of ``ep`` consecutive replicas (ep inside dp, ep
    dividing dp), its gradient is summed over the replicas at the same place in the
    other blocks, which hold the same experts.  Any other layout is refused.
    """
    from torch.distributed.tensor import DTensor

    replicas = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
    me = dist.get_rank()
    ids: set[int] = set()
    blocks: set[tuple[int, ...]] = set()
    for p in params:
        if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements):
            continue
        ranks = tuple(p.device_mesh.mesh.flatten().tolist())
        if not set(ranks) <= set(replicas) or len(ranks) == 1:
            continue  # tensor parallelism: its peers are not replicas
        ids.add(id(p))
        blocks.add(ranks)
    if not ids:
        return ShardedOverReplicas(frozenset(), (me,))
    block = next(iter(blocks))
    ep = len(block)
    starts = range(0, len(replicas), ep)
    if (
        len(blocks) > 1
        or len(replicas) % ep
        or block not in {tuple(replicas[i : i + ep]) for i in starts}
    ):
        raise PipelineError(
            f"parameters are sharded over ranks {sorted(map(list, blocks))}, which are not "
            f"one block of consecutive data-parallel replicas {replicas}: expert parallelism "
            f"inside data parallelism shards over ep consecutive replicas, ep dividing dp "
            f"(ep_mesh=mesh['dp'] for ep = dp)"
        )
    place = replicas.index(me) % ep
    return ShardedOverReplicas(frozenset(ids), tuple(replicas[place::ep]))


class GradReducer:
    """Sums each stage's gradients over the data-parallel group, asynchronously.

    ``post(stage)`` flattens the stage's gradients (one buffer per dtype and
    device), posts ``all_reduce(SUM)`` without waiting and returns;
    ``wait_all()`` (end of step) waits for every posted reduction, within the
    endpoint's time limit, and copies the sums back into ``.grad``.  ``apart``: the
    reducer of parameters summed over another group (experts, over the replicas that
    hold the same ones), posted and waited with this one.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        owners: dict[int, list[nn.Parameter]],
        apart: GradReducer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.owners = owners
        self.apart = apart
        self.pending: list[Reduction] = []
        self.last: list[Reduction] = []  # the last step's reductions, for the timeline

    def post(self, stage: int) -> None:
        params = self.owners.get(stage)
        if params is None:
            raise PipelineError(f"REDUCE_GRAD of stage {stage}: this rank does not run it")
        grads: list[Tensor] = []
        for p in params:
            if p.grad is None:  # unused this step: it contributes zeros, as its peers expect
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        red = Reduction(stage, [], [], [], time.perf_counter())
        for group, flat in flatten(grads):
            what = f"the data-parallel all-reduce of stage {stage}'s gradients"
            work = self.endpoint.call(
                partial(dist.all_reduce, flat, group=self.endpoint.group, async_op=True), what
            )
            _note_completion(work, red)
            red.grads.append(group)
            red.flats.append(flat)
            red.works.append(work)
        self.pending.append(red)
        if self.apart is not None:
            self.apart.post(stage)

    def wait_all(self) -> None:
        done, self.pending = self.pending, []
        for red in done:
            what = f"the data-parallel all-reduce of stage {red.stage}'s gradients"
            self.endpoint.wait(self.endpoint.pending(red.works, [(what, None)] * len(red.works)))
            if not red.done:  # no completion callback: when the wait saw it done
                red.done.append(time.perf_counter())
            for group, flat in zip(red.grads, red.flats, strict=True):
                unflatten(group, flat)
            red.flats = []
        self.last = done
        if self.apart is not None:
            self.apart.wait_all()


def experts_reducer(
    experts: ShardedOverReplicas, owners: dict[int, list[nn.Parameter]], timeout: float
) -> GradReducer | None:
    """The sums of ``experts``' gradients over the replicas holding the same experts, at
    each stage's REDUCE_GRAD (``owners``); None when this replica alone holds its shard."""
    if len(experts.same_shard) < 2:
        return None
    # Only the replicas of the group make it: each block of replicas has its own.
    group = dist.new_group(list(experts.same_shard), use_local_synchronization=True)
    rank = experts.same_shard.index(dist.get_rank())
    return GradReducer(connect(rank, group, timeout), owners)


def _note_completion(work: object, red: Reduction) -> None:
    """Record when the collective completed (for the measured timeline), where torch can tell."""
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return
    # A backend without futures raises: the timeline then shows no completion.
    with contextlib.suppress(RuntimeError):
        get_future().then(lambda _f: red.done.append(time.perf_counter()))


class Replicas:
    """This process's data-parallel group: the step's collectives across replicas.

    Every collective here is issued in the same order on every replica (they
    run the same schedule), posted asynchronously and waited on within the
    pipeline's time limit, watching for failed peers.
    """

    def __init__(self, group: object, timeout: float) -> None:
        self.group = group
        self.size = dist.get_world_size(group)  # type: ignore[arg-type]
        self.rank = dist.get_rank(group)  # type: ignore[arg-type]
        self.endpoint: Endpoint = connect(self.rank, group, timeout)

    def total(self, local: float) -> float:
        """The sum of ``local`` over the replicas (a loss's item count)."""
        t = torch.tensor([local], dtype=torch.float64)
        all_reduce(self.endpoint, [t], "the data-parallel sum of the loss's item count")
        return float(t.item())

    def sum_(self, tensors: Sequence[Tensor], what: str) -> None:
        """Sum ``tensors`` over the replicas, in place (one flat all-reduce per dtype)."""
        all_reduce(self.endpoint, tensors, what)

    def fail(self, error: BaseException) -> None:
        self.endpoint.failures.record(error)


def reductions_as_run(events: list[list[Event]], done: list[Reduction]) -> list[list[Event]]:
    """Each REDUCE_GRAD event from its post to its all-reduce's completion (the executor saw
    only the post), so the timeline shows the reduction while other actions run."""
    ends = {red.stage: max(red.done) for red in done if red.done}
    return [
        [
            replace(e, end=max(e.end, ends[e.action.stage]))
            if e.action.kind is Kind.REDUCE_GRAD and e.action.stage in ends
            else e
            for e in evs
        ]
        for evs in events
    ]
