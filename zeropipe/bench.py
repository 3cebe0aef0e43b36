"""``zeropipe bench``: zeropipe and torch.distributed.pipelining side by side, same work.

Both libraries run the same model (blocks of Linear-GELU-Linear), the same
batch and microbatches, in the same processes over the same gloo group, with
repetitions interleaved (zeropipe step, torch step, zeropipe step, ...), one
intra-op thread per rank.  Per schedule it reports the median step time of
each (the slowest rank's wall time), their ratio, and pipeline efficiency =
sequential time of the same work in one process / (ranks x step time), where
"the same work" is the same microbatches run one after another: on a CPU,
microbatch-sized matrix products are slower than whole-batch ones, a cost of
microbatching that no schedule can remove, so the whole-batch time is printed
beside it but not used.  ``--runs N`` repeats the whole comparison in N fresh
launches and summarises each schedule's ratio over them: on a shared host, step
times move more between launches than within one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeropipe.errors import ZeropipeError
from zeropipe.models.mlp import mlp_blocks
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.schedules import generate

__all__ = ["BenchConfig", "add_arguments", "format_spread", "format_table", "run_bench", "run_cli"]

# zeropipe generator -> torch.distributed.pipelining schedule class name
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "interleaved-zb")


@dataclass
class BenchConfig:
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    ranks: int = 2
    blocks: int = 8
    width: int = 512
    hidden: int = 2048
    batch: int = 64
    microbatches: int = 8
    reps: int = 10
    warmup: int = 3
    group_w: int = 4  # zeropipe splits B into I + W and runs W of a stage in groups of 4
    timeout: float = 600.0


def _check(cfg: BenchConfig) -> None:
    """Refuse a configuration the benchmark cannot run, before any process starts."""
    if not cfg.schedules:
        raise ZeropipeError("--schedules is empty; name at least one schedule")
    for flag, value, least in (
        ("--ranks", cfg.ranks, 2),
        ("--blocks", cfg.blocks, 1),
        ("--width", cfg.width, 1),
        ("--hidden", cfg.hidden, 1),
        ("--batch", cfg.batch, 1),
        ("--microbatches", cfg.microbatches, 1),
        ("--reps", cfg.reps, 1),
        ("--warmup", cfg.warmup, 0),
        ("--group-w", cfg.group_w, 1),
    ):
        if value < least:
            raise ZeropipeError(f"{flag} must be at least {least}, got {value}")
    if cfg.batch < cfg.microbatches:
        raise ZeropipeError(
            f"--batch {cfg.batch} cannot be split into {cfg.microbatches} microbatches; "
            f"give --batch >= --microbatches"
        )


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    """One launch of ``cfg.ranks`` processes; returns one row per schedule."""
    _check(cfg)
    for name in cfg.schedules:
        if name not in TORCH_SCHEDULES:
            raise ZeropipeError(
                f"no torch counterpart for {name!r}; compare one of {', '.join(TORCH_SCHEDULES)}"
            )
        chunks = generate(name, cfg.ranks, cfg.microbatches).num_stages
        if cfg.blocks % chunks:
            raise ZeropipeError(
                f"{name} on {cfg.ranks} ranks needs {chunks} stages; --blocks {cfg.blocks} does not divide"
            )
    results: list[list[dict[str, Any]]] = launch(
        _rank_main, cfg.ranks, cfg, timeout=cfg.timeout, threads=1
    )
    return results[0]


def _rank_main(rank: int, world: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    y = torch.randn(cfg.batch, cfg.width, generator=g)
    sequential, whole_batch = _sequential_time(rank, cfg, x, y)
    rows = []
    for name in cfg.schedules:
        ours = _zeropipe_step(name, rank, world, cfg, x, y)
        theirs = _torch_step(name, rank, world, cfg, x, y)
        for _ in range(cfg.warmup):
            ours()
            theirs()
        t_ours, t_theirs = [], []
        for _ in range(cfg.reps):  # interleaved, so drift hits both alike
            t_ours.append(_timed(ours))
            t_theirs.append(_timed(theirs))
        zp, th = statistics.median(t_ours), statistics.median(t_theirs)
        rows.append(
            {
                "schedule": name,
                "ranks": world,
                "microbatches": cfg.microbatches,
                "group_w": cfg.group_w,
                "zeropipe_step_s": zp,
                "torch_step_s": th,
                "ratio": zp / th,
                "sequential_s": sequential,
                "sequential_whole_batch_s": whole_batch,
                "efficiency": sequential / (world * zp),
                "torch_efficiency": sequential / (world * th),
            }
        )
    return rows


def _timed(step: Callable[[], None]) -> float:
    """Wall time of one step on the slowest rank (everyone starts together)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sequential_time(
    rank: int, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """Median forward+backward time in one process: (the same microbatches, the whole batch).

    The first is the same work the pipelines do -- the same microbatch-sized
    matrix products -- and is what efficiency is measured against; the second
    shows what microbatching itself costs on this machine.
    """
    value = torch.zeros(2, dtype=torch.float64)
    dist.barrier()
    if rank == 0:  # the other ranks wait at the broadcast, leaving the cores alone
        model = mlp_blocks(cfg.blocks, cfg.width, cfg.hidden)
        for slot, parts in enumerate((cfg.microbatches, 1)):
            times = []
            for k in range(cfg.warmup + cfg.reps):
                t0 = time.perf_counter()
                for xi, yi in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
                    (F.mse_loss(model(xi), yi) * (len(xi) / len(x))).backward()
                if k >= cfg.warmup:
                    times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            value[slot] = statistics.median(times)
    dist.broadcast(value, 0)
    return float(value[0].item()), float(value[1].item())


def _zeropipe_step(
    name: str, rank: int, world: int, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    model = mlp_blocks(cfg.blocks, cfg.width, cfg.hidden)
    pipe = Pipeline(
        model,
        name,
        microbatches=cfg.microbatches,
        loss_fn=F.mse_loss,
        ranks=world,
        executor="distributed",
        group_w=cfg.group_w,
    )
    params = pipe.parameters()

    def step() -> None:
        pipe.step(x, y)
        for p in params:
            p.grad = None

    return step


def _torch_step(
    name: str, rank: int, world: int, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    from torch.distributed import pipelining

    schedule = generate(name, world, cfg.microbatches)  # same placement as zeropipe's
    num_stages = schedule.num_stages
    per_stage = cfg.blocks // num_stages
    blocks = list(mlp_blocks(cfg.blocks, cfg.width, cfg.hidden).children())
    mine = schedule.stages_of(rank)
    stages = [
        pipelining.PipelineStage(
            nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]),
            s,
            num_stages,
            torch.device("cpu"),
        )
        for s in mine
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    multi = name not in ("gpipe", "1f1b")
    sched = cls(stages if multi else stages[0], n_microbatches=cfg.microbatches, loss_fn=F.mse_loss)
    first, last = 0 in mine, num_stages - 1 in mine
    params = [p for st in stages for p in st.submod.parameters()]

    def step() -> None:
        args = (x,) if first else ()
        if last:
            sched.step(*args, target=y, losses=[])
        else:
            sched.step(*args)
        for p in params:
            p.grad = None

    return step


# -- output -----------------------------------------------------------------------
def format_table(rows: list[dict[str, Any]], cfg: BenchConfig) -> str:
    head = (
        f"zeropipe vs torch.distributed.pipelining: {cfg.blocks} x Linear({cfg.width},{cfg.hidden})-GELU-"
        f"Linear({cfg.hidden},{cfg.width}), batch {cfg.batch}, {cfg.microbatches} microbatches, "
        f"{cfg.ranks} ranks over gloo, 1 intra-op thread per rank, median of {cfg.reps} interleaved reps"
    )
    if cfg.group_w > 1:
        head += (
            f"\nzeropipe splits each B into I then W and gathers each stage's W in runs of "
            f"{cfg.group_w} (group_w; the F/B/I order is torch's), "
            "--group-w 1 runs the schedules exactly as torch's"
        )
    lines = [
        head,
        "",
        f"{'schedule':<18}{'zeropipe s':>12}{'torch s':>10}{'ratio':>8}{'eff. zeropipe':>15}{'eff. torch':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r['schedule']:<18}{r['zeropipe_step_s']:>12.4f}{r['torch_step_s']:>10.4f}{r['ratio']:>8.2f}"
            f"{r['efficiency']:>15.2f}{r['torch_efficiency']:>12.2f}"
        )
    if rows:
        lines.append(
            f"\nsequential in one process, the same {cfg.microbatches} microbatches: "
            f"{rows[0]['sequential_s']:.4f} s (the whole batch at once: "
            f"{rows[0]['sequential_whole_batch_s']:.4f} s); efficiency = sequential / (ranks x step time)"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument(
        "--schedules", default=",".join(d.schedules), help="comma list of schedules to compare"
    )
    parser.add_argument("--ranks", type=int, default=d.ranks)
    parser.add_argument("--blocks", type=int, default=d.blocks)
    parser.add_argument("--width", type=int, default=d.width)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--microbatches", type=int, default=d.microbatches)
    parser.add_argument("--reps", type=int, default=d.reps)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument(
        "--group-w",
        type=int,
        default=d.group_w,
        help="zeropipe: split B into I + W and gather each stage's W in runs of this many "
        "(1: the schedule as given)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="launch the whole comparison this many times, each in fresh processes, and "
        "summarise each schedule's ratio over the runs (step times on a shared host move "
        "between launches more than within one)",
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per schedule per run per line"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Benchmark zeropipe against torch.distributed.pipelining, side by side."""
    cfg = BenchConfig(
        schedules=tuple(s for s in args.schedules.split(",") if s),
        ranks=args.ranks,
        blocks=args.blocks,
        width=args.width,
        hidden=args.hidden,
        batch=args.batch,
        microbatches=args.microbatches,
        reps=args.reps,
        warmup=args.warmup,
        group_w=args.group_w,
    )
    if args.runs < 1:
        raise ZeropipeError(f"--runs must be at least 1, got {args.runs}")
    runs: list[list[dict[str, Any]]] = []
    for k in range(args.runs):
        rows = run_bench(cfg)
        for row in rows:
            row["run"] = k
        runs.append(rows)
        if args.json:
            for row in rows:
                print(json.dumps(row), flush=True)
        else:
            if args.runs > 1:
                print(("\n" if k else "") + f"run {k + 1} of {args.runs}:")
            print(format_table(rows, cfg), flush=True)
    if args.runs > 1 and not args.json:
        print("\n" + format_spread(runs))
    return 0


def format_spread(runs: list[list[dict[str, Any]]]) -> str:
    """Each schedule's zeropipe / torch ratio in every run, and their median."""
    lines = [
        f"zeropipe / torch step time over {len(runs)} runs, each a fresh launch:",
        f"{'schedule':<18}{'per run':<{7 * len(runs) + 2}}{'median':>6}",
    ]
    for k, row in enumerate(runs[0]):
        ratios = [rows[k]["ratio"] for rows in runs]
        each = " ".join(f"{r:6.2f}" for r in ratios)
        lines.append(
            f"{row['schedule']:<18}{each:<{7 * len(runs) + 2}}{statistics.median(ratios):>6.2f}"
        )
    return "\n".join(lines)
