"""THE dependency model: what each action needs to have finished first.

Every rule about data flow between actions lives here and nowhere else; the
validator, the send/receive lowering pass, the memory passes, the simulator
and the auto search's list scheduler all ask this module.  For stage ``s`` and microbatch ``i``, whose route
(``Schedule.route(i)``: consecutive stages ``first(i) .. last(i)``, by default
every stage ``0 .. S-1``) holds ``s``::

    F(s,i)      <- output of F(s-1,i)                      (s > first(i))
    R(s,i)      <- F(s,i), RELOAD(s,i) if offloaded
    B|I(s,i)    <- F(s,i), R(s,i) if checkpointed, else RELOAD(s,i) if offloaded,
                   input-gradient of B|I(s+1,i)             (s < last(i); the loss at last(i))
    W(s,i)      <- I(s,i)
    OFFLOAD(s,i)<- F(s,i);   RELOAD(s,i) <- OFFLOAD(s,i)
    SEND_F(s,i) <- F(s,i);   SEND_B(s,i) <- B|I(s,i)
    REDUCE_GRAD(s) <- B(s,i) or W(s,i), every i visiting s (nothing needs it)

A (stage, microbatch) off the microbatch's route has no actions at all.

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

from zeropipe.core.errors import ScheduleError
from zeropipe.core.gc_pause import paused_gc
from zeropipe.core.ir import COMPUTE_KINDS, KINDS, Action, Kind, Schedule, format_grid

__all__ = ["CommPair", "Dep", "Dependencies", "Graph", "keep_overlaps", "offloaded_at_start"]

CommPair = tuple[Action, Action]  # (SEND on the producer's rank, RECV on the consumer's)

# The rules work on integers: a kind is its ``Action.kind_no``, an action with a
# microbatch is its *code* ``mb << 32 | stage << 4 | kind_no`` (see :func:`_code`), and
# a (stage, microbatch) remembers the kinds it has as one bit each.  Big schedules
# have ~10^5 actions; building an Action and a Dep per dependency is what would cost.
_NO = {k: n for n, k in enumerate(KINDS)}
_F, _B, _I, _W, _R = _NO[Kind.F], _NO[Kind.B], _NO[Kind.I], _NO[Kind.W], _NO[Kind.R]
_OFFLOAD, _RELOAD = _NO[Kind.OFFLOAD], _NO[Kind.RELOAD]
_SEND_F, _RECV_F, _SEND_B, _RECV_B = (
    _NO[Kind.SEND_F],
    _NO[Kind.RECV_F],
    _NO[Kind.SEND_B],
    _NO[Kind.RECV_B],
)
_REDUCE_GRAD = _NO[Kind.REDUCE_GRAD]
_COMPUTE = frozenset(_NO[k] for k in COMPUTE_KINDS)
_SPLIT_BITS = (1 << _I) | (1 << _W)
_NO_VIA = -1
# One dependency as integers: (code of the producer, whether it is a transfer, code of
# the RECV it lands through or _NO_VIA).
_Entry = tuple[int, bool, int]


def _code(kind_no: int, stage: int, mb: int) -> int:
    return (mb << 32) | (stage << 4) | kind_no


def _action_of(code: int) -> Action:
    return Action(KINDS[code & 0xF], (code >> 4) & 0xFFFFFFF, code >> 32)


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
        masks: dict[int, int] = {}  # mb << 32 | stage -> one bit per kind it has
        get = masks.get
        for a in itertools.chain(itertools.chain.from_iterable(schedule.actions), adding):
            i = a.microbatch
            if i is not None:
                key = (i << 32) | a.stage
                masks[key] = get(key, 0) | (1 << a.kind_no)
        self._masks = masks
        self._requires: dict[Action, tuple[Dep, ...]] = {}
        # Each microbatch's first and last stage; None: every route is every stage.
        routes = schedule.routes
        self._firsts = [r[0] for r in routes] if routes else None
        self._lasts = [r[-1] for r in routes] if routes else None

    @classmethod
    def planned(cls, placement: Sequence[int], microbatches: int, *, split: bool) -> Dependencies:
        """The rules for a compute-only schedule not built yet: every backward I + W or B."""
        shape = Schedule(placement, [[] for _ in range(max(placement) + 1)], microbatches)
        return cls(shape, split=split)

    def with_actions(self, actions: Iterable[Action]) -> Dependencies:
        """These rules for the schedule with ``actions`` added (for passes that insert them)."""
        return Dependencies(self.schedule, split=self._split_default, adding=actions)

    # -- what a (stage, microbatch) chose --------------------------------------
    def kind_bits(self, stage: int, mb: int) -> int:
        """The kinds the schedule has for (stage, mb), as bit ``Action.kind_no`` of each."""
        return self._masks.get((mb << 32) | stage, 0)

    def checkpointed(self, stage: int, mb: int) -> bool:
        return bool(self._masks.get((mb << 32) | stage, 0) & (1 << _R))

    def offloaded(self, stage: int, mb: int) -> bool:
        return bool(self._masks.get((mb << 32) | stage, 0) & (1 << _OFFLOAD))

    def split(self, stage: int, mb: int) -> bool:
        """True when (stage, mb)'s backward is split into I and W."""
        got = self._masks.get((mb << 32) | stage, 0)
        if not got:
            return self._split_default
        return bool(got & _SPLIT_BITS)

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

    # -- routes --------------------------------------------------------------------
    def first_stage(self, mb: int) -> int:
        """The stage where ``mb`` enters: it runs on the step's input."""
        return 0 if self._firsts is None else self._firsts[mb]

    def last_stage(self, mb: int) -> int:
        """The stage where ``mb`` leaves: its output goes to the loss."""
        return self.num_stages - 1 if self._lasts is None else self._lasts[mb]

    def visits(self, stage: int, mb: int) -> bool:
        """Whether ``stage`` is on ``mb``'s route."""
        return self.first_stage(mb) <= stage <= self.last_stage(mb)

    def visitors(self, stage: int) -> list[int]:
        """The microbatches whose route holds ``stage``."""
        if self._firsts is None:
            return list(range(self.schedule.microbatches))
        return [i for i in range(self.schedule.microbatches) if self.visits(stage, i)]

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
            found = self._requires[action] = tuple(
                Dep(_action_of(c), transfer, None if via == _NO_VIA else _action_of(via))
                for c, transfer, via in self._rule(action.kind_no, action.stage, action.microbatch)
            )
        return found

    def kinds(self, stage: int, mb: int) -> frozenset[Kind]:
        """The kinds of action the schedule has for (stage, mb)."""
        bits = self.kind_bits(stage, mb)
        return frozenset(k for n, k in enumerate(KINDS) if bits >> n & 1)

    def _rule(self, kind: int, s: int, i: int | None) -> tuple[_Entry, ...]:
        """The rules of the module docstring, for the action ``(KINDS[kind], s, i)``."""
        if i is None:
            if kind == _REDUCE_GRAD:
                return tuple(
                    (_code(_W if self.split(s, m) else _B, s, m), False, _NO_VIA)
                    for m in self.visitors(s)
                )
            return ()  # weight copies: residency, not data (see module doc)
        base = (i << 32) | (s << 4)
        if kind == _F:
            first = 0 if self._firsts is None else self._firsts[i]
            return self._input(True, s - 1, s, i) if first < s <= self.num_stages else ()
        if kind in (_B, _I):
            saved = self._masks.get((i << 32) | s, 0)
            own: tuple[_Entry, ...]
            if saved & (1 << _R):
                own = ((base | _F, False, _NO_VIA), (base | _R, False, _NO_VIA))
            elif saved & (1 << _OFFLOAD):
                own = ((base | _F, False, _NO_VIA), (base | _RELOAD, False, _NO_VIA))
            else:
                own = ((base | _F, False, _NO_VIA),)
            last = self.num_stages - 1 if self._lasts is None else self._lasts[i]
            return own + self._input(False, s + 1, s, i) if s < last else own
        if kind == _W:
            return ((base | _I, False, _NO_VIA),)
        if kind == _R:
            if self._masks.get((i << 32) | s, 0) & (1 << _OFFLOAD):
                return ((base | _F, False, _NO_VIA), (base | _RELOAD, False, _NO_VIA))
            return ((base | _F, False, _NO_VIA),)
        if kind in (_OFFLOAD, _SEND_F):
            return ((base | _F, False, _NO_VIA),)
        if kind == _RELOAD:
            return ((base | _OFFLOAD, False, _NO_VIA),)
        if kind == _SEND_B:
            return ((base | (_I if self.split(s, i) else _B), False, _NO_VIA),)
        if kind in (_RECV_F, _RECV_B):
            return ()
        raise ScheduleError(f"no dependency rule for action kind {KINDS[kind]}", rule="unsupported")

    def _input(self, forward: bool, src: int, dst: int, i: int) -> tuple[_Entry, ...]:
        """Deps of stage ``dst`` on the activation (``forward``) or gradient from ``src``."""
        at = (i << 32) | (src << 4)
        producer = at | (_F if forward else _I if self.split(src, i) else _B)
        if self.placement[src] == self.placement[dst]:
            return ((producer, False, _NO_VIA),)  # same rank: handed over, nothing sent
        if not self.lowered:
            return ((producer, True, _NO_VIA),)
        send = at | (_SEND_F if forward else _SEND_B)
        recv = (i << 32) | (dst << 4) | (_RECV_F if forward else _RECV_B)
        return ((recv, False, _NO_VIA), (send, True, recv))

    def _upstream_stage(self, direction: Kind, stage: int, mb: int) -> int | None:
        """The stage whose activation (F) or input gradient (B) ``stage`` consumes for ``mb``."""
        up = stage - 1 if direction is Kind.F else stage + 1
        return up if self.visits(up, mb) else None

    def _downstream_stage(self, direction: Kind, stage: int, mb: int) -> int | None:
        """The stage that consumes ``stage``'s activation (F) or input gradient (B) for ``mb``."""
        down = stage + 1 if direction is Kind.F else stage - 1
        return down if self.visits(down, mb) else None

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
        up = self._upstream_stage(direction, s, i)
        incoming = (
            (self.comm_pair(direction, up, s, i),) if up is not None and self.crosses(up, s) else ()
        )
        down = self._downstream_stage(direction, s, i)
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
                if self._firsts is None or (self.visits(s, i) and self.visits(s + 1, i)):
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
    # Each rank visits only its own pairs (in the schedule's order of pairs), and finds
    # positions in a map kept current, not by scanning its list once per pair.
    owner = {a: r for r, acts in enumerate(schedule.actions) for a in acts}
    pairs: list[list[tuple[Action, Action]]] = [[] for _ in schedule.actions]
    for first, second in dict(schedule.overlaps).items():
        r = owner.get(first)
        if r is not None and owner.get(second) == r:
            pairs[r].append((first, second))
    out = []
    for acts, mine in zip(schedule.actions, pairs, strict=True):
        lst = list(acts)
        pos = {x: k for k, x in enumerate(lst)}
        for first, second in mine:
            a, b = pos[first], pos[second]
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
            moved = [*before, first, second, *after]
            lst[a : b + 1] = moved
            pos.update((x, k) for k, x in enumerate(moved, start=a))
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
    """The schedule as a DAG of steps: program order plus dependencies.

    Steps are numbered rank by rank: node ``first[r] + k`` is step ``k`` of rank
    ``r`` (``actions[n]`` its action).  Node ``n`` waits for the node before it
    on its rank, for every node in ``waits[n]`` to end, and for every
    ``(src, via)`` in ``transfers.get(n, ())``: ``src``'s data to cross the wire
    (once the RECV node ``via`` has been posted; ``-1``: no RECV, a compute-only
    schedule).  ``node_order`` (node numbers) and ``order`` (``(rank, step)``)
    are a topological order.

    Building the graph raises ``ScheduleError(rule="missing")`` for a dependency
    absent from the schedule, and sorting it ``ScheduleError(rule="deadlock")``
    for a cycle, i.e. ranks waiting on each other.  ``sort=False`` defers the
    sort to :meth:`sort` or the first use of an order (the validator checks the
    order of each rank first); ``backward_edge`` is the first ``(node, dep)``
    whose dependency comes later on the same rank, if any.
    """

    def __init__(
        self, schedule: Schedule, deps: Dependencies | None = None, *, sort: bool = True
    ) -> None:
        with paused_gc():
            self._build(schedule, deps or Dependencies(schedule), sort)

    def _build(self, schedule: Schedule, deps: Dependencies, sort: bool) -> None:
        self.schedule = schedule
        self.deps = deps
        actions: list[Action] = []
        first: list[int] = []
        for rank_acts in schedule.actions:
            first.append(len(actions))
            actions.extend(rank_acts)
        self.actions = actions
        self.first = first
        self.rank_of = [r for r, rank_acts in enumerate(schedule.actions) for _ in rank_acts]
        where: dict[int, int] = {}
        for n, a in enumerate(actions):
            i = a.microbatch
            if i is not None:
                where.setdefault((i << 32) | (a.stage << 4) | a.kind_no, n)
        waits: list[list[int]] = []
        transfers: dict[int, list[tuple[int, int]]] = {}
        self.backward_edge: tuple[int, int] | None = None
        rule, find, wait = deps._rule, where.get, waits.append
        ends = [*first[1:], len(actions)]
        for r, (lo, hi) in enumerate(zip(first, ends, strict=True)):
            last_reload: dict[int, int] = {}  # stage -> node of its latest weight RELOAD
            for n in range(lo, hi):
                a = actions[n]
                mine: list[int] = []
                for code, transfer, via in rule(a.kind_no, a.stage, a.microbatch):
                    d = find(code)
                    if d is None:
                        raise ScheduleError(
                            f"{a} needs {_action_of(code)}, which the schedule does not contain",
                            rule="missing",
                            actions=(str(a), str(_action_of(code))),
                            grid=format_grid(schedule.actions, [(r, n - lo)]),
                        )
                    if transfer:
                        transfers.setdefault(n, []).append(
                            (d, -1 if via == _NO_VIA else where[via])
                        )
                    else:
                        if d > n and d < hi and self.backward_edge is None:
                            self.backward_edge = (n, d)
                        mine.append(d)
                if last_reload or a.microbatch is None:
                    if a.microbatch is None and a.kind_no == _RELOAD:
                        last_reload[a.stage] = n
                    elif a.kind_no in _COMPUTE and a.stage in last_reload:
                        mine.append(last_reload[a.stage])
                wait(mine)
            for k in schedule.overlapped(r):  # the pair starts when both inputs are ready
                n = lo + k
                waits[n].extend(waits[n + 1])
                if n + 1 in transfers:
                    transfers.setdefault(n, []).extend(transfers[n + 1])
        self.waits = waits
        self.transfers = transfers
        self._preds: list[list[list[tuple[int, int, Dep | None]]]] | None = None
        self._node_order: list[int] | None = None
        self._order: list[tuple[int, int]] | None = None
        if sort:
            self.sort()

    @property
    def node_order(self) -> list[int]:
        """A topological order of the nodes (sorted on first use if not yet)."""
        return self.sort() if self._node_order is None else self._node_order

    @property
    def order(self) -> list[tuple[int, int]]:
        """``node_order`` as ``(rank, step)`` pairs."""
        if self._order is None:
            rank_of, first = self.rank_of, self.first
            self._order = [(rank_of[n], n - first[rank_of[n]]) for n in self.node_order]
        return self._order

    def rank_step(self, node: int) -> tuple[int, int]:
        """``(rank, step)`` of a node."""
        r = self.rank_of[node]
        return r, node - self.first[r]

    @property
    def preds(self) -> list[list[list[tuple[int, int, Dep | None]]]]:
        """Per rank and step, ``(rank, step, dep)`` of each node it waits for: the step
        before it on its rank (``dep=None``), then its dependencies.  Built on first use."""
        if self._preds is None:
            acts = self.actions
            out: list[list[list[tuple[int, int, Dep | None]]]] = []
            for r, rank_acts in enumerate(self.schedule.actions):
                rank_preds: list[list[tuple[int, int, Dep | None]]] = []
                for k in range(len(rank_acts)):
                    n = self.first[r] + k
                    node: list[tuple[int, int, Dep | None]] = [(r, k - 1, None)] if k else []
                    node.extend((*self.rank_step(d), Dep(acts[d])) for d in self.waits[n])
                    for src, via in self.transfers.get(n, ()):
                        dep = Dep(acts[src], True, acts[via] if via >= 0 else None)
                        node.append((*self.rank_step(src), dep))
                    rank_preds.append(node)
                out.append(rank_preds)
            self._preds = out
        return self._preds

    def sort(self) -> list[int]:
        """A topological order of the nodes; raise ``rule="deadlock"`` if there is a cycle."""
        total = len(self.actions)
        waits, transfers = self.waits, self.transfers
        waiting = [0] * total
        succs: list[list[int]] = [[] for _ in range(total)]
        for lo, hi in zip(self.first, [*self.first[1:], total], strict=True):
            for n in range(lo, hi):
                count = 0
                if n > lo:  # the step before it on its rank
                    succs[n - 1].append(n)
                    count = 1
                for d in waits[n]:
                    succs[d].append(n)
                count += len(waits[n])
                for src, _ in transfers.get(n, ()):
                    succs[src].append(n)
                    count += 1
                waiting[n] = count
        ready = [n for n, c in enumerate(waiting) if c == 0]
        order: list[int] = []
        while ready:
            n = ready.pop()
            order.append(n)
            for nxt in succs[n]:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
        if len(order) < total:
            self._deadlock(set(order))
        self._node_order = order
        return order

    def _deadlock(self, done_nodes: set[int]) -> None:
        acts = self.schedule.actions
        done = {self.rank_step(n) for n in done_nodes}
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
