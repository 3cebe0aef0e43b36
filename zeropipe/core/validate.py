"""The validator: a schedule is accepted only if it can run and gives the right gradients.

Checks, in order (the first broken rule raises ``ScheduleError`` naming the
offending actions and showing the rank x step grid with them marked):

1. shape: stages and microbatches in range, each action on the rank owning its stage;
2. completeness: per (stage, microbatch) on the microbatch's route one F, one B
   or one I + one W, at most one R, OFFLOAD/RELOAD in pairs, and nothing off it; in a lowered schedule exactly the SEND/RECV
   actions the dependency model asks for; weight OFFLOAD/RELOAD alternate;
   gradient reduction: no REDUCE_GRAD at all, or exactly one per stage;
3. order: a dependency on the same rank comes earlier in that rank's list (so a
   stage's REDUCE_GRAD follows all its B and W); no compute of a stage while its
   weights are offloaded; each overlapped pair adjacent, its backward not
   needing its forward;
4. deadlock: the (rank, step) graph of :mod:`zeropipe.core.deps` has no cycle (an
   overlapped pair waits for the inputs of both its actions);
5. memory (optional): each rank's peak, from :mod:`zeropipe.core.costs`, fits a limit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies, Graph, offloaded_at_start
from zeropipe.core.errors import ScheduleError
from zeropipe.core.gc_pause import paused_gc
from zeropipe.core.ir import COMM_KINDS, KINDS, Action, Kind, Schedule, format_grid
from zeropipe.core.memory import peak_memory, per_rank

__all__ = ["validate"]


def validate(
    schedule: Schedule,
    *,
    memory_limit: float | Sequence[float] | None = None,
    costs: CostModel | None = None,
) -> Graph:
    """Check every rule; return the dependency graph (reused by the simulator).

    ``memory_limit`` is one number for every rank or one per rank, in the unit
    of ``costs`` (default: uniform costs, i.e. microbatches of one rank's layers).
    """
    with paused_gc():
        return _validate(schedule, memory_limit, costs)


def _validate(
    schedule: Schedule, memory_limit: float | Sequence[float] | None, costs: CostModel | None
) -> Graph:
    deps = Dependencies(schedule)
    graph = Graph(schedule, deps, sort=False) if _looks_valid(schedule, deps) else None
    if graph is None or graph.backward_edge is not None:
        # Something is off, or the schedule has weight copies: the full checks, in order,
        # name the first broken rule (if there is one).
        _check_shape(schedule)
        _check_complete(schedule, deps)
        _check_reductions(schedule)
        _check_order(schedule, deps)
        graph = graph or Graph(schedule, deps, sort=False)
    _check_overlaps(schedule, deps)
    graph.sort()
    if memory_limit is not None:
        costs = costs or CostModel.uniform_for(schedule)
        _check_memory(schedule, costs, deps, memory_limit)
    return graph


_NO = {k: n for n, k in enumerate(KINDS)}
_BIT = {k: 1 << n for n, k in enumerate(KINDS)}
_CORE = _BIT[Kind.F] | _BIT[Kind.B] | _BIT[Kind.I] | _BIT[Kind.W]
_WHOLE = (_BIT[Kind.F] | _BIT[Kind.B], _BIT[Kind.F] | _BIT[Kind.I] | _BIT[Kind.W])
_COMM_BITS = _BIT[Kind.SEND_F] | _BIT[Kind.RECV_F] | _BIT[Kind.SEND_B] | _BIT[Kind.RECV_B]


def _looks_valid(schedule: Schedule, deps: Dependencies) -> bool:
    """Whether the shape, completeness and reduction checks would all pass, on integers.

    True only when they would (the tests pin it); False also for what this quick
    pass does not judge (weight copies), and for every broken rule, which the full
    checks then name.  A big schedule has ~10^5 actions: the full checks build an
    object per action and dependency, this looks at each action once.
    """
    m, stages, place = schedule.microbatches, schedule.num_stages, schedule.placement
    if any(not schedule.stages_of(r) for r in range(schedule.num_ranks)):
        return False
    reduce_no = _NO[Kind.REDUCE_GRAD]
    counted = 0  # actions with a microbatch
    reduced: list[int] = []
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            s, i = a.stage, a.microbatch
            if s >= stages or place[s] != r:
                return False
            if i is None:
                if a.kind_no != reduce_no:
                    return False  # a weight copy
                reduced.append(s)
            elif i >= m:
                return False
            else:
                counted += 1
    if reduced and sorted(reduced) != list(range(stages)):
        return False
    lowered = schedule.is_lowered
    cross = [deps.crosses(s, s + 1) for s in range(stages - 1)]
    offload, reload = _NO[Kind.OFFLOAD], _NO[Kind.RELOAD]
    bits_total = 0
    for i in range(m):
        first, last = deps.first_stage(i), deps.last_stage(i)
        for s in range(first, last + 1):
            bits = deps.kind_bits(s, i)
            want = 0  # the SEND/RECV bits a lowered schedule has here
            if lowered and s < last and cross[s]:
                want |= _BIT[Kind.SEND_F] | _BIT[Kind.RECV_B]
            if lowered and s > first and cross[s - 1]:
                want |= _BIT[Kind.RECV_F] | _BIT[Kind.SEND_B]
            if (
                (bits & _CORE) not in _WHOLE
                or (bits & _COMM_BITS) != want
                or (bits >> offload & 1) != (bits >> reload & 1)
            ):
                return False
            bits_total += bits.bit_count()
    return bits_total == counted  # else some action appears twice, or one is off its route


def _fail(
    schedule: Schedule, message: str, rule: str, where: Sequence[tuple[int, int]]
) -> ScheduleError:
    acts = tuple(str(schedule.actions[r][k]) for r, k in where)
    return ScheduleError(
        message, rule=rule, actions=acts, grid=format_grid(schedule.actions, where)
    )


def _check_shape(schedule: Schedule) -> None:
    m, stages = schedule.microbatches, schedule.num_stages
    idle = [r for r in range(schedule.num_ranks) if not schedule.stages_of(r)]
    if idle:
        raise ScheduleError(
            f"rank(s) {idle} own no stage in placement {list(schedule.placement)}; "
            f"use fewer ranks or place a stage on each",
            rule="placement",
        )
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if a.stage >= stages:
                raise _fail(
                    schedule,
                    f"{a} names stage {a.stage}, but the schedule has stages 0..{stages - 1}",
                    "range",
                    [(r, k)],
                )
            if a.microbatch is not None and a.microbatch >= m:
                raise _fail(
                    schedule,
                    f"{a} names microbatch {a.microbatch}, but the schedule has microbatches 0..{m - 1}",
                    "range",
                    [(r, k)],
                )
            if schedule.placement[a.stage] != r:
                raise _fail(
                    schedule,
                    f"{a} is on rank {r}, but stage {a.stage} is placed on rank "
                    f"{schedule.placement[a.stage]}: move it there or change the placement",
                    "placement",
                    [(r, k)],
                )


def _check_complete(schedule: Schedule, deps: Dependencies) -> None:
    """The completeness rules of the module docstring, in the order their errors are reported."""
    where = _places(schedule)
    _check_no_duplicates(schedule, where)
    _check_microbatches(schedule, deps, where)
    if schedule.is_lowered:
        _check_comm(schedule, deps, where)
    _check_weight_copies(schedule)


# Each action with a microbatch -> its (rank, index) places: more than one is a duplicate.
_Places = dict[Action, list[tuple[int, int]]]


def _places(schedule: Schedule) -> _Places:
    """Where each action with a microbatch stands, as (rank, index) pairs, in rank order."""
    where: _Places = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if a.microbatch is not None:
                where.setdefault(a, []).append((r, k))
    return where


def _first_of(where: _Places, stage: int, mb: int) -> list[tuple[int, int]]:
    """The place of the first-listed action of (``stage``, ``mb``), to mark what is missing."""
    hits = [p[0] for a, p in where.items() if a.stage == stage and a.microbatch == mb]
    return hits[:1]


def _check_no_duplicates(schedule: Schedule, where: _Places) -> None:
    for a, places in where.items():
        if len(places) > 1:
            raise _fail(
                schedule,
                f"{a} appears {len(places)} times; it must appear once",
                "duplicate",
                places,
            )


def _check_microbatches(schedule: Schedule, deps: Dependencies, where: _Places) -> None:
    """Per (stage, microbatch): one F, one B or one I + one W, OFFLOAD/RELOAD in pairs."""
    for s in range(schedule.num_stages):
        for i in range(schedule.microbatches):
            have = deps.kinds(s, i)
            if not deps.visits(s, i):
                if have:
                    raise _fail(
                        schedule,
                        f"stage {s} is not on the route of microbatch {i} "
                        f"({list(schedule.route(i))}), but the schedule has "
                        f"{', '.join(str(Action(k, s, i)) for k in sorted(have, key=KINDS.index))}",
                        "route",
                        _first_of(where, s, i),
                    )
                continue
            if Kind.F not in have:
                raise _fail(
                    schedule,
                    f"{Action(Kind.F, s, i)} is missing: stage {s} never runs "
                    f"the forward of microbatch {i}",
                    "missing",
                    _first_of(where, s, i),
                )
            _check_backward(schedule, where, have, s, i)
            if (Kind.OFFLOAD in have) != (Kind.RELOAD in have):
                present, absent = (
                    (Kind.OFFLOAD, Kind.RELOAD)
                    if Kind.OFFLOAD in have
                    else (Kind.RELOAD, Kind.OFFLOAD)
                )
                raise _fail(
                    schedule,
                    f"{Action(absent, s, i)} is missing: {Action(present, s, i)} "
                    f"must come in an OFFLOAD/RELOAD pair",
                    "missing",
                    where[Action(present, s, i)],
                )


def _check_backward(
    schedule: Schedule, where: _Places, have: frozenset[Kind], s: int, i: int
) -> None:
    """Stage ``s`` microbatch ``i`` has a full backward B or a split one (I and W), not both."""
    if Kind.B in have and (Kind.I in have or Kind.W in have):
        split = Action(Kind.I if Kind.I in have else Kind.W, s, i)
        raise _fail(
            schedule,
            f"stage {s} microbatch {i} has both a full backward "
            f"{Action(Kind.B, s, i)} and a split one ({split}); keep one",
            "duplicate",
            where[Action(Kind.B, s, i)] + where[split],
        )
    if Kind.B not in have and Kind.I not in have and Kind.W not in have:
        raise _fail(
            schedule,
            f"stage {s} microbatch {i} has no backward: add "
            f"{Action(Kind.B, s, i)} (or {Action(Kind.I, s, i)} and "
            f"{Action(Kind.W, s, i)})",
            "missing",
            _first_of(where, s, i),
        )
    for needed, other in ((Kind.I, Kind.W), (Kind.W, Kind.I)):
        if Kind.B not in have and needed not in have:
            raise _fail(
                schedule,
                f"{Action(needed, s, i)} is missing ({Action(other, s, i)} is there without it)",
                "missing",
                where[Action(other, s, i)],
            )


def _check_comm(schedule: Schedule, deps: Dependencies, where: _Places) -> None:
    """A lowered schedule has exactly the SEND/RECV actions the dependency model asks for."""
    want = deps.expected_comm()
    have_comm = Counter(a for acts in schedule.actions for a in acts if a.kind in COMM_KINDS)
    extra = [a for a in have_comm if a not in want]
    if extra:
        raise _fail(
            schedule,
            f"{extra[0]} sends or receives across a boundary that needs no "
            f"transfer (same rank, or no such stage)",
            "extra",
            where[extra[0]],
        )
    missing = [a for a in want if a not in have_comm]
    if missing:
        raise _fail(
            schedule,
            f"{missing[0]} is missing: this lowered schedule must send and "
            f"receive every cross-rank boundary tensor (run zeropipe.core.passes.lower.lower on the "
            f"compute-only schedule)",
            "missing",
            _first_of(where, missing[0].stage, missing[0].microbatch or 0),
        )


def _check_weight_copies(schedule: Schedule) -> None:
    """On each rank a stage's weight OFFLOAD and RELOAD alternate."""
    for r, acts in enumerate(schedule.actions):
        state: dict[int, tuple[Kind, int]] = {}  # stage -> its last weight copy's kind, index
        for k, a in enumerate(acts):
            if not a.is_weight_copy:
                continue
            prev = state.get(a.stage)
            if prev is not None and prev[0] is a.kind:
                raise _fail(
                    schedule,
                    f"weight {a.kind.value} of stage {a.stage} twice in a row; "
                    f"weight OFFLOAD and RELOAD must alternate",
                    "order",
                    [(r, prev[1]), (r, k)],
                )
            state[a.stage] = (a.kind, k)


def _check_reductions(schedule: Schedule) -> None:
    where: dict[int, list[tuple[int, int]]] = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if a.kind is Kind.REDUCE_GRAD:
                where.setdefault(a.stage, []).append((r, k))
    if not where:
        return
    for s, places in sorted(where.items()):
        if len(places) > 1:
            raise _fail(
                schedule,
                f"{Action(Kind.REDUCE_GRAD, s)} appears {len(places)} times; a stage's "
                f"gradients are reduced once per step",
                "reduce",
                places,
            )
    missing = [s for s in range(schedule.num_stages) if s not in where]
    if missing:
        s = missing[0]
        rank = schedule.placement[s]
        raise _fail(
            schedule,
            f"{Action(Kind.REDUCE_GRAD, s)} is missing: a schedule reduces the gradients of "
            f"every stage or of none (stage(s) {missing} have no REDUCE_GRAD); add it after "
            f"stage {s}'s last B/W on rank {rank} (zeropipe.core.passes.reduce.add_reductions does)",
            "reduce",
            [(rank, max(len(schedule.actions[rank]) - 1, 0))] if schedule.actions[rank] else [],
        )


def _check_overlaps(schedule: Schedule, deps: Dependencies) -> None:
    schedule.check_overlaps_adjacent()
    for first, second in sorted(schedule.overlaps, key=str):
        if first in deps.upstream(second):
            r, k = schedule.position(first) or (0, 0)  # present: checked adjacent above
            raise _fail(
                schedule,
                f"overlapped pair ({first};{second}): {second} needs {first}, so the two "
                f"cannot start together; run them as separate actions",
                "overlap",
                [(r, k), (r, k + 1)],
            )


def _check_order(schedule: Schedule, deps: Dependencies) -> None:
    pos = {a: (r, k) for r, acts in enumerate(schedule.actions) for k, a in enumerate(acts)}
    for r, acts in enumerate(schedule.actions):
        offloaded = set(offloaded_at_start(schedule, r))
        for k, a in enumerate(acts):
            if a.is_weight_copy:
                (offloaded.add if a.kind is Kind.OFFLOAD else offloaded.discard)(a.stage)
                continue
            if deps.uses_weights(a) and a.stage in offloaded:
                raise _fail(
                    schedule,
                    f"{a} runs while stage {a.stage}'s weights are offloaded; "
                    f"put {Action(Kind.RELOAD, a.stage)} before it",
                    "order",
                    [(r, k)],
                )
            for dep in deps.requires(a):
                at = pos.get(dep.action)
                if at is not None and at[0] == r and at[1] > k:
                    raise _fail(
                        schedule,
                        f"{a} comes before {dep.action} on rank {r}, but needs it "
                        f"first ({_why(a, dep.action)})",
                        "order",
                        [(r, k), at],
                    )


def _why(action: Action, dep: Action) -> str:
    if action.kind is Kind.REDUCE_GRAD:
        return "a stage's gradients are reduced once all its B and W have run"
    if action.kind is Kind.W and dep.kind is Kind.I:
        return "W uses what I leaves behind"
    if dep.kind is Kind.F:
        return "a backward or recompute needs its forward"
    if dep.kind in (Kind.RECV_F, Kind.RECV_B):
        return "a receive must be posted before its data is used"
    return f"{dep.kind.value} produces what {action.kind.value} consumes"


def _check_memory(
    schedule: Schedule, costs: CostModel, deps: Dependencies, limit: float | Sequence[float]
) -> None:
    limits = per_rank(limit, schedule.num_ranks)
    for r, ((peak, step), cap) in enumerate(
        zip(peak_memory(schedule, costs, deps), limits, strict=True)
    ):
        if peak > cap + 1e-9:
            raise _fail(
                schedule,
                f"rank {r} holds {peak:g} {costs.unit}(s) of memory at step {step} "
                f"({schedule.actions[r][step]}), over the limit of {cap:g}; recompute or "
                f"offload (zeropipe.core.passes.fit.fit_memory) or raise the limit",
                "memory",
                [(r, max(step, 0))],
            )
