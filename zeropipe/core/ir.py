"""The schedule IR: actions, schedules, and their text, JSON and torch-CSV forms.

An :class:`Action` is ``(kind, stage, microbatch)`` and prints canonically as
``{stage}{KIND}{microbatch}``: ``2F0`` (stage 2 forward of microbatch 0),
``1SEND_B3``, ``0W5``.  Weight offload/reload act on a whole stage and have no
microbatch: ``1OFFLOAD`` / ``1RELOAD`` (``1RELOAD3`` is the reload of stage 1's
saved activations of microbatch 3).

A :class:`Schedule` is the stage -> rank placement plus one ordered action list
per rank.  It is plain, immutable data; every other module reads it.  Its
methods read and write the text, JSON and torch-CSV forms (``from_text`` /
``to_text``, ...): :mod:`zeropipe.core.forms` holds their layouts, and this
module turns the action tokens in them into actions and back.

Overlapped pairs.  torch's DualPipeV writes ``(0F3;3B1)OVERLAP_F_B``: a forward
of one stage overlapped with a backward of another stage on the same rank.
Here the two stay two ordinary actions, kept *adjacent* in the rank's list, and
the schedule records which adjacent pairs are overlapped (``overlaps``: a set of
``(first, second)`` actions; actions are unique in a schedule, so a pair names
itself whatever passes insert around it).  Everything that reasons about
actions one by one -- the dependency model, the validator's counts, the
memory accounting, the runtime's dispatch table -- needs nothing new; only
what cares about the pairing asks :meth:`Schedule.overlapped`.  A pair is
written ``(0F3;3B1)`` in the text and JSON forms and ``(0F3;3B1)OVERLAP_F_B``
in torch's CSV::

    rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 ...

A list of separate actions would also be a representation (one action kind
holding two), but then every pass, rule and handler would have to look inside
it; keeping the members as actions means only adjacency has to be kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from zeropipe.core.errors import ScheduleError
from zeropipe.core.forms import (
    Fields,
    as_integers,
    check_copies,
    check_routes,
    expand_routes,
    format_grid,
    format_text,
    format_torch_csv,
    pair_members,
    read_dict,
    read_json,
    read_text,
    refuse_torch_only,
    schedule_dict,
    torch_csv_rows,
)

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "COPY_KINDS",
    "KINDS",
    "STAGE_KINDS",
    "Action",
    "Kind",
    "Overlap",
    "Schedule",
    "format_grid",
]


class Kind(str, Enum):
    """What an action does.  The value is its spelling in the text form."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients together)
    I = "I"  # backward w.r.t. the stage input only
    W = "W"  # backward w.r.t. the weights, after I
    R = "R"  # recompute a checkpointed forward, ahead of its backward
    OFFLOAD = "OFFLOAD"  # saved activations (or, without microbatch, weights) to host
    RELOAD = "RELOAD"  # ... and back
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # All-reduce a stage's weight gradients over the data-parallel group, posted once
    # they are final (after the stage's last B/W on its rank); no microbatch.
    REDUCE_GRAD = "REDUCE_GRAD"


# Every kind in a fixed order: ``Action.kind_no`` indexes it.  Integer kinds let the
# dependency graph and the simulator key their tables by ints on their hot paths
# (hashing an Enum member runs Python code).
KINDS: tuple[Kind, ...] = tuple(Kind)
_KIND_NUMBER = {k: n for n, k in enumerate(KINDS)}

COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.R})
COPY_KINDS = frozenset({Kind.OFFLOAD, Kind.RELOAD})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# Kinds that act on a whole stage, never on one microbatch.
STAGE_KINDS = frozenset({Kind.REDUCE_GRAD})

# Longest spellings first so that "RECV_F" is not read as "R" + junk.
_KIND_ALTERNATION = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATION})(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a schedule: ``kind`` applied to ``stage`` for ``microbatch``.

    ``microbatch`` is ``None`` for weight OFFLOAD/RELOAD, which act on a stage's
    parameters rather than on one microbatch's activations, and always for
    REDUCE_GRAD, which acts on the stage's gradients.
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    # Actions are dict keys everywhere; Enum hashing runs Python code, so hash once.
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    # ``KINDS.index(kind)``, kept so that hot loops need no Enum lookup.
    kind_no: int = field(init=False, repr=False, compare=False, default=0)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # Written out rather than generated: a dict lookup of an equal but distinct
        # Action (the dependency model makes new ones) ends here, a million times for
        # a big schedule, and the generated one builds two tuples each time.
        if other.__class__ is not Action:
            return NotImplemented
        o: Action = other  # narrowed by the class check above
        return (
            self._hash == o._hash
            and self.kind is o.kind
            and self.stage == o.stage
            and self.microbatch == o.microbatch
        )

    def __init__(self, kind: Kind, stage: int, microbatch: int | None = None) -> None:
        # Written out rather than generated: a frozen dataclass's __init__ sets every
        # field, the two cached ones included, then calls __post_init__, which would set
        # those two again; generating a big schedule makes ~10^5 actions.
        if not isinstance(kind, Kind):
            raise ScheduleError(f"action kind must be a zeropipe.Kind, got {kind!r}")
        # Integers only: str hashes (and None's, before Python 3.12) differ between
        # processes, and a pickled Action carries its cached hash with it.
        number = _KIND_NUMBER[kind]
        put = object.__setattr__
        put(self, "kind", kind)
        put(self, "stage", stage)
        put(self, "microbatch", microbatch)
        put(self, "kind_no", number)
        put(self, "_hash", hash((number, stage, -1 if microbatch is None else microbatch)))
        if stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {stage}")
        if kind in STAGE_KINDS:
            if microbatch is not None:
                raise ScheduleError(
                    f"{kind.value} acts on a whole stage and takes no microbatch, "
                    f"e.g. '{stage}{kind.value}'",
                    rule="syntax",
                )
        elif microbatch is None:
            if kind not in COPY_KINDS:
                raise ScheduleError(
                    f"{kind.value} needs a microbatch (only weight OFFLOAD/RELOAD "
                    f"and REDUCE_GRAD omit it), e.g. '{stage}{kind.value}0'",
                    rule="syntax",
                )
        elif microbatch < 0:
            raise ScheduleError(f"action microbatch must be >= 0, got {microbatch}")

    @property
    def is_weight_copy(self) -> bool:
        """True for OFFLOAD/RELOAD of a stage's weights (no microbatch)."""
        return self.microbatch is None and self.kind in COPY_KINDS

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the canonical form (``2F0``, ``1SEND_B3``, ``0RELOAD``)."""
        if not isinstance(text, str):
            raise ScheduleError(f"an action is text such as '2F0', got {text!r:.40}", rule="syntax")
        match = _ACTION_RE.match(text.strip())
        if match is None:
            kinds = ", ".join(k.value for k in Kind)
            raise ScheduleError(
                f"cannot read action {text!r}: expected STAGE KIND MICROBATCH such as "
                f"'2F0' or '1SEND_B3', with KIND one of {kinds}",
                rule="syntax",
                actions=(text,),
            )
        stage, kind, mb = match.groups()
        return cls(Kind(kind), int(stage), int(mb) if mb else None)


Overlap = tuple[Action, Action]  # (forward, backward) run as one overlapped pair

# What may be overlapped: a forward, then a backward that produces an input gradient.
_OVERLAP_FIRST = frozenset({Kind.F})
_OVERLAP_SECOND = frozenset({Kind.B, Kind.I})


@dataclass(frozen=True)
class Schedule:
    """Placement of stages on ranks plus one ordered action list per rank.

    ``placement[s]`` is the rank that owns stage ``s``; ``actions[r]`` is what
    rank ``r`` executes, in order.  Construction checks only the shape of the
    data; :func:`zeropipe.core.validate.validate` checks the rules.

    ``overlaps`` are the overlapped (F, B-or-I) pairs (see the module docstring):
    each pair's two actions sit next to each other on their rank, forward first.

    ``routes`` (none, or one per microbatch): the consecutive stages each one visits
    (default: all).  ``copies``: (stage, the stage whose module it runs) pairs;
    DualPipe runs every model stage twice, once per direction (:meth:`copy_of`).
    """

    placement: Sequence[int]
    actions: Sequence[Sequence[Action]]
    microbatches: int
    name: str = "custom"
    overlaps: Collection[Overlap] = frozenset()
    routes: Sequence[Sequence[int]] = ()
    copies: Sequence[tuple[int, int]] = ()  # (copy, original) pairs; a dict is read too
    _index: dict[Action, tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _stages: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", as_integers("placement", self.placement))
        try:
            actions = tuple(tuple(a) for a in self.actions)
        except TypeError:
            raise ScheduleError(
                f"actions must be one sequence of Actions per rank, got {self.actions!r:.80}",
                rule="syntax",
            ) from None
        for rank, acts in enumerate(actions):
            for a in acts:
                if not isinstance(a, Action):
                    raise ScheduleError(
                        f"rank {rank}: {a!r:.40} is not an Action (use Action.parse('2F0'))",
                        rule="syntax",
                    )
        object.__setattr__(self, "actions", actions)
        mb = self.microbatches
        if not isinstance(mb, int) or isinstance(mb, bool):
            raise ScheduleError(f"microbatches must be an integer, got {mb!r:.40}", rule="syntax")
        if not self.placement:
            raise ScheduleError("a schedule needs at least one stage (placement is empty)")
        if self.microbatches < 1:
            raise ScheduleError(f"microbatches must be >= 1, got {self.microbatches}")
        if not self.actions:
            raise ScheduleError("a schedule needs at least one rank (no action lists)")
        bad = [r for r in self.placement if not 0 <= r < len(self.actions)]
        if bad:
            raise ScheduleError(
                f"placement {list(self.placement)} names rank(s) {sorted(set(bad))} but the "
                f"schedule has {len(self.actions)} rank(s) (0..{len(self.actions) - 1})",
                rule="placement",
            )
        object.__setattr__(self, "overlaps", _overlaps(self.overlaps))
        object.__setattr__(
            self, "routes", check_routes(self.routes, self.microbatches, self.num_stages)
        )
        object.__setattr__(self, "copies", check_copies(self.copies, self.num_stages))

    # -- shape -----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages owned by ``rank``, in increasing order."""
        if not self._stages:
            # Built once for all ranks: callers ask rank by rank, and a scan of the
            # placement per call made every per-rank loop quadratic in ranks.
            by_rank: list[list[int]] = [[] for _ in self.actions]
            for s, r in enumerate(self.placement):
                by_rank[r].append(s)
            object.__setattr__(self, "_stages", tuple(tuple(b) for b in by_rank))
        return self._stages[rank] if 0 <= rank < len(self._stages) else ()

    def route(self, microbatch: int) -> tuple[int, ...]:
        """The stages ``microbatch`` visits, in order (every stage unless ``routes`` say)."""
        if self.routes:
            return self.routes[microbatch]  # type: ignore[return-value]  # tuples, see check_routes
        return tuple(range(self.num_stages))

    def copy_of(self, stage: int) -> int:
        """The stage whose module ``stage`` runs: itself unless ``copies`` name another."""
        return dict(self.copies).get(stage, stage)

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks per rank: the most stages any rank owns, a copy of another uncounted."""
        copied = dict(self.copies)
        return max(sum(s not in copied for s in self.stages_of(r)) for r in range(self.num_ranks))

    def check_stages(self) -> None:
        """Raise ScheduleError naming the first action whose stage is not in the placement.

        The readers call it so that a file naming a stage it does not place fails
        at the action, before the validator's rules are reached.
        """
        stages = self.num_stages
        for rank, acts in enumerate(self.actions):
            for a in acts:
                if a.stage >= stages:
                    raise ScheduleError(
                        f"action {a} on rank {rank}: stage {a.stage} is not in the placement "
                        f"(stages 0-{stages - 1}); add it to the placement or fix the action",
                        rule="range",
                        actions=(str(a),),
                    )

    @property
    def is_lowered(self) -> bool:
        """True when the schedule spells out its sends and receives."""
        return any(a.kind in COMM_KINDS for acts in self.actions for a in acts)

    def position(self, action: Action) -> tuple[int, int] | None:
        """``(rank, step)`` of the first occurrence of ``action``, or ``None``."""
        if not self._index:
            index: dict[Action, tuple[int, int]] = {}
            for rank, acts in enumerate(self.actions):
                for step, a in enumerate(acts):
                    index.setdefault(a, (rank, step))
            object.__setattr__(self, "_index", index)
        return self._index.get(action)

    def replace_actions(
        self,
        actions: Sequence[Sequence[Action]],
        name: str | None = None,
        overlaps: Collection[Overlap] | None = None,
    ) -> Schedule:
        """The same placement and microbatches with other action lists.

        The overlapped pairs are kept (``overlaps`` replaces them); a pass that
        inserts actions keeps each pair adjacent (:func:`zeropipe.core.deps.keep_overlaps`).
        """
        return Schedule(
            self.placement,
            tuple(tuple(a) for a in actions),
            self.microbatches,
            self.name if name is None else name,
            self.overlaps if overlaps is None else overlaps,
            self.routes,
            self.copies,
        )

    def overlapped(self, rank: int) -> frozenset[int]:
        """Steps of ``rank`` that start an overlapped pair: ``step`` and ``step + 1``
        run as one (forward first).  Empty for a schedule without pairs."""
        if not self.overlaps or not 0 <= rank < self.num_ranks:
            return frozenset()
        acts = self.actions[rank]
        return frozenset(k for k in range(len(acts) - 1) if (acts[k], acts[k + 1]) in self.overlaps)

    def _tokens(self) -> list[list[str]]:
        """Each rank's actions as text, each overlapped pair one ``(a;b)`` token."""
        ranks: list[list[str]] = []
        for rank, acts in enumerate(self.actions):
            starts = self.overlapped(rank)
            out: list[str] = []
            k = 0
            while k < len(acts):
                if k in starts:
                    out.append(f"({acts[k]};{acts[k + 1]})")
                    k += 2
                else:
                    out.append(str(acts[k]))
                    k += 1
            ranks.append(out)
        return ranks

    def check_overlaps_adjacent(self) -> None:
        """Raise ScheduleError unless every overlapped pair sits adjacent on one rank."""
        for first, second in sorted(self.overlaps, key=str):
            where = self.position(first)
            then = self.position(second)
            if where is None or then is None or then != (where[0], where[1] + 1):
                missing = first if where is None else second if then is None else None
                raise ScheduleError(
                    f"overlapped pair ({first};{second}): "
                    + (
                        f"{missing} is not in the schedule"
                        if missing is not None
                        else f"{second} must come right after {first} on the same rank "
                        f"(they are at (rank, step) {where} and {then})"
                    ),
                    rule="overlap",
                    actions=(str(first), str(second)),
                    grid=format_grid(self.actions, [p for p in (where, then) if p is not None]),
                )

    def compute_only(self) -> Schedule:
        """This schedule without its SEND/RECV actions (REDUCE_GRAD and pairs kept)."""
        return self.replace_actions(
            [[a for a in acts if a.kind not in COMM_KINDS] for acts in self.actions]
        )

    # -- text ------------------------------------------------------------------
    def to_text(self) -> str:
        self.check_overlaps_adjacent()
        return format_text(
            self.name, self.microbatches, self.placement, self._tokens(), *self._extras()
        )

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        pairs: list[Overlap] = []
        return cls._from_fields(read_text(text, lambda t: _read_tokens(t, pairs)), pairs)

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        self.check_overlaps_adjacent()
        return schedule_dict(
            self.name, self.microbatches, self.placement, self._tokens(), *self._extras()
        )

    def _extras(self) -> tuple[Sequence[Sequence[int]], tuple[tuple[int, int], ...]]:
        """Routes and copies as the forms write them: none when every route is the default."""
        every = tuple(range(self.num_stages))
        routes = self.routes if any(r != every for r in self.routes) else ()
        return routes, tuple(self.copies)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        """Read :meth:`to_dict`'s form; anything malformed is a ScheduleError naming it."""
        pairs: list[Overlap] = []
        return cls._from_fields(read_dict(data, lambda t: _read_tokens(t, pairs)), pairs)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(read_json(text))

    @classmethod
    def _from_fields(cls, fields: Fields[list[Action]], pairs: list[Overlap]) -> Schedule:
        schedule = cls(
            placement=fields.placement,
            actions=tuple(tuple(acts) for acts in fields.ranks),
            microbatches=fields.microbatches,
            name=fields.name,
            overlaps=pairs,
            routes=expand_routes(fields.routes, fields.microbatches, len(fields.placement)),
            copies=fields.copies,
        )
        schedule.check_stages()
        return schedule

    # -- torch.distributed.pipelining CSV ----------------------------------------
    def to_torch_csv(self) -> str:
        """Rows of action strings, one per rank, as torch's ``_load_csv`` reads them.

        REDUCE_GRAD is written as is (``0REDUCE_GRAD``) and an overlapped pair as
        ``(0F3;3B1)OVERLAP_F_B``.  torch has no R/OFFLOAD/RELOAD actions, so
        schedules with them cannot be exported; torch infers the placement from
        which rank runs each stage.
        """
        foreign = [str(a) for acts in self.actions for a in acts if a.kind in (Kind.R, *COPY_KINDS)]
        if foreign:
            raise ScheduleError(
                f"torch.distributed.pipelining has no recompute/offload actions; "
                f"remove {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} before exporting",
                rule="unsupported",
                actions=tuple(foreign[:4]),
            )
        if any(self._extras()):
            raise ScheduleError(
                f"torch.distributed.pipelining has no routes or copies ({self.name}): "
                f"keep this schedule in the text or JSON form",
                rule="unsupported",
            )
        self.check_overlaps_adjacent()
        return format_torch_csv(self._tokens())

    @classmethod
    def from_torch_csv(
        cls,
        text: str,
        *,
        microbatches: int | None = None,
        placement: Sequence[int] | None = None,
        name: str = "torch-csv",
    ) -> Schedule:
        """Read torch's CSV; placement and microbatch count are inferred if not given."""
        rows = torch_csv_rows(text)
        actions: list[list[Action]] = []
        owner: dict[int, int] = {}
        pairs: list[Overlap] = []
        for rank, row in enumerate(rows):
            acts: list[Action] = []
            for cell in row:
                if not cell.strip():
                    continue  # torch writes idle steps as empty cells
                refuse_torch_only(cell)
                for action in _read_tokens([cell], pairs):
                    acts.append(action)
                    if owner.setdefault(action.stage, rank) == rank:
                        continue
                    raise ScheduleError(
                        f"stage {action.stage} has actions on ranks {owner[action.stage]} and "
                        f"{rank} (e.g. {action}); a stage must live on one rank",
                        rule="placement",
                        actions=(str(action),),
                    )
            actions.append(acts)
        if placement is None:
            if sorted(owner) != list(range(len(owner))):
                missing = sorted(set(range(max(owner, default=-1) + 1)) - set(owner))
                # Name an action past the gap: usually the typo is there, not in the gap.
                rank, beyond = next(
                    (r, a) for r, acts in enumerate(actions) for a in acts if a.stage > missing[0]
                )
                raise ScheduleError(
                    f"cannot infer placement: action {beyond} on rank {rank} names stage "
                    f"{beyond.stage}, but stage(s) {missing} have no actions; fix the action "
                    f"or pass placement=",
                    rule="placement",
                    actions=(str(beyond),),
                )
            placement = [owner[s] for s in range(len(owner))]
        if microbatches is None:
            mbs = [a.microbatch for acts in actions for a in acts if a.microbatch is not None]
            microbatches = max(mbs, default=0) + 1
        schedule = cls(
            tuple(placement), tuple(tuple(a) for a in actions), microbatches, name, pairs
        )
        schedule.check_stages()
        return schedule


def _overlaps(pairs: object) -> frozenset[Overlap]:
    """``pairs`` as a frozenset of (F, B-or-I) Action pairs; anything else is a ScheduleError."""
    try:
        items = list(pairs)  # type: ignore[call-overload]
    except TypeError:
        raise ScheduleError(
            f"overlaps must be a collection of (forward, backward) Action pairs, got {pairs!r:.60}",
            rule="syntax",
        ) from None
    out = set()
    for pair in items:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not all(isinstance(a, Action) for a in pair)
        ):
            raise ScheduleError(
                f"an overlapped pair is a tuple of two Actions, got {pair!r:.60}", rule="syntax"
            )
        first, second = pair
        if first.kind not in _OVERLAP_FIRST or second.kind not in _OVERLAP_SECOND:
            raise ScheduleError(
                f"overlapped pair ({first};{second}): a pair is a forward F then a backward "
                f"B or I, e.g. (0F3;3B1)",
                rule="overlap",
                actions=(str(first), str(second)),
            )
        out.add((first, second))
    return frozenset(out)


def _read_tokens(tokens: Iterable[str], pairs: list[Overlap]) -> list[Action]:
    """Actions from text tokens; a ``(a;b)`` token gives two and is recorded in ``pairs``."""
    out: list[Action] = []
    for tok in tokens:
        members = pair_members(tok)
        if members is None:
            out.append(Action.parse(tok.strip()))
            continue
        first, second = Action.parse(members[0]), Action.parse(members[1])
        pairs.append((first, second))
        out.extend((first, second))
    return out
