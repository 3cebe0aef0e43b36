"""The ``zeropipe`` command line.

Each subcommand is a pair of functions, ``add_arguments(parser)`` and
``run(args) -> exit code``, registered in :data:`COMMANDS`; the first line
of ``run``'s docstring is its help.  Adding a command (train, bench,
profile, ...) means writing the pair and adding one line to the table.

Every user error -- a :class:`~zeropipe.core.errors.ZeropipeError`, an
unreadable file, a bad flag -- ends as one line ``zeropipe: error: ...`` on
stderr (a schedule error's grid follows it) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from zeropipe.apps.cli_args import (
    ACTION_BYTES,
    ACTIONS_PER_SECOND,
    SCHEDULE_LIMIT,
    int_at_least,
    positive_float,
    refuse_too_big,
)
from zeropipe.core import render
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ScheduleError, ZeropipeError
from zeropipe.core.ir import Schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

__all__ = [
    "AUTO_LIMIT",
    "COMMANDS",
    "SIMULATE_LIMIT",
    "build_parser",
    "main",
    "simulate_actions",
]

_PROG = "zeropipe"
_DEFAULT_RANKS = 4
_DEFAULT_MICROBATCHES = 8

# How big a schedule `simulate` builds without --force, about half a minute: a named one
# at cli_args.ACTIONS_PER_SECOND; auto searches candidates, about 4,500 actions of the
# largest one a second (64 ranks, 256 microbatches: 98,304 actions, 21 s, 275 MB).
SIMULATE_LIMIT = SCHEDULE_LIMIT
AUTO_RATE = 4_500.0
AUTO_BYTES = 2_800
AUTO_LIMIT = 150_000


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


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build (or read) a schedule, validate it, simulate it under a cost model and "
        "show the timeline. --ranks is the pipeline depth p; with --chunks v each rank "
        "holds v chunks and the model is cut into p*v stages."
    )
    parser.add_argument(
        "--schedule",
        metavar="NAME_OR_FILE",
        help="a registered generator (see `zeropipe schedules`; default: zbv if registered, "
        "else 1f1b), 'auto' (search under --costs and --memory-limit; --chunks caps the "
        "chunks per rank, default 2) or a schedule file: .json (zeropipe JSON), .csv "
        "(torch.distributed.pipelining CSV), anything else the zeropipe text form",
    )
    parser.add_argument(
        "--ranks",
        type=int_at_least(1),
        metavar="P",
        help=f"pipeline ranks p, the pipeline's depth (default {_DEFAULT_RANKS}); "
        "the model is cut into p*v stages with --chunks v",
    )
    parser.add_argument(
        "--microbatches",
        type=int_at_least(1),
        metavar="M",
        help=f"microbatches per step (default {_DEFAULT_MICROBATCHES})",
    )
    parser.add_argument(
        "--chunks",
        type=int_at_least(1),
        metavar="V",
        help="chunks (stages) per rank (default: the generator's)",
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
        type=positive_float,
        metavar="X",
        help="fail unless every rank's peak memory fits X (unit: microbatches of one "
        "rank's activations, or the cost file's unit); with --schedule auto, the limit "
        "searched under (default: 1F1B's peak)",
    )
    parser.add_argument(
        "--lower",
        action="store_true",
        help="insert SEND/RECV actions before simulating (done anyway when the costs "
        "price posts, post > 0, as the runtime runs them)",
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
        type=int_at_least(10),
        metavar="COLUMNS",
        help="columns of the time axis in the grid (default: fit the terminal)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="build a schedule even when its size would take more than about half a minute "
        f"(more than {SIMULATE_LIMIT:,} actions; with auto, {AUTO_LIMIT:,})",
    )


def _run_simulate(args: argparse.Namespace) -> int:
    """Validate and simulate a schedule; print its timeline, or write a PNG / Chrome trace."""
    explanation = None
    if not args.force:
        _refuse_too_big(args)
    if _is_auto(args.schedule):
        schedule, costs, explanation = _search(args)
    else:
        schedule = _load_schedule(args)
        costs = _load_costs(args.costs, schedule)
        _check_cost_stages(args, costs, schedule)
    if args.lower:
        schedule = lower(schedule)
    graph = validate(schedule, memory_limit=args.memory_limit, costs=costs)
    timeline = simulate(schedule, costs, graph=graph)
    written: dict[str, str] = {}
    if args.plot:
        written["plot"] = str(render.render_png(timeline, args.plot))
    if args.trace:
        written["trace"] = str(render.write_chrome_trace(timeline, args.trace))
    if args.json:
        out: dict[str, Any] = dict(timeline.summary())
        out["chunks"] = schedule.chunks_per_rank
        out["lowered"] = timeline.schedule.is_lowered
        out["costs"] = args.costs
        out["memory_limit"] = args.memory_limit
        if explanation is not None:
            out["explanation"] = explanation
        out["files"] = written
        if args.show:
            out["text"] = timeline.schedule.to_text()
        print(json.dumps(out))
        return 0
    if explanation is not None:
        print(explanation)
    if args.show:
        print(timeline.schedule.to_text())
    width = args.width or max(40, shutil.get_terminal_size((110, 24)).columns - 10)
    print(render.render_text(timeline, width=width))
    # As many ranks as the grid drew: a line of ten thousand numbers helps no one.
    shown = timeline.peak_memory[: render.MAX_RANKS]
    peaks = ", ".join(f"{p:.4g}" for p in shown)
    hidden = len(timeline.peak_memory) - len(shown)
    if hidden > 0:
        peaks += f", ... {hidden:,} more (highest of all: {max(timeline.peak_memory):.4g})"
    print(f"peak memory per rank (unit: {timeline.memory_unit}): {peaks}")
    for what, path in written.items():
        print(f"wrote {what}: {path}")
    return 0


def simulate_actions(name: str, ranks: int, microbatches: int, chunks: int | None) -> int:
    """About how many actions ``--schedule NAME`` builds, before building it: F, I and W per
    stage and microbatch (a B schedule has two); for auto, its largest candidate's (chunks
    up to ``chunks``, default 2)."""
    return 3 * ranks * _chunks(name, chunks) * microbatches


def _chunks(name: str, chunks: int | None) -> int:
    gen = GENERATORS.get(name)
    return chunks or (gen.default_chunks if gen is not None else 2)  # auto: up to 2


def _refuse_too_big(args: argparse.Namespace) -> None:
    """A named or auto schedule whose size would run for more than about half a minute is
    refused before anything is built; a schedule file is as big as it is."""
    name = args.schedule or _default_schedule()
    auto = _is_auto(name)
    if not auto and (name not in GENERATORS or Path(name).is_file()):
        return
    ranks = args.ranks or _DEFAULT_RANKS
    microbatches = args.microbatches or _DEFAULT_MICROBATCHES
    refuse_too_big(
        simulate_actions(name, ranks, microbatches, args.chunks),
        AUTO_LIMIT if auto else SIMULATE_LIMIT,
        rate=AUTO_RATE if auto else ACTIONS_PER_SECOND,
        action_bytes=AUTO_BYTES if auto else ACTION_BYTES,
        what=f"--schedule {name} on --ranks {ranks} x {_chunks(name, args.chunks)} chunk(s) x "
        f"--microbatches "
        f"{microbatches}" + (" (its largest candidate)" if auto else ""),
        fix="give fewer --ranks or --microbatches",
    )


def _check_cost_stages(args: argparse.Namespace, costs: CostModel, schedule: Schedule) -> None:
    """A cost file made for another stage count fails naming the flags that would fit it
    (zbv holds two stages per rank: a 2-stage file is zbv on one rank)."""
    have, want = len(costs.stages), schedule.num_stages
    if not args.costs or not Path(args.costs).is_file() or have == want:
        return
    ranks, chunks = schedule.num_ranks, schedule.chunks_per_rank
    name = args.schedule or _default_schedule()
    fixes = []
    if name in GENERATORS and not Path(name).is_file():
        gen = GENERATORS[name]
        if have % chunks == 0:
            fixes.append(f"give --ranks {have // chunks} ({name}: {chunks} chunk(s) per rank)")
        if gen.takes_chunks and have % ranks == 0:
            fixes.append(f"give --chunks {have // ranks}")
        if chunks > 1 and not gen.takes_chunks:
            fixes.append(f"--schedule 1f1b --ranks {have} (one stage per rank)")
        where = f"--schedule {name} on {ranks} rank(s)"
    else:
        where = str(name)
    fixes.append(f"profile {want} stages: zeropipe profile --stages {want} --out FILE")
    raise ZeropipeError(
        f"cost file {args.costs} has {have} stage(s) but {where} has {want} ({chunks} "
        f"chunk(s) per rank; stages = ranks x chunks): {'; or '.join(fixes)}"
    )


def _is_auto(name: str | None) -> bool:
    return name == "auto" and not Path(name).is_file()


def _search(args: argparse.Namespace) -> tuple[Schedule, CostModel, str]:
    """``--schedule auto``: search under the given costs and memory limit."""
    from zeropipe.core.schedules.auto import search  # registers "auto"; loaded only when asked for

    ranks = args.ranks or _DEFAULT_RANKS
    path = Path(args.costs)
    if args.costs and path.is_file():
        costs = _load_costs(args.costs, None)
    else:
        costs = CostModel.parse(args.costs, ranks)  # one rank's worth per stage
    # Without a limit: no more memory than 1F1B would hold under the same costs.
    limit = args.memory_limit if args.memory_limit is not None else "1f1b"
    result = search(
        costs, ranks, args.microbatches or _DEFAULT_MICROBATCHES, limit, max_chunks=args.chunks or 2
    )
    return result.schedule, result.costs, result.explanation


def _load_schedule(args: argparse.Namespace) -> Schedule:
    name = args.schedule or _default_schedule()
    path = Path(name)
    if path.is_dir() and name not in GENERATORS:  # a folder named like a generator is no file
        raise ZeropipeError(
            f"--schedule {name} is a directory; give a schedule file ({_SCHEDULE_FORMS}) "
            f"or a generator name ({', '.join(sorted(GENERATORS))})"
        )
    if path.is_file():
        schedule = _read_schedule_file(path, args.microbatches)
        given = {
            "--ranks": (args.ranks, schedule.num_ranks, "rank(s)"),
            "--microbatches": (args.microbatches, schedule.microbatches, "microbatch(es)"),
            "--chunks": (args.chunks, schedule.chunks_per_rank, "chunk(s) per rank"),
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
        args.ranks or _DEFAULT_RANKS,
        args.microbatches or _DEFAULT_MICROBATCHES,
        args.chunks,
    )


_SCHEDULE_FORMS = "zeropipe's text form, JSON (.json) or torch's CSV (.csv)"


def _read_schedule_file(path: Path, microbatches: int | None) -> Schedule:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        # Say so in one line: the decoder's own message is long and names no fix.
        raise ZeropipeError(
            f"schedule file {path} is not text (byte {exc.start} is not UTF-8); give a "
            f"schedule in {_SCHEDULE_FORMS}"
        ) from None
    except OSError as exc:
        raise ZeropipeError(f"cannot read schedule file {path}: {exc.strerror or exc}") from None
    if "\0" in text:  # UTF-8 decodes NUL bytes, but no schedule form has them
        raise ZeropipeError(
            f"schedule file {path} is not text (it holds NUL bytes); give a schedule in "
            f"{_SCHEDULE_FORMS}"
        )
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


def _load_costs(spec: str, schedule: Schedule | None) -> CostModel:
    path = Path(spec)
    if spec and path.is_file():
        try:
            return CostModel.from_json(path.read_text())
        except ScheduleError as exc:
            raise ScheduleError(f"cost file {path}: {exc}", rule=exc.rule) from exc
        except UnicodeDecodeError as exc:
            raise ZeropipeError(f"cannot read cost file {path}: {exc}") from exc
    assert schedule is not None  # only a cost file is read without a schedule
    return CostModel.parse(spec, schedule.num_stages, schedule.chunks_per_rank)


# -- zeropipe profile -------------------------------------------------------------------
def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps import profile_cli  # torch is imported when the command runs

    profile_cli.add_arguments(parser)


def _run_profile(args: argparse.Namespace) -> int:
    """Profile a reference model's stages; print the costs, or write them as JSON."""
    from zeropipe.apps import profile_cli

    return profile_cli.run_cli(args)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps import bench  # imports torch's pipelining: only when asked

    bench.add_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    """Benchmark zeropipe against torch.distributed.pipelining, side by side."""
    from zeropipe.apps import bench

    return bench.run_cli(args)


# -- zeropipe train ----------------------------------------------------------------------
def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps.train import config  # imports torch: only for this command

    config.add_arguments(parser)


def _run_train(args: argparse.Namespace) -> int:
    """Train a small GPT across pipeline ranks (the built-in demo on defaults)."""
    from zeropipe.apps.train import loop

    return loop.run_cli(args)


# -- zeropipe export ----------------------------------------------------------------------
def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps import hf_folder  # imports torch: only for this command

    hf_folder.add_export_arguments(parser)


def _run_export(args: argparse.Namespace) -> int:
    """Write a checkpoint's model as a Hugging Face folder (or one safetensors file)."""
    from zeropipe.apps import hf_folder

    return hf_folder.run_export(args)


# -- zeropipe tokenizer -----------------------------------------------------------------
def _add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps.data import tokenizer  # no torch: the command runs without it

    tokenizer.add_tokenizer_arguments(parser)


def _run_tokenizer(args: argparse.Namespace) -> int:
    """Train a byte-level BPE tokenizer on text, JSON lines or parquet files."""
    from zeropipe.apps.data import tokenizer

    return tokenizer.run_tokenizer(args)


# -- zeropipe plan -----------------------------------------------------------------------
def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from zeropipe.apps import plan_cli  # no torch: specs, search and simulation only

    plan_cli.add_arguments(parser)


def _run_plan(args: argparse.Namespace) -> int:
    """Rank pp x dp, microbatch size, schedule and memory plan for a model on a cluster."""
    from zeropipe.apps import plan_cli

    return plan_cli.run_cli(args)


# -- the table and the entry point ------------------------------------------------------
AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

#: name -> (add_arguments, run); the first docstring line of ``run`` is the help.  A
#: command's arguments are added only when it is the one run, so ``schedules``,
#: ``simulate`` and ``plan`` never import torch.
COMMANDS: dict[str, tuple[AddArguments, Run]] = {
    "schedules": (_add_schedules_arguments, _run_schedules),
    "simulate": (_add_simulate_arguments, _run_simulate),
    "plan": (_add_plan_arguments, _run_plan),
    "profile": (_add_profile_arguments, _run_profile),
    "train": (_add_train_arguments, _run_train),
    "bench": (_add_bench_arguments, _run_bench),
    "export": (_add_export_arguments, _run_export),
    "tokenizer": (_add_tokenizer_arguments, _run_tokenizer),
}


def _version() -> str:
    """The installed distribution's version; from a source tree that is not installed, the
    package's own ``__version__`` (the package is loaded already: this module is in it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_PROG)
    except PackageNotFoundError:
        return str(getattr(sys.modules.get("zeropipe"), "__version__", "unknown"))


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser; ``commands`` limits which subcommands get their arguments (default: all)."""
    wanted = set(COMMANDS) if commands is None else set(commands)
    parser = _Parser(
        prog=_PROG,
        description="Pipeline-parallel schedules as data: list, validate, simulate, draw, train.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add_arguments, run) in COMMANDS.items():
        summary = (run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else ""
        command = sub.add_parser(name, help=summary, description=summary)
        if name in wanted:
            add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zeropipe`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that names a command is the command (options come after it).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser([chosen] if chosen in COMMANDS else [])
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
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        # Only `schedules`, `simulate` and `plan` work without torch.
        print(
            f"{_PROG}: error: '{_PROG} {chosen}' needs PyTorch, which is not installed; "
            f"install it first (pip install torch==2.13.0, or the CPU build: see the README)",
            file=sys.stderr,
        )
        return 2
