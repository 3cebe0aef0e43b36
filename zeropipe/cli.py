"""The ``zeropipe`` command line.

Each subcommand is a pair of functions, ``add_arguments(parser)`` and
``run(args) -> exit code``, registered in :data:`COMMANDS`; the first line
of ``run``'s docstring is its help.  Adding a command (train, bench,
profile, ...) means writing the pair and adding one line to the table.

Every user error -- a :class:`~zeropipe.errors.ZeropipeError`, an
unreadable file, a bad flag -- ends as one line ``zeropipe: error: ...`` on
stderr (a schedule error's grid follows it) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from zeropipe import render, train
from zeropipe.costs import CostModel
from zeropipe.errors import ScheduleError, ZeropipeError
from zeropipe.ir import Schedule
from zeropipe.lower import lower
from zeropipe.schedules import GENERATORS, generate
from zeropipe.simulate import simulate
from zeropipe.validate import validate

__all__ = ["COMMANDS", "build_parser", "main"]

_PROG = "zeropipe"
_DEFAULT_STAGES = 4
_DEFAULT_MICROBATCHES = 8


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag raises instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ZeropipeError(f"{message} (see '{self.prog} --help')")


# -- zeropipe schedules -----------------------------------------------------------------
def _add_schedules_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _run_schedules(args: argparse.Namespace) -> int:
    """List the registered schedule generators."""
    rows = []
    for name in sorted(GENERATORS):
        gen = GENERATORS[name]
        d = gen.default_chunks
        chunks = f"chunks: any (default {d})" if gen.takes_chunks else f"chunks: {d} per rank"
        rows.append((name, chunks, gen.description))
    wn = max((len(r[0]) for r in rows), default=0)
    wc = max((len(r[1]) for r in rows), default=0)
    for name, chunks, description in rows:
        print(f"{name:<{wn}}  {chunks:<{wc}}  {description}")
    return 0


# -- zeropipe simulate ------------------------------------------------------------------
def _default_schedule() -> str:
    # Decided at call time: generators register themselves on import.
    return "zbv" if "zbv" in GENERATORS else "1f1b"


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build (or read) a schedule, validate it, simulate it under a cost model and "
        "show the timeline. --stages is the pipeline depth p, i.e. the number of ranks; "
        "with --chunks v each rank holds v model chunks and the model has p*v stages."
    )
    parser.add_argument(
        "--schedule",
        metavar="NAME_OR_FILE",
        help="a registered generator (see `zeropipe schedules`; default: zbv if registered, "
        "else 1f1b) or a schedule file: .json (zeropipe JSON), .csv "
        "(torch.distributed.pipelining CSV), anything else the zeropipe text form",
    )
    parser.add_argument(
        "--stages",
        type=_int_at_least(1),
        metavar="P",
        help=f"pipeline depth p = number of ranks (default {_DEFAULT_STAGES}); "
        "the model has p*v stages with --chunks v",
    )
    parser.add_argument(
        "--microbatches",
        type=_int_at_least(1),
        metavar="M",
        help=f"microbatches per step (default {_DEFAULT_MICROBATCHES})",
    )
    parser.add_argument(
        "--chunks",
        type=_int_at_least(1),
        metavar="V",
        help="model chunks (stages) per rank (default: the generator's)",
    )
    parser.add_argument(
        "--costs",
        default="",
        metavar="SPEC",
        help="times of one rank's worth of layers, split evenly over its chunks: "
        "F=1,B=2,I=1,W=1,R=1,comm=0,act_w=0 (any subset; default F=1, I=W=1, comm=0), "
        "or a zeropipe cost-model JSON file",
    )
    parser.add_argument(
        "--memory-limit",
        type=_positive_float,
        metavar="X",
        help="fail unless every rank's peak memory fits X (unit: microbatches of one "
        "rank's activations, or the cost file's unit)",
    )
    parser.add_argument(
        "--lower", action="store_true", help="insert SEND/RECV actions before simulating"
    )
    parser.add_argument(
        "--show", action="store_true", help="print the schedule's text form as well"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the grid"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the timeline into a PNG")
    parser.add_argument(
        "--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto, chrome://tracing)"
    )
    parser.add_argument(
        "--width",
        type=_int_at_least(10),
        metavar="COLUMNS",
        help="columns of the time axis in the grid (default: fit the terminal)",
    )


def _run_simulate(args: argparse.Namespace) -> int:
    """Validate and simulate a schedule; print its timeline, or write a PNG / Chrome trace."""
    schedule = _load_schedule(args)
    if args.lower:
        schedule = lower(schedule)
    costs = _load_costs(args.costs, schedule)
    graph = validate(schedule, memory_limit=args.memory_limit, costs=costs)
    timeline = simulate(schedule, costs, graph=graph)
    written: dict[str, str] = {}
    if args.plot:
        written["plot"] = str(render.render_png(timeline, args.plot))
    if args.trace:
        written["trace"] = str(render.write_chrome_trace(timeline, args.trace))
    if args.json:
        out: dict[str, Any] = dict(timeline.summary())
        out["chunks"] = _chunks(schedule)
        out["lowered"] = schedule.is_lowered
        out["costs"] = args.costs
        out["memory_limit"] = args.memory_limit
        out["files"] = written
        if args.show:
            out["text"] = schedule.to_text()
        print(json.dumps(out))
        return 0
    if args.show:
        print(schedule.to_text())
    width = args.width or max(40, shutil.get_terminal_size((110, 24)).columns - 10)
    print(render.render_text(timeline, width=width))
    peaks = ", ".join(f"{p:.4g}" for p in timeline.peak_memory)
    print(f"peak memory per rank (unit: {timeline.memory_unit}): {peaks}")
    for what, path in written.items():
        print(f"wrote {what}: {path}")
    return 0


def _chunks(schedule: Schedule) -> int:
    return max(len(schedule.stages_of(r)) for r in range(schedule.num_ranks))


def _load_schedule(args: argparse.Namespace) -> Schedule:
    name = args.schedule or _default_schedule()
    path = Path(name)
    if path.is_file():
        schedule = _read_schedule_file(path, args.microbatches)
        given = {
            "--stages": (args.stages, schedule.num_ranks, "rank(s)"),
            "--microbatches": (args.microbatches, schedule.microbatches, "microbatch(es)"),
            "--chunks": (args.chunks, _chunks(schedule), "chunk(s) per rank"),
        }
        for flag, (want, have, what) in given.items():
            if want is not None and want != have:
                raise ZeropipeError(
                    f"{path} has {have} {what} but {flag} {want} was given; "
                    f"drop {flag} (a schedule file fixes it)"
                )
        return schedule
    if name not in GENERATORS and (path.suffix or "/" in name or "\\" in name):
        raise ZeropipeError(
            f"schedule file {name} does not exist (nor is {name!r} a registered schedule: "
            f"{', '.join(sorted(GENERATORS))})"
        )
    return generate(
        name,
        args.stages or _DEFAULT_STAGES,
        args.microbatches or _DEFAULT_MICROBATCHES,
        args.chunks,
    )


def _read_schedule_file(path: Path, microbatches: int | None) -> Schedule:
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            return Schedule.from_dict(data)
        if suffix == ".csv":
            return Schedule.from_torch_csv(text, microbatches=microbatches, name=path.stem)
        return Schedule.from_text(text)
    except ScheduleError as exc:
        raise ScheduleError(f"{path}: {exc}", rule=exc.rule, actions=exc.actions) from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # Malformed JSON, non-numeric header values and the like.
        raise ZeropipeError(f"cannot read schedule file {path}: {exc}") from exc


def _load_costs(spec: str, schedule: Schedule) -> CostModel:
    path = Path(spec)
    if spec and path.is_file():
        try:
            return CostModel.from_json(path.read_text())
        except ZeropipeError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ZeropipeError(f"cannot read cost file {path}: {exc}") from exc
    return CostModel.parse(spec, schedule.num_stages, _chunks(schedule))


# -- the table and the entry point ------------------------------------------------------
AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

#: name -> (add_arguments, run); the first docstring line of ``run`` is the help.
COMMANDS: dict[str, tuple[AddArguments, Run]] = {
    "schedules": (_add_schedules_arguments, _run_schedules),
    "simulate": (_add_simulate_arguments, _run_simulate),
    "train": (train.add_arguments, train.run_cli),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="Pipeline-parallel schedules as data: list, validate, simulate, draw.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add_arguments, run) in COMMANDS.items():
        summary = (run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else ""
        command = sub.add_parser(name, help=summary, description=summary)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zeropipe`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise ZeropipeError(f"choose a command: {', '.join(COMMANDS)} (see '{_PROG} --help')")
        code: int = args.run(args)
        return code
    except SystemExit as exc:  # --help and --version end here
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:
        # `zeropipe simulate | head`: the reader left.  Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ZeropipeError, OSError) as exc:
        message = str(exc) or type(exc).__name__
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return 2
