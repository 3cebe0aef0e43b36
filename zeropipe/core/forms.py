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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from zeropipe.core.errors import ScheduleError

__all__ = [
    "Fields",
    "as_integer",
    "as_integers",
    "check_copies",
    "check_routes",
    "expand_routes",
    "format_grid",
    "format_text",
    "format_torch_csv",
    "pair_members",
    "read_dict",
    "read_json",
    "read_text",
    "refuse_torch_only",
    "route_runs",
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
    routes: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (microbatch, its stages), as written
    copies: tuple[tuple[int, int], ...] = ()  # (stage, the stage it is a copy of)


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
def route_runs(routes: Sequence[Sequence[int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Per-microbatch routes as runs ``(first, last, stages)`` of consecutive equal ones."""
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for mb, route in enumerate(routes):
        stages = tuple(route)
        if runs and runs[-1][2] == stages and runs[-1][1] == mb - 1:
            runs[-1] = (runs[-1][0], mb, stages)
        else:
            runs.append((mb, mb, stages))
    return runs


def format_text(
    name: str,
    microbatches: int,
    placement: Sequence[int],
    ranks: Iterable[Sequence[str]],
    routes: Sequence[Sequence[int]] = (),
    copies: Iterable[tuple[int, int]] = (),
) -> str:
    """The text form, ``ranks`` holding each rank's action tokens.

    ``routes`` (one per microbatch, or none: every microbatch visits every stage)
    are written ``route 0-3: 0 1 2 3``; ``copies`` as ``copies: 4=0 5=1``.
    """
    lines = [
        "# zeropipe schedule",
        f"name: {name}",
        f"microbatches: {microbatches}",
        "placement: " + " ".join(str(r) for r in placement),
    ]
    for lo, hi, stages in route_runs(routes):
        span = str(lo) if lo == hi else f"{lo}-{hi}"
        lines.append(f"route {span}: " + " ".join(str(s) for s in stages))
    if copies:
        lines.append("copies: " + " ".join(f"{s}={of}" for s, of in copies))
    for rank, tokens in enumerate(ranks):
        lines.append(f"rank {rank}: " + " ".join(tokens))
    return "\n".join(lines) + "\n"


def read_text(text: str, read_rank: Callable[[list[str]], T]) -> Fields[T]:
    """Read the text form; anything malformed is a ScheduleError naming its line."""
    header: dict[str, str] = {}
    ranks: dict[int, T] = {}
    routes: list[tuple[int, tuple[int, ...]]] = []
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
        elif key.startswith("route"):
            routes.extend(_read_route(lineno, key[5:], value))
        elif key in ("name", "microbatches", "placement", "copies"):
            header[key] = value.strip()
        else:
            raise ScheduleError(
                f"line {lineno}: unknown key {key!r} (known: name, microbatches, placement, "
                f"rank N, route A-B, copies)",
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
        routes=tuple(routes),
        copies=_read_copies(header.get("copies", "").split()),
    )


def _read_route(lineno: int, span: str, value: str) -> list[tuple[int, tuple[int, ...]]]:
    """``route A-B: s0 s1 ...`` (or ``route A: ...``) as one (microbatch, stages) per microbatch."""
    lo, sep, hi = span.strip().partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise ScheduleError(
            f"line {lineno}: bad route header 'route{span}', expected 'route A-B' or 'route A'",
            rule="syntax",
        ) from None
    stages = as_integers("route", value.split())
    return [(mb, stages) for mb in range(first, last + 1)]


def _read_copies(items: Iterable[object]) -> tuple[tuple[int, int], ...]:
    """``4=0 5=1`` (text) or ``{"4": 0}`` items (JSON) as (stage, copied stage) pairs."""
    out = []
    for item in items:
        stage, sep, of = str(item).partition("=")
        if not sep:
            raise ScheduleError(
                f"copies: expected STAGE=STAGE such as '4=0', got {item!r:.40}", rule="syntax"
            )
        out.append((as_integer("copies", stage), as_integer("copies", of)))
    return tuple(out)


# -- routes and copies ---------------------------------------------------------
def check_routes(routes: object, microbatches: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """One route per microbatch (or none), each consecutive stages in range; else a ScheduleError."""
    items = [as_integers("route", r) for r in routes]  # type: ignore[attr-defined]
    if not items:
        return ()
    if len(items) != microbatches:
        raise ScheduleError(
            f"routes: one per microbatch, got {len(items)} for {microbatches} microbatches",
            rule="route",
        )
    for mb, route in enumerate(items):
        # Consecutive stages: the stage after s on any route is s + 1, so a send's receiver
        # is known from the send alone (what the transports need); number stages to suit.
        if (
            not route
            or route != tuple(range(route[0], route[-1] + 1))
            or not 0 <= route[0] <= route[-1] < stages
        ):
            raise ScheduleError(
                f"route of microbatch {mb} is {list(route)}: a route is consecutive stages of "
                f"0..{stages - 1} in increasing order (number the stages so that it is)",
                rule="route",
            )
    return tuple(items)


def expand_routes(
    written: Sequence[tuple[int, tuple[int, ...]]], microbatches: int, stages: int
) -> tuple[tuple[int, ...], ...]:
    """A form's ``route A-B`` lines as one route per microbatch: unnamed ones visit every stage."""
    if not written:
        return ()
    every = tuple(range(stages))
    out: list[tuple[int, ...] | None] = [None] * microbatches
    for mb, route in written:
        if not 0 <= mb < microbatches or out[mb] is not None:
            raise ScheduleError(
                f"route of microbatch {mb}: "
                + (
                    "given twice"
                    if 0 <= mb < microbatches
                    else f"no such microbatch (0..{microbatches - 1})"
                ),
                rule="route",
            )
        out[mb] = route
    return tuple(every if r is None else r for r in out)


def check_copies(copies: object, stages: int) -> tuple[tuple[int, int], ...]:
    """``{stage: copied stage}`` (or its pairs) as sorted pairs; a stage copies an original."""
    items = copies.items() if isinstance(copies, Mapping) else copies
    pairs = sorted((int(s), int(of)) for s, of in items)  # type: ignore[attr-defined]
    copied = {s for s, _ in pairs}
    for s, of in pairs:
        if not (0 <= s < stages and 0 <= of < stages) or of == s or of in copied:
            raise ScheduleError(
                f"copies: stage {s} as a copy of stage {of}: both must be stages of "
                f"0..{stages - 1}, and the copied stage an original (not itself a copy)",
                rule="route",
            )
    return tuple(pairs)


# -- JSON ----------------------------------------------------------------------
def schedule_dict(
    name: str,
    microbatches: int,
    placement: Sequence[int],
    ranks: Iterable[Sequence[str]],
    routes: Sequence[Sequence[int]] = (),
    copies: Iterable[tuple[int, int]] = (),
) -> dict[str, Any]:
    """The JSON form as a dict, ``ranks`` holding each rank's action tokens.

    Routes and copies appear only when there are some: ``"routes": {"0-3": [0, 1, 2, 3]}``,
    ``"copies": {"4": 0}``.
    """
    out: dict[str, Any] = {
        "format": "zeropipe-schedule",
        "version": 1,
        "name": name,
        "microbatches": microbatches,
        "placement": list(placement),
        "actions": [list(tokens) for tokens in ranks],
    }
    if routes:
        out["routes"] = {
            (str(lo) if lo == hi else f"{lo}-{hi}"): list(stages)
            for lo, hi, stages in route_runs(routes)
        }
    if copies:
        out["copies"] = {str(s): of for s, of in copies}
    return out


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
        routes=tuple(_dict_routes(data.get("routes", {}))),
        copies=_read_copies(_items("copies", data.get("copies", {}))),
    )


def _items(what: str, value: object) -> list[str]:
    """A JSON object's entries as ``key=value`` strings; anything else is a ScheduleError."""
    if not isinstance(value, dict):
        raise ScheduleError(f"schedule JSON '{what}' must be an object, got {value!r:.40}")
    return [f"{k}={v}" for k, v in value.items()]


def _dict_routes(value: object) -> list[tuple[int, tuple[int, ...]]]:
    """The JSON form's ``{"0-3": [0, 1, 2, 3]}`` as one (microbatch, stages) per microbatch."""
    if not isinstance(value, dict):
        raise ScheduleError(f"schedule JSON 'routes' must be an object, got {value!r:.40}")
    out: list[tuple[int, tuple[int, ...]]] = []
    for span, stages in value.items():
        if not isinstance(stages, list):
            raise ScheduleError(f"schedule JSON route {span!r}: stages must be a list")
        out.extend(_read_route(0, " " + str(span), " ".join(str(s) for s in stages)))
    return out


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


# -- errors --------------------------------------------------------------------
def format_grid(
    actions: Sequence[Sequence[object]],
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
