"""Timeline -> terminal grid, Chrome trace JSON, PNG.

All three read a :class:`~zeropipe.core.simulate.Timeline` (simulated or measured)
and nothing else, so a planned and a measured run are drawn the same way.
The terminal grid scales time to a fixed number of columns::

    1f1b: 2 ranks, 2 stages, 3 microbatches (simulated; time in cost units)
    makespan 12  bubble rate 25.0%  steady bubble rate 25.0%
             0         10        20
             |         |         |
    rank 0   F0FF1FB0BBBB....F2FFB1BBBB....B2BBBB
    rank 1   ....F0FFB0BBBBF1FFB1BBBBF2FFB2BBBB..

Each action starts with its kind letter and, when it has room, its
microbatch; the rest of its cells repeat the letter ('.' is idle).  Lower
case marks odd-numbered chunks of a rank so interleaved stages stay apart.
A measured action's wait for its data (``Event.wait``) is drawn apart from
its work: '-' in the grid, a hatched grey box in a PNG, a "wait" slice in a
Chrome trace; like '.', it is idle time in the bubble rates.

matplotlib is optional (``pip install 'zeropipe[plot]'``) and imported only
when a PNG is drawn, on the Agg backend via an explicit canvas so no pyplot
global state is touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from zeropipe.core.errors import ZeropipeError
from zeropipe.core.ir import Kind
from zeropipe.core.simulate import Event, Timeline

__all__ = [
    "KIND_COLORS",
    "MAX_RANKS",
    "WAIT_COLOR",
    "draw_timeline",
    "render_png",
    "render_pngs",
    "render_text",
    "to_chrome_trace",
    "write_chrome_trace",
]

# One letter per kind in the terminal grid; R is recompute, so reload is L.
_LETTERS: dict[Kind, str] = {
    Kind.F: "F",
    Kind.B: "B",
    Kind.I: "I",
    Kind.W: "W",
    Kind.R: "R",
    Kind.OFFLOAD: "O",
    Kind.RELOAD: "L",
    Kind.REDUCE_GRAD: "G",
}

_NAMES: dict[Kind, str] = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.I: "input grad",
    Kind.W: "weight grad",
    Kind.R: "recompute",
    Kind.OFFLOAD: "offload",
    Kind.RELOAD: "reload",
    Kind.REDUCE_GRAD: "grad all-reduce",
}

#: Fixed colours (Tableau 10), so a kind looks the same in every figure.
KIND_COLORS: dict[Kind, str] = {
    Kind.F: "#4e79a7",
    Kind.B: "#59a14f",
    Kind.I: "#f28e2b",
    Kind.W: "#b07aa1",
    Kind.R: "#e15759",
    Kind.OFFLOAD: "#9c755f",
    Kind.RELOAD: "#edc948",
    Kind.REDUCE_GRAD: "#76b7b2",
}

#: How a measured wait for data is drawn (PNG), apart from any kind's colour.
WAIT_COLOR = "#d9d9d9"

#: Rank rows the terminal grid draws at most (the JSON summary and traces have all).
MAX_RANKS = 64

_LANES = ("compute", "copy", "comm", "reduce")
_LABEL_WIDTH = 9  # "rank 12  "


# -- helpers shared by every output --------------------------------------------
def _stages_per_rank(timeline: Timeline) -> int:
    """The most stages a rank runs, its copies of other stages (dualpipe) included."""
    s = timeline.schedule
    return max(len(s.stages_of(r)) for r in range(s.num_ranks))


def _chunk(timeline: Timeline, event: Event) -> int:
    """Index of the event's stage among its rank's stages (0 for one stage per rank)."""
    stages = timeline.schedule.stages_of(event.rank)
    return stages.index(event.action.stage) if event.action.stage in stages else 0


def _time_unit(timeline: Timeline) -> str:
    unit = timeline.meta.get("time_unit")  # e.g. "s" when simulated from measured costs
    return str(unit) if unit else ("s" if timeline.measured else "cost units")


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


# -- terminal grid ---------------------------------------------------------------
def render_text(timeline: Timeline, width: int = 100, max_ranks: int = MAX_RANKS) -> str:
    """A rank x time grid of ``width`` columns with a header, a time ruler and a legend.

    A rank with OFFLOAD/RELOAD actions gets a second row, ``copy``, for its
    copy stream, and one with REDUCE_GRAD a row ``reduce`` for its gradient
    all-reduces (``G``, with the stage, e.g. ``G1``); copies and reductions too
    short for a cell still mark the cell they start in.
    Only the first ``max_ranks`` ranks are drawn (a line says how many are not):
    thousands of rows are no picture, and drawing them is most of the time spent.
    """
    if width < 10:
        raise ZeropipeError(f"render_text needs width >= 10 columns, got {width}")
    if max_ranks < 1:
        raise ZeropipeError(f"render_text needs max_ranks >= 1, got {max_ranks}")
    s = timeline.schedule
    t0, t1 = timeline.start, timeline.end  # each a pass over every event: once, not per row
    span = t1 - t0
    cell = span / width if span > 0 else 1.0
    lines = [
        f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages, {s.microbatches} microbatches "
        f"({'measured' if timeline.measured else 'simulated'}; time in {_time_unit(timeline)})",
        f"makespan {span:.4g}  bubble rate {_percent(timeline.bubble_rate)}  "
        f"steady bubble rate {_percent(timeline.steady_bubble_rate)}",
        *_ruler(t0, span, width),
    ]
    present: set[Kind] = set()
    for rank, events in enumerate(timeline.events[:max_ranks]):
        compute = [e for e in events if e.lane == "compute"]
        copy = [e for e in events if e.lane == "copy"]
        reduce = [e for e in events if e.lane == "reduce"]
        present.update(e.action.kind for e in compute + copy + reduce)
        lines.append(f"{f'rank {rank}':<{_LABEL_WIDTH}}" + _row(timeline, t0, compute, cell, width))
        for name, lane in (("copy", copy), ("reduce", reduce)):
            if lane:
                lines.append(
                    f"{'  ' + name:<{_LABEL_WIDTH}}"
                    + _row(timeline, t0, lane, cell, width, keep_short=True)
                )
    hidden = timeline.num_ranks - max_ranks
    if hidden > 0:
        lines.append(
            f"... {hidden:,} more rank{'s' if hidden > 1 else ''} not drawn; "
            f"--json / --trace have them all"
        )
    legend = [f"{_LETTERS[k]} {_NAMES[k]}" for k in _LETTERS if k in present]
    if any(e.wait > 0 for evs in timeline.events[:max_ranks] for e in evs):
        legend.append("- waiting for data")
    legend.append(". idle")
    if _stages_per_rank(timeline) > 1:
        legend.append("lower case: odd chunk of its rank")
    legend.append(f"1 column = {cell:.3g} {_time_unit(timeline)}")
    lines.append("  ".join(legend))
    return "\n".join(lines)


def _ruler(t0: float, span: float, width: int) -> list[str]:
    """Two lines: round time values at least ten columns apart, and '|' under each."""
    labels = [" "] * (width + 8)
    ticks = [" "] * width
    step = _nice_step(span * 10 / width) if span > 0 else 1.0
    n = 0
    while span > 0 and n * step <= span:
        col = round(n * step * width / span)
        text = f"{n * step:.4g}"
        if col < width and col + len(text) <= len(labels):
            labels[col : col + len(text)] = text
            ticks[col] = "|"
        n += 1
    pad = " " * _LABEL_WIDTH
    return [(pad + "".join(labels)).rstrip(), (pad + "".join(ticks)).rstrip()]


def _nice_step(at_least: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= ``at_least``."""
    power = 10.0 ** math.floor(math.log10(at_least))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * power >= at_least * (1 - 1e-9):
            return m * power
    return 10.0 * power


def _row(
    timeline: Timeline,
    t0: float,
    events: list[Event],
    cell: float,
    width: int,
    keep_short: bool = False,
) -> str:
    """One lane of one rank: each column shows the event that fills most of it."""
    overlap: list[dict[int, float]] = [{} for _ in range(width)]
    waits = [0.0] * width  # share of each column spent waiting for data
    for n, e in enumerate(events):
        lo, hi = (e.ready - t0) / cell, (e.end - t0) / cell
        if e.wait > 0:
            _spread(waits, (e.start - t0) / cell, lo)
        for col in range(max(0, math.floor(lo)), min(width, math.ceil(hi))):
            part = min(hi, col + 1) - max(lo, col)
            if part > 0:
                overlap[col][n] = overlap[col].get(n, 0.0) + part
    # A column is busy when events fill at least half of it; the biggest share wins.
    owner: list[int | None] = [
        max(shares, key=shares.__getitem__) if sum(shares.values()) >= 0.5 else None
        for shares in overlap
    ]
    if keep_short:
        shown = set(owner)
        for n, e in enumerate(events):
            if n in shown:
                continue
            # Zero-length copies at one instant (OFFLOAD then RELOAD) go side by side.
            first = min(width - 1, max(0, math.floor((e.start - t0) / cell)))
            free = [c for c in range(first, min(width, first + 3)) if owner[c] is None]
            if free:
                owner[free[0]] = n
    out = ["-" if w >= 0.5 else "." for w in waits]
    col = 0
    while col < width:
        who = owner[col]
        run = 1
        while col + run < width and owner[col + run] == who:
            run += 1
        if who is not None:
            out[col : col + run] = _label(timeline, events[who], run)
        col += run
    return "".join(out)


def _spread(shares: list[float], lo: float, hi: float) -> None:
    """Add to each column of ``shares`` the part of ``[lo, hi)`` (in columns) over it."""
    for col in range(max(0, math.floor(lo)), min(len(shares), math.ceil(hi))):
        shares[col] += max(0.0, min(hi, col + 1) - max(lo, col))


def _label(timeline: Timeline, event: Event, cells: int) -> str:
    letter = _LETTERS.get(event.action.kind, "?")
    if _chunk(timeline, event) % 2:
        letter = letter.lower()
    mb = event.action.microbatch
    if event.action.kind is Kind.REDUCE_GRAD:
        mb = event.action.stage  # a stage's reduction: name the stage
    full = letter + ("" if mb is None else str(mb))
    head = full if len(full) <= cells else letter
    return head + letter * (cells - len(head))


# -- Chrome trace ------------------------------------------------------------------
def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome trace event format (opens in Perfetto and chrome://tracing).

    One process; one thread per rank and lane (compute, copy, comm, reduce: the
    gradient all-reduces, running beside the compute that follows them; "at once":
    a compute action that began before the rank's previous one ended, the backward
    half of an overlapped pair run at once, so that no thread's events overlap), and one
    "X" (complete) event per action, named by its text (``1F3``), from when its
    data had arrived; a measured wait for that data is an "X" event of its own
    before it, named ``wait`` (category ``wait``, the action in its args).  Measured
    timelines are in seconds and become microseconds; simulated ones are in
    arbitrary cost units, drawn as 1 unit = 1000 us (``otherData`` says which).
    """
    scale = 1e6 if timeline.measured else 1000.0
    t0 = timeline.start
    kind = "measured" if timeline.measured else "simulated"
    name = f"zeropipe {timeline.schedule.name} ({kind})"
    trace: list[dict[str, Any]] = [_metadata("process_name", 0, {"name": name})]
    used: set[tuple[int, str]] = set()
    for rank, events in enumerate(timeline.events):
        reach = -math.inf  # when the rank's compute lane is free again
        for e in events:
            lane = e.lane
            if lane == "compute":
                if e.start < reach:
                    lane = "at once"
                else:
                    reach = e.end
            used.add((rank, lane))
            if e.wait > 0:
                trace.append(_wait_event(rank, e, t0, scale, lane))
            trace.append(_action_event(rank, e, t0, scale, lane))
    for rank, lane in sorted(used, key=lambda rl: _sort_index(*rl)):
        tid = _tid(rank, lane)
        trace.append(_metadata("thread_name", tid, {"name": f"rank {rank} {lane}"}))
        trace.append(_metadata("thread_sort_index", tid, {"sort_index": _sort_index(rank, lane)}))
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            **{k: v for k, v in timeline.summary().items()},
            "measured": timeline.measured,
            "time_scale": (
                "measured seconds, written as microseconds"
                if timeline.measured
                else "simulated cost units (arbitrary), written as 1 unit = 1000 us"
            ),
        },
    }


def _metadata(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    """A trace's "M" (metadata) event: a process or thread name or sort index."""
    return {"ph": "M", "name": name, "pid": 0, "tid": tid, "args": args}


def _wait_event(rank: int, e: Event, t0: float, scale: float, lane: str) -> dict[str, Any]:
    """The measured wait of ``e`` for its data, as an "X" event before it."""
    return {
        "ph": "X",
        "name": "wait",
        "cat": "wait",
        "pid": 0,
        "tid": _tid(rank, lane),
        "ts": (e.start - t0) * scale,
        "dur": e.wait * scale,
        "args": {"rank": rank, "step": e.step, "for": str(e.action)},
    }


def _action_event(rank: int, e: Event, t0: float, scale: float, lane: str) -> dict[str, Any]:
    """The work of ``e`` as an "X" event, from when its data had arrived."""
    a = e.action
    return {
        "ph": "X",
        "name": str(a),
        "cat": a.kind.value,
        "pid": 0,
        "tid": _tid(rank, lane),
        "ts": (e.ready - t0) * scale,
        "dur": e.work * scale,
        "args": {
            "rank": rank,
            "step": e.step,
            "stage": a.stage,
            "microbatch": a.microbatch,
            "kind": a.kind.value,
        },
    }


# A rank's threads in the trace, in the order drawn: an overlapped pair's second half just
# under the compute it ran beside.
_TRACE_LANES = ("compute", "at once", *_LANES[1:])
_AT_ONCE_TIDS = 1_000_000  # past every rank's lanes: the lanes' tids stay rank x 4 + lane


def _tid(rank: int, lane: str) -> int:
    if lane == "at once":
        return _AT_ONCE_TIDS + rank
    return rank * len(_LANES) + _LANES.index(lane)


def _sort_index(rank: int, lane: str) -> int:
    return rank * len(_TRACE_LANES) + _TRACE_LANES.index(lane)


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path``; return the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(timeline)))
    return path


# -- PNG -----------------------------------------------------------------------------
def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ZeropipeError(
            f"drawing a timeline needs matplotlib ({exc}); pip install 'zeropipe[plot]'"
        ) from exc
    return matplotlib, Figure, FigureCanvasAgg, Patch


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return (
        rgb[0] + (1 - rgb[0]) * amount,
        rgb[1] + (1 - rgb[1]) * amount,
        rgb[2] + (1 - rgb[2]) * amount,
    )


def _ink(rgb: tuple[float, float, float]) -> str:
    """Black on light boxes, white on dark ones."""
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def _legend_name(kind: Kind) -> str:
    return f"{kind.value} {_NAMES[kind]}" if len(kind.value) == 1 else _NAMES[kind]


def draw_timeline(ax: Any, timeline: Timeline, title: str | None = None) -> None:
    """Draw ``timeline`` on a matplotlib ``ax``: one row per rank, boxes coloured by kind.

    A rank's copy stream (OFFLOAD/RELOAD) is a thin bar under its compute row,
    its gradient all-reduces (REDUCE_GRAD) a thin bar above it; zero-length
    copies and reductions are triangles.  Later chunks of a rank are lighter.
    A measured action's wait for its data is a hatched grey box before it.
    Boxes wide enough carry their microbatch number.  The title gets the
    makespan and bubble rates.
    """
    _, _, _, Patch = _matplotlib()
    lettering = _lettering(ax, timeline)
    present: set[Kind] = set()
    waited = False
    for rank in range(len(timeline.events)):
        waited = _draw_rank(ax, timeline, rank, lettering, present) or waited
    _dress_axes(ax, timeline, title)
    _draw_legend(ax, Patch, present, waited, _stages_per_rank(timeline))


class _Lettering(NamedTuple):
    """The microbatch numbers' font size, and how many pixels make a character and a time unit."""

    fontsize: int
    char_px: float
    px_per_unit: float


def _lettering(ax: Any, timeline: Timeline) -> _Lettering:
    # Width in pixels of one time unit decides which boxes get a label.
    fig = ax.figure
    span = timeline.makespan
    px_per_unit = (
        ax.get_position().width * fig.get_figwidth() * fig.dpi / span * 0.85 if span else 0.0
    )
    fontsize = 7 if timeline.num_ranks <= 8 else 5
    char_px = fontsize * 0.6 * fig.dpi / 72
    return _Lettering(fontsize, char_px, px_per_unit)


def _draw_rank(
    ax: Any, timeline: Timeline, rank: int, lettering: _Lettering, present: set[Kind]
) -> bool:
    """Draw rank ``rank``'s row, adding the kinds drawn to ``present``; whether any waited."""
    events = timeline.events[rank]
    t0, chunks = timeline.start, _stages_per_rank(timeline)
    has_copy = any(e.lane == "copy" for e in events)
    has_reduce = any(e.lane == "reduce" for e in events)
    top = rank - 0.4 + (0.16 if has_reduce else 0.0)
    compute_y = (top, rank + (0.16 if has_copy else 0.4) - top)
    copy_y = (rank + 0.2, 0.2)
    reduce_y = (rank - 0.4, 0.14)
    waited = False
    for e in events:
        if e.lane == "comm":
            continue
        kind = e.action.kind
        present.add(kind)
        chunk = _chunk(timeline, e)
        color = _lighten(KIND_COLORS[kind], 0.45 * chunk / max(1, chunks - 1))
        y0, h = {"compute": compute_y, "copy": copy_y}.get(e.lane, reduce_y)
        if e.wait > 0:
            waited = True
            ax.broken_barh(
                [(e.start - t0, e.wait)],
                (y0, h),
                facecolors=[WAIT_COLOR],
                edgecolors="#8c8c8c",
                linewidth=0.3,
                hatch="////",
            )
        _draw_work(ax, e, e.ready - t0, (y0, h), color, lettering)
    return waited


def _draw_work(
    ax: Any,
    e: Event,
    x: float,
    box: tuple[float, float],
    color: tuple[float, float, float],
    lettering: _Lettering,
) -> None:
    """Event ``e``'s work from ``x``: a box, labelled if wide enough, or a triangle if empty."""
    y0, h = box
    w = e.work
    kind = e.action.kind
    if w <= 0:
        marker = "v" if kind in (Kind.OFFLOAD, Kind.REDUCE_GRAD) else "^"
        ax.plot(
            [x],
            [y0 + h / 2],
            marker=marker,
            color=color,
            markersize=4,
            mec="black",
            mew=0.3,
        )
        return
    ax.broken_barh([(x, w)], (y0, h), facecolors=[color], edgecolors="black", linewidth=0.3)
    label = "" if e.action.microbatch is None else str(e.action.microbatch)
    fits = w * lettering.px_per_unit >= lettering.char_px * (len(label) + 0.5)
    if label and e.lane == "compute" and fits:
        ax.text(
            x + w / 2,
            y0 + h / 2,
            label,
            ha="center",
            va="center",
            fontsize=lettering.fontsize,
            color=_ink(color),
        )


def _dress_axes(ax: Any, timeline: Timeline, title: str | None) -> None:
    """Limits, rank labels and a title with the makespan and bubble rates."""
    s = timeline.schedule
    span, chunks = timeline.makespan, s.chunks_per_rank
    ax.set_xlim(0, span if span > 0 else 1.0)
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.num_ranks)])
    ax.set_xlabel(f"time ({_time_unit(timeline)})")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    head = title or (
        f"{s.name}: p={s.num_ranks}, m={s.microbatches}"
        + (f", v={chunks}" if chunks > 1 else "")
        + (" (measured)" if timeline.measured else "")
    )
    ax.set_title(
        f"{head}  |  makespan {span:.4g}, bubble rate {_percent(timeline.bubble_rate)}, "
        f"steady {_percent(timeline.steady_bubble_rate)}",
        fontsize=9,
        loc="left",
    )


def _draw_legend(ax: Any, Patch: Any, present: set[Kind], waited: bool, chunks: int) -> None:
    """A legend right of the axes: the kinds drawn, the wait box if any, the chunk shading."""
    handles = [
        Patch(facecolor=KIND_COLORS[k], edgecolor="black", linewidth=0.3, label=_legend_name(k))
        for k in KIND_COLORS
        if k in present
    ]
    if waited:
        handles.append(
            Patch(
                facecolor=WAIT_COLOR,
                edgecolor="#8c8c8c",
                linewidth=0.3,
                hatch="////",
                label="wait for data",
            )
        )
    if chunks > 1:
        handles.append(Patch(facecolor="white", edgecolor="none", label="lighter = later chunk"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False
    )


def render_pngs(
    timelines: Sequence[Timeline], path: str | Path, titles: Sequence[str | None] = ()
) -> Path:
    """Stack several timelines (e.g. planned over measured) in one PNG at ``path``."""
    if not timelines:
        raise ZeropipeError("render_pngs needs at least one timeline")
    _, Figure, FigureCanvasAgg, _ = _matplotlib()
    heights = [max(1.6, 0.38 * t.num_ranks + 1.1) for t in timelines]
    fig = Figure(figsize=(13, sum(heights)), dpi=130, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, squeeze=False, height_ratios=heights)[:, 0]
    for n, (ax, timeline) in enumerate(zip(axes, timelines, strict=True)):
        draw_timeline(ax, timeline, titles[n] if n < len(titles) else None)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def render_png(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw ``timeline`` into a PNG at ``path``; return the path."""
    return render_pngs([timeline], path, [title])
