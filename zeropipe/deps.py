"""THE dependency model: what each action needs to have finished first.

Every rule about data flow between actions lives here and nowhere else; the
validator, the send/receive lowering pass, the memory passes, the simulator
and the auto search's list scheduler all ask this module.  For stage ``s`` of ``S`` and microbatch ``i``::

    F(s,i)      <- output of F(s-1,i)                      (s > 0)
    R(s,i)      <- F(s,i), RELOAD(s,i) if offloaded
    B|I(s,i)    <- F(s,i), R(s,i) if checkpointed, else RELOAD(s,i) if offloaded,
                   input-gradient of B|I(s+1,i)             (s < S-1)
    W(s,i)      <- I(s,i)
    OFFLOAD(s,i)<- F(s,i);   RELOAD(s,i) <- OFFLOAD(s,i)
    SEND_F(s,i) <- F(s,i);   SEND_B(s,i) <- B|I(s,i)
    REDUCE_GRAD(s) <- B(s,i) or W(s,i), every i           (nothing needs it)

REDUCE_GRAD(s) all-reduces stage ``s``'s weight gradients over the
data-parallel replicas; they are final once every B and W of ``s`` has run.

A "checkpointed" (s,i) is one whose schedule contains R(s,i): its F keeps only
its inputs.  An "offloaded" one contains OFFLOAD(s,i).  When producer and
consumer sit on different ranks the edge is a *transfer*: in a compute-only
schedule the consumer waits for the producer plus the wire time; in a lowered
schedule (one with SEND/RECV actions) it waits for the producer's SEND, whose
data lands only once the consumer's RECV has been posted::

    rank a:  ... F(s-1,i) SEND_F(s-1,i) ...
                                  \\ transfer
    rank b:  ... RECV_F(s,i) ... F(s,i) ...

Weight OFFLOAD/RELOAD (no microbatch) are not data edges but a residency rule:
every compute action of stage ``s`` needs the most recent weight RELOAD of
``s`` before it on its rank (if any), and must not run while ``s``'s weights
are offloaded.

An overlapped pair (``Schedule.overlaps``: a forward and a backward run as one)
is its two actions, plus one rule: the pair starts only when the inputs of
*both* are ready, so in the :class:`Graph` its first action also waits for
what its second needs.  A pair whose backward needs its own forward, even
through other ranks, is therefore a deadlock.  :func:`keep_overlaps` puts back
together a pair that a pass has inserted actions into.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from zeropipe.errors import ScheduleError
from zeropipe.ir import COMPUTE_KINDS, Action, Kind, Schedule, format_grid

__all__ = ["CommPair", "Dep", "Dependencies", "Graph", "keep_overlaps", "offloaded_at_start"]

CommPair = tuple[Action, Action]  # (SEND on the producer's rank, RECV on the consumer's)


@dataclass(frozen=True, slots=True)
class Dep:
    """``action`` must finish first.  ``transfer``: its data crosses ranks.

    ``via`` is the consumer-side RECV of a lowered transfer: the data can only
    land once that receive has been posted.
    """

    action: Action
    transfer: bool = False
    via: Action | None = None


class Dependencies:
    """The dependency rules, bound to one schedule's placement and choices."""

    def __init__(
        self, schedule: Schedule, *, split: bool = False, adding: Iterable[Action] = ()
    ) -> None:
        """``split``: the backward of a (stage, microbatch) with no action yet is I + W.
        ``adding``: actions a pass is about to insert, ruled on as if they were there.

        (A schedule still being built, such as the list scheduler's, says so up front.)
        """
        self.schedule = schedule
        self.placement = schedule.placement
        self.num_stages = schedule.num_stages
        self.lowered = schedule.is_lowered
        self._split_default = split
        kinds: dict[tuple[int, int], set[Kind]] = {}
        for a in itertools.chain(itertools.chain.from_iterable(schedule.actions), adding):
            if a.microbatch is not None:
                kinds.setdefault((a.stage, a.microbatch), set()).add(a.kind)
        self._kinds = kinds
        self._requires: dict[Action, tuple[Dep, ...]] = {}

    @classmethod
    def planned(cls, placement: Sequence[int], microbatches: int, *, split: bool) -> Dependencies:
        """The rules for a compute-only schedule not built yet: every backward I + W or B."""
        shape = Schedule(placement, [[] for _ in range(max(placement) + 1)], microbatches)
        return cls(shape, split=split)

    def with_actions(self, actions: Iterable[Action]) -> Dependencies:
        """These rules for the schedule with ``actions`` added (for passes that insert them)."""
        return Dependencies(self.schedule, split=self._split_default, adding=actions)

    # -- what a (stage, microbatch) chose --------------------------------------
    def checkpointed(self, stage: int, mb: int) -> bool:
        return Kind.R in self._kinds.get((stage, mb), ())

    def offloaded(self, stage: int, mb: int) -> bool:
        return Kind.OFFLOAD in self._kinds.get((stage, mb), ())

    def split(self, stage: int, mb: int) -> bool:
        """True when (stage, mb)'s backward is split into I and W."""
        got = self._kinds.get((stage, mb))
        if not got:
            return self._split_default
        return Kind.I in got or Kind.W in got

    def backward(self, stage: int, mb: int) -> Action:
        """The action producing (stage, mb)'s input gradient: I if split, else B."""
        return Action(Kind.I if self.split(stage, mb) else Kind.B, stage, mb)

    def final_backward(self, stage: int, mb: int) -> Action:
        """The action after which (stage, mb)'s weight gradient is final: W if split, else B."""
        return Action(Kind.W if self.split(stage, mb) else Kind.B, stage, mb)

    def saved_reader(self, stage: int, mb: int) -> Action:
        """The action that reads (stage, mb)'s saved activations: R if checkpointed, else
        the backward.  A RELOAD of them must come before it."""
        return (
            Action(Kind.R, stage, mb) if self.checkpointed(stage, mb) else self.backward(stage, mb)
        )

    def crosses(self, src_stage: int, dst_stage: int) -> bool:
        return self.placement[src_stage] != self.placement[dst_stage]

    def upstream(self, action: Action) -> frozenset[Action]:
        """Every action ``action`` waits for through same-rank dependencies, transitively.

        What a pass inserting ``action`` must leave before it on the rank.
        """
        found: set[Action] = set()
        todo = [action]
        while todo:
            for dep in self.requires(todo.pop()):
                if not dep.transfer and dep.action not in found:
                    found.add(dep.action)
                    todo.append(dep.action)
        return frozenset(found)

    # -- the rules ---------------------------------------------------------------
    def requires(self, action: Action) -> tuple[Dep, ...]:
        """What must finish before ``action`` may start."""
        found = self._requires.get(action)
        if found is None:
            found = self._requires[action] = self._rule(action)
        return found

    def kinds(self, stage: int, mb: int) -> frozenset[Kind]:
        """The kinds of action the schedule has for (stage, mb)."""
        return frozenset(self._kinds.get((stage, mb), ()))

    def _rule(self, action: Action) -> tuple[Dep, ...]:
        kind, s, i = action.kind, action.stage, action.microbatch
        if kind is Kind.REDUCE_GRAD:
            return tuple(Dep(self.final_backward(s, m)) for m in range(self.schedule.microbatches))
        if i is None:  # weight copies: residency, not data (see module doc)
            return ()
        if kind is Kind.F:
            up = self._upstream_stage(Kind.F, s)
            return self._input(Kind.F, up, s, i) if up is not None else ()
        if kind is Kind.R:
            return (Dep(Action(Kind.F, s, i)),) + (
                (Dep(Action(Kind.RELOAD, s, i)),) if self.offloaded(s, i) else ()
            )
        if kind in (Kind.B, Kind.I):
            deps = [Dep(Action(Kind.F, s, i))]
            if self.checkpointed(s, i):
                deps.append(Dep(Action(Kind.R, s, i)))
            elif self.offloaded(s, i):
                deps.append(Dep(Action(Kind.RELOAD, s, i)))
            up = self._upstream_stage(Kind.B, s)
            if up is not None:
                deps.extend(self._input(Kind.B, up, s, i))
            return tuple(deps)
        if kind is Kind.W:
            return (Dep(Action(Kind.I, s, i)),)
        if kind is Kind.OFFLOAD:
            return (Dep(Action(Kind.F, s, i)),)
        if kind is Kind.RELOAD:
            return (Dep(Action(Kind.OFFLOAD, s, i)),)
        if kind is Kind.SEND_F:
            return (Dep(Action(Kind.F, s, i)),)
        if kind is Kind.SEND_B:
            return (Dep(self.backward(s, i)),)
        if kind in (Kind.RECV_F, Kind.RECV_B):
            return ()
        raise ScheduleError(f"no dependency rule for action kind {kind}", rule="unsupported")

    def _upstream_stage(self, direction: Kind, stage: int) -> int | None:
        """The stage whose activation (F) or input gradient (B) ``stage`` consumes."""
        up = stage - 1 if direction is Kind.F else stage + 1
        return up if 0 <= up < self.num_stages else None

    def _downstream_stage(self, direction: Kind, stage: int) -> int | None:
        """The stage that consumes ``stage``'s activation (F) or input gradient (B)."""
        down = stage + 1 if direction is Kind.F else stage - 1
        return down if 0 <= down < self.num_stages else None

    def _producer(self, direction: Kind, stage: int, i: int) -> Action:
        """The action producing ``stage``'s activation (F) or input gradient (B)."""
        return Action(Kind.F, stage, i) if direction is Kind.F else self.backward(stage, i)

    def _input(self, direction: Kind, src: int, dst: int, i: int) -> tuple[Dep, ...]:
        """Deps of stage ``dst`` on the activation (F) or gradient (B) from ``src``."""
        producer = self._producer(direction, src, i)
        if not self.crosses(src, dst):
            return (Dep(producer),)  # same rank: handed over, nothing sent
        if not self.lowered:
            return (Dep(producer, transfer=True),)
        send, recv = self.comm_pair(direction, src, dst, i)
        return (Dep(recv), Dep(send, transfer=True, via=recv))

    @staticmethod
    def comm_pair(direction: Kind, src: int, dst: int, i: int) -> tuple[Action, Action]:
        """SEND (on ``src``'s rank) and RECV (on ``dst``'s rank) of one boundary transfer."""
        if direction is Kind.F:
            return Action(Kind.SEND_F, src, i), Action(Kind.RECV_F, dst, i)
        return Action(Kind.SEND_B, src, i), Action(Kind.RECV_B, dst, i)

    def comm_of(self, action: Action) -> tuple[tuple[CommPair, ...], tuple[CommPair, ...]]:
        """``(incoming, outgoing)``: the cross-rank transfers ``action`` consumes and produces.

        Each as its (SEND, RECV) pair: lowering puts the RECV of an incoming one
        before ``action`` and the SEND of an outgoing one after it, and each
        post costs the rank its time.  Empty but for F, B and I.
        """
        i = action.microbatch
        if i is None or action.kind not in (Kind.F, Kind.B, Kind.I):
            return (), ()
        direction = Kind.F if action.kind is Kind.F else Kind.B
        s = action.stage
        up = self._upstream_stage(direction, s)
        incoming = (
            (self.comm_pair(direction, up, s, i),) if up is not None and self.crosses(up, s) else ()
        )
        down = self._downstream_stage(direction, s)
        outgoing = (
            (self.comm_pair(direction, s, down, i),)
            if down is not None and self.crosses(s, down)
            else ()
        )
        return incoming, outgoing

    def transfers(self) -> Iterator[tuple[Kind, int, int, int]]:
        """Every boundary transfer the schedule needs: ``(direction, src, dst, mb)``."""
        for s in range(self.num_stages - 1):
            if not self.crosses(s, s + 1):
                continue
            for i in range(self.schedule.microbatches):
                yield Kind.F, s, s + 1, i
                yield Kind.B, s + 1, s, i

    def expected_comm(self) -> Counter[Action]:
        """The SEND/RECV actions a lowered version of this schedule must contain."""
        want: Counter[Action] = Counter()
        for direction, src, dst, i in self.transfers():
            want.update(self.comm_pair(direction, src, dst, i))
        return want

    @staticmethod
    def uses_weights(action: Action) -> bool:
        """Whether ``action`` needs its stage's weights resident."""
        return action.kind in COMPUTE_KINDS


def keep_overlaps(schedule: Schedule) -> Schedule:
    """``schedule`` with every overlapped pair made adjacent again.

    What a pass put between a pair's forward and backward moves out: after the
    pair if it needs the forward (its SEND_F or OFFLOAD, then the RELOAD of that
    OFFLOAD, and so on; the weight OFFLOAD of the forward's stage), before it
    otherwise (a RECV, an R or RELOAD ahead of the backward).  Order among the
    moved actions is kept.
    """
    if not schedule.overlaps:
        return schedule
    deps = Dependencies(schedule)
    second_of = dict(schedule.overlaps)
    out = []
    for acts in schedule.actions:
        lst = list(acts)
        for first, second in second_of.items():
            if first not in lst or second not in lst:
                continue
            a, b = lst.index(first), lst.index(second)
            if b == a + 1 or b < a:
                continue  # adjacent, or out of order: the validator names the latter
            between = lst[a + 1 : b]
            needs_first = {first}  # the forward and what, moved after, needs it
            after: list[Action] = []
            for x in between:
                if any(d.action in needs_first for d in deps.requires(x)) or (
                    x.is_weight_copy and x.kind is Kind.OFFLOAD and x.stage == first.stage
                ):
                    after.append(x)
                    needs_first.add(x)
            before = [x for x in between if x not in needs_first]
            lst[a : b + 1] = [*before, first, second, *after]
        out.append(lst)
    return schedule.replace_actions(out)


def offloaded_at_start(schedule: Schedule, rank: int) -> frozenset[int]:
    """Stages of ``rank`` whose weights start on the host: their first weight copy is a RELOAD."""
    first: dict[int, Kind] = {}
    for a in schedule.actions[rank]:
        if a.is_weight_copy:
            first.setdefault(a.stage, a.kind)
    return frozenset(s for s, kind in first.items() if kind is Kind.RELOAD)


class Graph:
    """The schedule as a DAG of ``(rank, step)`` nodes: program order plus dependencies.

    ``preds[r][k]`` lists ``(rank, step, dep)`` for node ``(r, k)``: its
    predecessor on the same rank (with ``dep=None``) and the nodes of its
    dependencies.  ``order`` is a topological order; building the graph raises
    ``ScheduleError(rule="missing")`` for a dependency absent from the schedule
    and ``ScheduleError(rule="deadlock")`` for a cycle, i.e. ranks waiting on
    each other.
    """

    def __init__(self, schedule: Schedule, deps: Dependencies | None = None) -> None:
        self.schedule = schedule
        self.deps = deps or Dependencies(schedule)
        where: dict[Action, tuple[int, int]] = {}
        for r, acts in enumerate(schedule.actions):
            for k, a in enumerate(acts):
                if a.microbatch is not None:
                    where.setdefault(a, (r, k))
        self.preds: list[list[list[tuple[int, int, Dep | None]]]] = []
        for r, acts in enumerate(schedule.actions):
            last_weight_reload: dict[int, int] = {}
            rank_preds = []
            for k, a in enumerate(acts):
                node: list[tuple[int, int, Dep | None]] = [(r, k - 1, None)] if k else []
                for dep in self.deps.requires(a):
                    at = where.get(dep.action)
                    if at is None:
                        raise ScheduleError(
                            f"{a} needs {dep.action}, which the schedule does not contain",
                            rule="missing",
                            actions=(str(a), str(dep.action)),
                            grid=format_grid(schedule.actions, [(r, k)]),
                        )
                    node.append((at[0], at[1], dep))
                if a.is_weight_copy and a.kind is Kind.RELOAD:
                    last_weight_reload[a.stage] = k
                elif self.deps.uses_weights(a) and a.stage in last_weight_reload:
                    reload = Action(Kind.RELOAD, a.stage)
                    node.append((r, last_weight_reload[a.stage], Dep(reload)))
                rank_preds.append(node)
            for k in schedule.overlapped(r):  # the pair starts when both inputs are ready
                rank_preds[k].extend(p for p in rank_preds[k + 1] if p[2] is not None)
            self.preds.append(rank_preds)
        self.order = self._topological_order()

    def _topological_order(self) -> list[tuple[int, int]]:
        acts = self.schedule.actions
        # Nodes numbered rank by rank (node of (r, k) = first[r] + k), so that the
        # bookkeeping is lists of ints rather than dicts keyed by tuples.
        first: list[int] = []
        nodes: list[tuple[int, int]] = []
        for r, rank_preds in enumerate(self.preds):
            first.append(len(nodes))
            nodes.extend((r, k) for k in range(len(rank_preds)))
        waiting = [len(p) for rank_preds in self.preds for p in rank_preds]
        succs: list[list[int]] = [[] for _ in nodes]
        for n, preds in enumerate(p for rank_preds in self.preds for p in rank_preds):
            for pr, pk, _ in preds:
                succs[first[pr] + pk].append(n)
        ready = [n for n, c in enumerate(waiting) if c == 0]
        order: list[tuple[int, int]] = []
        while ready:
            node = ready.pop()
            order.append(nodes[node])
            for nxt in succs[node]:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
        if len(order) < len(waiting):
            done = set(order)
            stuck = []
            lines = []
            for r, rank_acts in enumerate(acts):
                head = next((k for k in range(len(rank_acts)) if (r, k) not in done), None)
                if head is None:
                    continue
                stuck.append((r, head))
                blockers = [
                    str(acts[pr][pk]) + (f" (rank {pr})" if pr != r else "")
                    for pr, pk, dep in self.preds[r][head]
                    if dep is not None and (pr, pk) not in done
                ]
                lines.append(
                    f"  rank {r} is stuck at step {head} ({rank_acts[head]}), waiting for "
                    + (", ".join(blockers) or "an earlier step")
                )
            raise ScheduleError(
                "the schedule deadlocks: every remaining rank waits for an action that can "
                "only run after its own wait ends\n" + "\n".join(lines),
                rule="deadlock",
                actions=tuple(str(acts[r][k]) for r, k in stuck),
                grid=format_grid(acts, stuck),
            )
        return order
