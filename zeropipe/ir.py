"""The schedule IR: actions, schedules, and their text, JSON and torch-CSV forms.

An :class:`Action` is ``(kind, stage, microbatch)`` and prints canonically as
``{stage}{KIND}{microbatch}``: ``2F0`` (stage 2 forward of microbatch 0),
``1SEND_B3``, ``0W5``.  Weight offload/reload act on a whole stage and have no
microbatch: ``1OFFLOAD`` / ``1RELOAD`` (``1RELOAD3`` is the reload of stage 1's
saved activations of microbatch 3).

A :class:`Schedule` is the stage -> rank placement plus one ordered action list
per rank.  It is plain, immutable data; every other module reads it.  Text
form::

    # zeropipe schedule
    name: 1f1b
    microbatches: 4
    placement: 0 1
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

The torch CSV form is the one ``torch.distributed.pipelining`` reads with
``_load_csv`` and writes with ``_dump_csv``: one row per rank, one action per
cell, empty cells for idle steps.
"""

from __future__ import annotations

import csv
import io
import json
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from zeropipe.errors import ScheduleError

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "COPY_KINDS",
    "STAGE_KINDS",
    "Action",
    "Kind",
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


_KIND_NUMBER = {k: n for n, k in enumerate(Kind)}

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

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"action kind must be a zeropipe.Kind, got {self.kind!r}")
        # Integers only: str hashes (and None's, before Python 3.12) differ between
        # processes, and a pickled Action carries its cached hash with it.
        mb = -1 if self.microbatch is None else self.microbatch
        object.__setattr__(self, "_hash", hash((_KIND_NUMBER[self.kind], self.stage, mb)))
        if self.stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in STAGE_KINDS:
            if self.microbatch is not None:
                raise ScheduleError(
                    f"{self.kind.value} acts on a whole stage and takes no microbatch, "
                    f"e.g. '{self.stage}{self.kind.value}'",
                    rule="syntax",
                )
        elif self.microbatch is None:
            if self.kind not in COPY_KINDS:
                raise ScheduleError(
                    f"{self.kind.value} needs a microbatch (only weight OFFLOAD/RELOAD "
                    f"and REDUCE_GRAD omit it), e.g. '{self.stage}{self.kind.value}0'",
                    rule="syntax",
                )
        elif self.microbatch < 0:
            raise ScheduleError(f"action microbatch must be >= 0, got {self.microbatch}")

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


@dataclass(frozen=True)
class Schedule:
    """Placement of stages on ranks plus one ordered action list per rank.

    ``placement[s]`` is the rank that owns stage ``s``; ``actions[r]`` is what
    rank ``r`` executes, in order.  Construction checks only the shape of the
    data; :func:`zeropipe.validate.validate` checks the rules.
    """

    placement: Sequence[int]
    actions: Sequence[Sequence[Action]]
    microbatches: int
    name: str = "custom"
    _index: dict[Action, tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _stages: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", _integers("placement", self.placement))
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

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks (stages) per rank: the most any rank owns."""
        return max(len(self.stages_of(r)) for r in range(self.num_ranks))

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
        self, actions: Sequence[Sequence[Action]], name: str | None = None
    ) -> Schedule:
        """The same placement and microbatches with other action lists."""
        return Schedule(
            self.placement,
            tuple(tuple(a) for a in actions),
            self.microbatches,
            self.name if name is None else name,
        )

    def compute_only(self) -> Schedule:
        """This schedule without its SEND/RECV actions."""
        return self.replace_actions(
            [[a for a in acts if a.kind not in COMM_KINDS] for acts in self.actions]
        )

    # -- text ------------------------------------------------------------------
    def to_text(self) -> str:
        lines = [
            "# zeropipe schedule",
            f"name: {self.name}",
            f"microbatches: {self.microbatches}",
            "placement: " + " ".join(str(r) for r in self.placement),
        ]
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        header: dict[str, str] = {}
        ranks: dict[int, list[Action]] = {}
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ScheduleError(
                    f"line {lineno}: expected 'key: value' or 'rank N: ACTIONS', got {raw!r}",
                    rule="syntax",
                )
            key = key.strip()
            if key.startswith("rank"):
                try:
                    rank = int(key[4:])
                except ValueError:
                    raise ScheduleError(
                        f"line {lineno}: bad rank header {key!r}, expected 'rank N'", rule="syntax"
                    ) from None
                if rank in ranks:
                    raise ScheduleError(f"line {lineno}: rank {rank} listed twice", rule="syntax")
                ranks[rank] = [Action.parse(tok) for tok in value.split()]
            elif key in ("name", "microbatches", "placement"):
                header[key] = value.strip()
            else:
                raise ScheduleError(
                    f"line {lineno}: unknown key {key!r} (known: name, microbatches, placement, rank N)",
                    rule="syntax",
                )
        for needed in ("microbatches", "placement"):
            if needed not in header:
                raise ScheduleError(f"schedule text has no '{needed}:' line", rule="syntax")
        if sorted(ranks) != list(range(len(ranks))):
            raise ScheduleError(
                f"schedule text lists ranks {sorted(ranks)}; expected 0..{len(ranks) - 1}",
                rule="syntax",
            )
        schedule = cls(
            placement=tuple(_integer("placement", t) for t in header["placement"].split()),
            actions=tuple(tuple(ranks[r]) for r in range(len(ranks))),
            microbatches=_integer("microbatches", header["microbatches"]),
            name=header.get("name", "custom"),
        )
        schedule.check_stages()
        return schedule

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "zeropipe-schedule",
            "version": 1,
            "name": self.name,
            "microbatches": self.microbatches,
            "placement": list(self.placement),
            "actions": [[str(a) for a in acts] for acts in self.actions],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        """Read :meth:`to_dict`'s form; anything malformed is a ScheduleError naming it."""
        if not isinstance(data, dict) or data.get("format") != "zeropipe-schedule":
            raise ScheduleError(
                "not a zeropipe schedule: JSON field 'format' must be 'zeropipe-schedule'",
                rule="syntax",
            )
        for needed in ("placement", "actions", "microbatches"):
            if needed not in data:
                raise ScheduleError(f"schedule JSON lacks field '{needed}'", rule="syntax")
        placement, actions = data["placement"], data["actions"]
        if not isinstance(placement, list):
            raise ScheduleError(
                f"schedule JSON 'placement' must be a list of ranks, got {placement!r:.40}",
                rule="syntax",
            )
        if not isinstance(actions, list) or not all(isinstance(a, list) for a in actions):
            raise ScheduleError(
                "schedule JSON 'actions' must be a list with one list of action strings per rank",
                rule="syntax",
            )
        parsed = []
        for rank, acts in enumerate(actions):
            for a in acts:
                if not isinstance(a, str):
                    raise ScheduleError(
                        f"rank {rank}: action {a!r:.40} is not a string such as '2F0'",
                        rule="syntax",
                    )
            parsed.append(tuple(Action.parse(a) for a in acts))
        schedule = cls(
            placement=tuple(_integer("placement", r) for r in placement),
            actions=tuple(parsed),
            microbatches=_integer("microbatches", data["microbatches"]),
            name=str(data.get("name", "custom")),
        )
        schedule.check_stages()
        return schedule

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # too deep a nesting is RecursionError
            raise ScheduleError(f"schedule is not valid JSON: {exc}", rule="syntax") from None
        return cls.from_dict(data)

    # -- torch.distributed.pipelining CSV ----------------------------------------
    def to_torch_csv(self) -> str:
        """Rows of action strings, one per rank, as torch's ``_load_csv`` reads them.

        torch has no R/OFFLOAD/RELOAD actions, so schedules with them cannot be
        exported; torch infers the placement from which rank runs each stage.
        """
        foreign = [str(a) for acts in self.actions for a in acts if a.kind in (Kind.R, *COPY_KINDS)]
        if foreign:
            raise ScheduleError(
                f"torch.distributed.pipelining has no recompute/offload actions; "
                f"remove {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} before exporting",
                rule="unsupported",
                actions=tuple(foreign[:4]),
            )
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for acts in self.actions:
            writer.writerow([str(a) for a in acts])
        return out.getvalue()

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
        try:
            rows = [row for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)]
        except csv.Error as exc:  # e.g. a field over csv's size limit
            raise ScheduleError(f"cannot read torch CSV: {exc}", rule="syntax") from None
        actions: list[list[Action]] = []
        owner: dict[int, int] = {}
        for rank, row in enumerate(rows):
            acts = []
            for cell in row:
                if not cell.strip():
                    continue  # torch writes idle steps as empty cells
                action = _parse_torch_cell(cell)
                acts.append(action)
                if owner.setdefault(action.stage, rank) != rank:
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
        schedule = cls(tuple(placement), tuple(tuple(a) for a in actions), microbatches, name)
        schedule.check_stages()
        return schedule


def _integer(what: str, value: object) -> int:
    """``value`` as an int: an int, or text of one; anything else is a ScheduleError."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    elif not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]  # numpy ints too; 1.5 not
        except TypeError:
            pass
    raise ScheduleError(f"{what} must be an integer, got {value!r:.40}", rule="syntax")


def _integers(what: str, values: Iterable[object]) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:  # not iterable, whatever the annotation says
        raise ScheduleError(f"{what} must be a sequence of integers, got {values!r:.40}") from None
    return tuple(_integer(what, v) for v in items)


_TORCH_ONLY = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B")


def _parse_torch_cell(cell: str) -> Action:
    text = cell.strip()
    if text.startswith("(") or any(k in text for k in _TORCH_ONLY):
        raise ScheduleError(
            f"torch action {text!r} has no zeropipe equivalent (FSDP unshard/reshard, "
            f"grad reduction and fused F/B overlap are not schedule actions here); "
            f"remove it from the CSV",
            rule="unsupported",
            actions=(text,),
        )
    return Action.parse(text)


def format_grid(
    actions: Sequence[Sequence[Action]],
    mark: Iterable[tuple[int, int]] = (),
    *,
    window: int = 6,
) -> str:
    """Rank x step grid of a schedule, with ``(rank, step)`` cells in ``mark`` shown as ``>x<``.

    Only the steps within ``window`` of a marked cell are shown, so the grid of a
    long schedule stays readable; without marks the first ``2 * window`` steps are.
    """
    marks = set(mark)
    length = max((len(a) for a in actions), default=0)
    if marks:
        lo = max(0, min(s for _, s in marks) - window)
        hi = min(length, max(s for _, s in marks) + window + 1)
    else:
        lo, hi = 0, min(length, 2 * window)
    cells = [
        [
            (f">{acts[s]}<" if (r, s) in marks else str(acts[s])) if s < len(acts) else "."
            for s in range(lo, hi)
        ]
        for r, acts in enumerate(actions)
    ]
    width = max([len(c) for row in cells for c in row] + [len(str(hi))])
    header = "step    " + " ".join(f"{s:>{width}}" for s in range(lo, hi))
    lines = [header]
    for r, row in enumerate(cells):
        lines.append(f"rank {r:<3}" + " ".join(f"{c:>{width}}" for c in row))
    if lo > 0 or hi < length:
        lines.append(f"(steps {lo}..{hi - 1} of 0..{length - 1})")
    return "\n".join(lines)
