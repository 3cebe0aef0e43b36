"""A schedule's external forms as strings: the text, JSON and torch-CSV layouts.

The text form::

    # zeropipe schedule
    name: 1f1b
    microbatches: 4
    placement: 0 1
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

The JSON form holds the same fields, with one list of action strings per rank.
The torch CSV form is the one ``torch.distributed.pipelining`` reads with
``_load_csv`` and writes with ``_dump_csv``: one row per rank, one action per
cell, empty cells for idle steps.  An overlapped pair is one token, ``(0F3;3B1)``
in the text and JSON forms and ``(0F3;3B1)OVERLAP_F_B`` in torch's CSV.

This module knows the layouts -- header fields, one run of action tokens per
rank, pair tokens -- and nothing of what an action is.  The readers take a
``read_rank`` callback that :mod:`zeropipe.core.ir` fills with its token reader,
so the public way in stays ``Schedule.from_text`` / ``to_json`` /
``from_torch_csv`` and this module stays below ``ir`` (``ir`` imports it).
The callback runs as each rank is met, so a malformed file fails at its first
error in reading order, whichever kind of error that is.
"""

from __future__ import annotations

import csv
import io
import json
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from zeropipe.core.errors import ScheduleError

__all__ = [
    "Fields",
    "as_integer",
    "as_integers",
    "format_text",
    "format_torch_csv",
    "pair_members",
    "read_dict",
    "read_json",
    "read_text",
    "refuse_torch_only",
    "schedule_dict",
    "torch_csv_rows",
]

T = TypeVar("T")

# "(0F3;3B1)" here, "(0F3;3B1)OVERLAP_F_B" in torch's CSV (accepted in every form).
_PAIR_RE = re.compile(r"^\(([^;()]*);([^;()]*)\)(OVERLAP_F_B)?$")

_FSDP_ONLY = ("UNSHARD", "RESHARD")


@dataclass(frozen=True)
class Fields(Generic[T]):
    """What a text or JSON form holds; ``ranks[r]`` is what ``read_rank`` made of rank r."""

    placement: tuple[int, ...]
    ranks: list[T]
    microbatches: int
    name: str


def as_integer(what: str, value: object) -> int:
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


def as_integers(what: str, values: Iterable[object]) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:  # not iterable, whatever the annotation says
        raise ScheduleError(f"{what} must be a sequence of integers, got {values!r:.40}") from None
    return tuple(as_integer(what, v) for v in items)


def pair_members(token: str) -> tuple[str, str] | None:
    """The two action tokens of an overlapped-pair token ``(a;b)``; ``None`` for one action."""
    text = token.strip()
    if not text.startswith("("):
        return None
    match = _PAIR_RE.match(text)
    if match is None:
        raise ScheduleError(
            f"cannot read overlapped pair {text!r}: expected (FORWARD;BACKWARD) such as "
            f"'(0F3;3B1)' (torch's CSV: '(0F3;3B1)OVERLAP_F_B')",
            rule="syntax",
            actions=(text,),
        )
    return match.group(1), match.group(2)


# -- text ----------------------------------------------------------------------
def format_text(
    name: str, microbatches: int, placement: Sequence[int], ranks: Iterable[Sequence[str]]
) -> str:
    """The text form, ``ranks`` holding each rank's action tokens."""
    lines = [
        "# zeropipe schedule",
        f"name: {name}",
        f"microbatches: {microbatches}",
        "placement: " + " ".join(str(r) for r in placement),
    ]
    for rank, tokens in enumerate(ranks):
        lines.append(f"rank {rank}: " + " ".join(tokens))
    return "\n".join(lines) + "\n"


def read_text(text: str, read_rank: Callable[[list[str]], T]) -> Fields[T]:
    """Read the text form; anything malformed is a ScheduleError naming its line."""
    header: dict[str, str] = {}
    ranks: dict[int, T] = {}
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
            ranks[rank] = read_rank(value.split())
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
    return Fields(
        placement=tuple(as_integer("placement", t) for t in header["placement"].split()),
        ranks=[ranks[r] for r in range(len(ranks))],
        microbatches=as_integer("microbatches", header["microbatches"]),
        name=header.get("name", "custom"),
    )


# -- JSON ----------------------------------------------------------------------
def schedule_dict(
    name: str, microbatches: int, placement: Sequence[int], ranks: Iterable[Sequence[str]]
) -> dict[str, Any]:
    """The JSON form as a dict, ``ranks`` holding each rank's action tokens."""
    return {
        "format": "zeropipe-schedule",
        "version": 1,
        "name": name,
        "microbatches": microbatches,
        "placement": list(placement),
        "actions": [list(tokens) for tokens in ranks],
    }


def read_json(text: str) -> Any:
    """The data in JSON ``text``; text that is not JSON is a ScheduleError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # too deep a nesting is RecursionError
        raise ScheduleError(f"schedule is not valid JSON: {exc}", rule="syntax") from None


def read_dict(data: dict[str, Any], read_rank: Callable[[list[str]], T]) -> Fields[T]:
    """Read :func:`schedule_dict`'s form; anything malformed is a ScheduleError naming it."""
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
        parsed.append(read_rank(acts))
    return Fields(
        placement=tuple(as_integer("placement", r) for r in placement),
        ranks=parsed,
        microbatches=as_integer("microbatches", data["microbatches"]),
        name=str(data.get("name", "custom")),
    )


# -- torch.distributed.pipelining CSV --------------------------------------------
def format_torch_csv(ranks: Iterable[Sequence[str]]) -> str:
    """torch's CSV, ``ranks`` holding each rank's action tokens (pairs marked OVERLAP_F_B)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for tokens in ranks:
        writer.writerow([t + "OVERLAP_F_B" if t.startswith("(") else t for t in tokens])
    return out.getvalue()


def torch_csv_rows(text: str) -> list[list[str]]:
    """torch's CSV as one row of cells per rank, rows with nothing in them left out."""
    try:
        return [row for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)]
    except csv.Error as exc:  # e.g. a field over csv's size limit
        raise ScheduleError(f"cannot read torch CSV: {exc}", rule="syntax") from None


def refuse_torch_only(cell: str) -> None:
    """Raise ScheduleError if ``cell`` is one of torch's actions that have no zeropipe kind."""
    text = cell.strip()
    if any(k in text for k in _FSDP_ONLY):
        raise ScheduleError(
            f"torch action {text!r} is FSDP's unshard/reshard: not a schedule action here, "
            f"since FSDP2's own hooks gather and free the parameters of a stage that uses it; "
            f"remove it from the CSV",
            rule="unsupported",
            actions=(text,),
        )
