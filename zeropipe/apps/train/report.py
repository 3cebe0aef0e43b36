"""What ``zeropipe train`` reports: step metrics, the progress line, the summary, the pictures.

:mod:`zeropipe.apps.train.loop`'s loop asks this module for

    bubble_rate(pipe, elapsed, world)       a step's mean idle share over the ranks
    peak_bytes(pipe)                        a step's peak of saved activation bytes
    gather_timeline(pipe, world)            the first replica's measured step, every rank's events
    progress(record, steps)                 the progress line of a step's metrics
    print_summary(summary, out)             the table printed at the end of a run
    write_pictures(out, pipe, measured)     trace.json and timeline.png of the measured step
                                            (beside the one simulated from its action times),
                                            and loss.png from metrics.jsonl
    loss_series(rows)                       the training and eval curves loss.png draws
    torch_profile(on, device)               torch's profiler around a step (--profile), whose
                                            Chrome trace the loop writes to torch_trace.json
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropipe.core.errors import ZeropipeError
from zeropipe.core.simulate import Event, Timeline, costs_from_timeline, simulate
from zeropipe.runtime.pipeline import Pipeline

__all__ = [
    "bubble_rate",
    "gather_timeline",
    "loss_series",
    "peak_bytes",
    "print_summary",
    "progress",
    "torch_profile",
    "write_pictures",
]


def bubble_rate(pipe: Pipeline, elapsed: float, world: int) -> float:
    """Mean idle share of the step over ranks: 1 - compute time / step time.

    Compute time is each action's work (``Event.work``): the time an action
    spent blocked for received data is idle, as the simulated bubble counts it.
    """
    busy = sum(e.work for evs in pipe.last_events for e in evs if e.lane == "compute")
    # Each process plays one pipeline rank, or (one-process pipelines) all of them.
    ranks = world * (1 if pipe.distributed else pipe.schedule.num_ranks)
    if world > 1:
        t = torch.tensor([busy])
        dist.all_reduce(t)
        busy = float(t.item())
    return max(0.0, 1.0 - busy / (ranks * elapsed))


def peak_bytes(pipe: Pipeline) -> int | None:
    peaks = getattr(pipe, "peak_saved_bytes", None)
    if peaks is None:
        return None
    return int(max(peaks)) if isinstance(peaks, (list, tuple)) else int(peaks)


def gather_timeline(pipe: Pipeline, world: int) -> Timeline:
    """The first replica's pipeline: every rank's events of the last step."""
    events: list[list[Event]] = pipe.last_events
    if pipe.distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (pipe.dp_rank, pipe.rank, events[pipe.rank]))
        first = {r: evs for d, r, evs in gathered if d == 0}
        events = [list(first[r]) for r in range(pipe.schedule.num_ranks)]
    return Timeline(pipe.schedule, events, peak_memory=[], memory_unit="bytes", measured=True)


@contextlib.contextmanager
def torch_profile(on: bool, device: str) -> Iterator[Any]:
    """torch's profiler around the block (``on``), else nothing: yields the profiler or None.

    CPU activity, and on an accelerator every activity this torch supports (its kernels).
    The loop exports the trace after the block, outside the step's timing.
    """
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, supported_activities

    cpu = ProfilerActivity.CPU
    activities = (
        [cpu] if device == "cpu" else [cpu, *(a for a in supported_activities() if a != cpu)]
    )
    with profile(activities=activities) as prof:
        yield prof


def write_pictures(out: Path, pipe: Pipeline, measured: Timeline | None) -> dict[str, Any] | None:
    """trace.json, timeline.png and loss.png; returns the traced step's figures (None if no
    step was traced): its measured and planned bubble, the costs planned with and the
    measured timeline."""
    from zeropipe.core import render

    trace: dict[str, Any] | None = None
    if measured is not None:
        render.write_chrome_trace(measured, out / "trace.json")
        costs = costs_from_timeline(measured)
        planned = simulate(pipe.schedule, costs)
        trace = {
            "measured_bubble": measured.bubble_rate,
            "planned_bubble": planned.bubble_rate,
            "costs": costs,
            "timeline": measured,
        }
        try:
            render.render_pngs(
                [planned, measured],
                out / "timeline.png",
                ["planned (simulated from measured action times)", "measured"],
            )
        except ZeropipeError as exc:
            print(f"zeropipe: note: {exc}", file=sys.stderr)
    _loss_png(out)
    return trace


def loss_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """metrics.jsonl's rows as the curves loss.png draws: ``"train"``, the training loss of
    each step, and ``"eval"``, the held-out loss where a row carries one (at the start, every
    ``--eval-every`` steps and at the end).  A resumed run's eval at the step it went on from
    is drawn once."""
    train_pts = {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}
    eval_pts = {int(r["step"]): float(r["eval_loss"]) for r in rows if "eval_loss" in r}
    return {
        "train": (sorted(train_pts), [train_pts[s] for s in sorted(train_pts)]),
        "eval": (sorted(eval_pts), [eval_pts[s] for s in sorted(eval_pts)]),
    }


def _loss_png(out: Path) -> None:
    path = out / "metrics.jsonl"
    if not path.exists():  # the first step's loss was non-finite: nothing to draw
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(
            "zeropipe: note: loss.png needs matplotlib: pip install 'zeropipe[plot]'",
            file=sys.stderr,
        )
        return
    series = loss_series(rows)
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(*series["train"], lw=1.2, label="training loss")
    if series["eval"][0]:
        # Joined only where --eval-every gave a curve: a line from the start's eval to the
        # end's would draw a path that was never measured.
        style = "o-" if len(series["eval"][0]) > 2 else "o"
        ax.plot(*series["eval"], style, lw=1.2, ms=5, label="eval loss (held out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy)")
    ax.set_title("zeropipe train: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)


def progress(record: dict[str, Any], total: int, suffix: str = "") -> None:
    """The progress line of a step (``suffix`` at its end): redrawn in place on a terminal,
    else one line every 25 steps and at the last."""
    width = 24
    done = int(width * record["step"] / total)
    peak = record["peak_saved_bytes"]
    mem = f" | peak {peak / 2**20:.1f} MiB" if peak else ""
    line = (
        f"[{'#' * done}{'.' * (width - done)}] step {record['step']}/{total} | loss {record['loss']:.3f} | "
        f"{record['tokens_per_s']:,.0f} tok/s | bubble {record['bubble_rate']:.0%}{mem}{suffix}"
    )
    end = "\r" if sys.stdout.isatty() else "\n"
    if end == "\n" and record["step"] % 25 and record["step"] != total:
        return
    print(line, end=end, flush=True)


def eval_line(step: int, loss: float) -> None:
    """The held-out loss after ``step`` steps, on a line of its own (below a redrawn bar)."""
    below_bar = "\n" if sys.stdout.isatty() else ""
    print(f"{below_bar}eval loss {loss:.3f} after step {step}", flush=True)


def _bubble_row(summary: dict[str, Any]) -> list[tuple[str, str]]:
    trace = summary.get("trace")
    if not trace:
        return []
    return [
        (
            f"bubble of step {summary['trace_step'] + 1}",
            f"{trace['measured_bubble']:.1%} (planned {trace['planned_bubble']:.1%})",
        )
    ]


def _eval_row(summary: dict[str, Any]) -> tuple[str, str]:
    """The eval losses at the start and the end; a run stopped before its end eval says so
    (no made-up end value)."""
    start, end = summary["initial_eval_loss"], summary.get("final_eval_loss")
    if end is None or not math.isfinite(end):
        return (
            "eval loss",
            f"{start:.3f} at start; no end eval (stopped at step {summary['last_step']})",
        )
    return ("eval loss (start -> end)", f"{start:.3f} -> {end:.3f}")


def print_summary(summary: dict[str, Any], out: Path) -> None:
    rows = [
        ("model", summary["model"]),
        (
            "schedule",
            summary["schedule"]
            + (f", W in groups of {summary['group_w']}" if summary["group_w"] > 1 else ""),
        ),
        ("ranks", summary["ranks"]),
        *([("data-parallel replicas", summary["dp"])] if summary["dp"] > 1 else []),
        *([("tensor parallel", summary["tp"])] if summary.get("tp", 1) > 1 else []),
        ("steps run", summary["steps_run"]),
        _eval_row(summary),
        ("final train loss", f"{summary['final_train_loss']:.3f}"),
        *_bubble_row(summary),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("outputs", str(out)),
    ]
    width = max(len(k) for k, _ in rows)
    print("summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
