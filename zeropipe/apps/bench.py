"""``zeropipe bench``: zeropipe and torch.distributed.pipelining side by side, same work.

Two models (``--model mlp|transformer|both``, default both):

    mlp          --blocks blocks of Linear-GELU-Linear, one layer each
    transformer  token embedding, --tf-blocks pre-LN blocks (attention and MLP: two
                 layers each), LM head (its own weight, not tied), next-token cross-entropy

A cut into stages counts layers (the entries of the model's ``nn.Sequential``), and
the table says how many of them each stage runs.

Both libraries run the same model, the same batch and microbatches, in the
same processes over the same gloo group, with repetitions interleaved
(zeropipe step, torch step, zeropipe step, ...), one intra-op thread per rank,
and the same cut into stages: per schedule, the cut whose simulated step is
shortest under per-layer times measured first (``--cut time``, the default;
``--cut even`` gives every stage the same number of layers).  zeropipe runs with ``Pipeline``'s defaults --
what a user gets -- unless ``--group-w`` overrides one.  Per schedule it
reports the median step time of each (the slowest rank's wall time), their
ratio, and pipeline efficiency = sequential time of the same work in one
process / (ranks x step time), where "the same work" is the same microbatches
run one after another: on a CPU, microbatch-sized matrix products are slower
than whole-batch ones, a cost of microbatching that no schedule can remove, so
the whole-batch time is printed beside it but not used.  ``--runs N`` repeats
the whole comparison in N fresh launches and summarises each schedule's ratio
over them: on a shared host, step times move more between launches than
within one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.apps.models.gpt import LAYERS, GPTConfig, gpt, gpt_layers, lm_loss
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.core.errors import ZeropipeError
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import generate
from zeropipe.planning.balance import balance_schedule, even_cut
from zeropipe.planning.plan import layer_costs
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

__all__ = [
    "MODELS",
    "BenchConfig",
    "Workload",
    "add_arguments",
    "default_group_w",
    "format_spread",
    "format_table",
    "run_bench",
    "run_cli",
    "torch_step",
    "workload",
    "zeropipe_step",
]

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


MODELS = ("mlp", "transformer")


@dataclass
class BenchConfig:
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    models: tuple[str, ...] = MODELS
    ranks: int = 2
    # mlp
    blocks: int = 8
    width: int = 512
    hidden: int = 2048
    batch: int = 64
    # transformer (batch in sequences of ``seq`` tokens)
    tf_blocks: int = 6  # attention + MLP: two layers each
    d_model: int = 256
    heads: int = 4
    seq: int = 64
    vocab: int = 1024
    tf_batch: int = 16
    microbatches: int = 8
    reps: int = 10
    warmup: int = 3
    group_w: int | None = None  # None: build_schedule's default, what a user gets
    cut: str = "time"  # "time": each schedule's cut balanced by measured time; "even": by count
    timeout: float = 600.0
    costs_out: str | None = None  # a folder: each model's measured per-layer costs, as JSON


def default_group_w() -> int:
    """``build_schedule``'s own default, which the bench runs unless ``--group-w`` is given."""
    default = inspect.signature(build_schedule).parameters["group_w"].default
    return int(default)


@dataclass(frozen=True)
class Workload:
    """One model of the comparison: how to build it, its batch, its loss, its name."""

    name: str
    title: str
    build: Callable[[], nn.Sequential]
    inputs: Tensor
    targets: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batch: int


def workload(model: str, cfg: BenchConfig) -> Workload:
    """The named model at ``cfg``'s sizes, with a batch seeded the same on every rank."""
    g = torch.Generator().manual_seed(0)
    if model == "mlp":
        return Workload(
            "mlp",
            f"{cfg.blocks} x Linear({cfg.width},{cfg.hidden})-GELU-Linear({cfg.hidden},{cfg.width}), "
            f"batch {cfg.batch}",
            lambda: mlp_blocks(cfg.blocks, cfg.width, cfg.hidden),
            torch.randn(cfg.batch, cfg.width, generator=g),
            torch.randn(cfg.batch, cfg.width, generator=g),
            F.mse_loss,
            cfg.batch,
        )
    gcfg = GPTConfig(
        vocab=cfg.vocab,
        seq=cfg.seq,
        width=cfg.d_model,
        heads=cfg.heads,
        layers=cfg.tf_blocks,
        dropout=0.0,
        tied=False,
    )
    tokens = torch.randint(cfg.vocab, (cfg.tf_batch, cfg.seq + 1), generator=g)
    return Workload(
        "transformer",
        f"transformer: embedding, {cfg.tf_blocks} pre-LN blocks (width {cfg.d_model}, {cfg.heads} "
        f"heads), LM head ({cfg.vocab} tokens), batch {cfg.tf_batch} x {cfg.seq} tokens",
        lambda: gpt(gcfg),
        tokens[:, :-1].contiguous(),
        tokens[:, 1:].contiguous(),
        lm_loss,
        cfg.tf_batch,
    )


def _layers(cfg: BenchConfig, model: str) -> int:
    # The transformer's nn.Sequential: embedding, attention and MLP halves of each block, head.
    return cfg.blocks if model == "mlp" else gpt_layers(cfg.tf_blocks)


def _layers_text(cfg: BenchConfig, model: str) -> str:
    """The model's layers, counted and named: what the numbers of a cut count."""
    if model == "mlp":
        return f"{_layers(cfg, model)} layers (one per block)"
    blocks = f"{cfg.tf_blocks} block{'s' * (cfg.tf_blocks != 1)}"
    return f"{_layers(cfg, model)} layers ({blocks}; {LAYERS})"


def _check(cfg: BenchConfig) -> None:
    """Refuse a configuration the benchmark cannot run, before any process starts."""
    if not cfg.schedules:
        raise ZeropipeError("--schedules is empty; name at least one schedule")
    if not cfg.models or any(m not in MODELS for m in cfg.models):
        raise ZeropipeError(f"--model must be one of {', '.join(MODELS)} or both")
    for flag, value, least in (
        ("--ranks", cfg.ranks, 2),
        ("--blocks", cfg.blocks, 1),
        ("--width", cfg.width, 1),
        ("--hidden", cfg.hidden, 1),
        ("--batch", cfg.batch, 1),
        ("--tf-blocks", cfg.tf_blocks, 1),
        ("--d-model", cfg.d_model, 1),
        ("--heads", cfg.heads, 1),
        ("--seq", cfg.seq, 1),
        ("--vocab", cfg.vocab, 2),
        ("--tf-batch", cfg.tf_batch, 1),
        ("--microbatches", cfg.microbatches, 1),
        ("--reps", cfg.reps, 1),
        ("--warmup", cfg.warmup, 0),
        ("--group-w", 1 if cfg.group_w is None else cfg.group_w, 1),
    ):
        if value < least:
            raise ZeropipeError(f"{flag} must be at least {least}, got {value}")
    if "transformer" in cfg.models and cfg.d_model % cfg.heads:
        raise ZeropipeError(f"--d-model {cfg.d_model} must be a multiple of --heads {cfg.heads}")
    for flag, batch, model in (
        ("--batch", cfg.batch, "mlp"),
        ("--tf-batch", cfg.tf_batch, "transformer"),
    ):
        if model in cfg.models and batch < cfg.microbatches:
            raise ZeropipeError(
                f"{flag} {batch} cannot be split into {cfg.microbatches} microbatches; "
                f"give {flag} >= --microbatches"
            )


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    """One launch of ``cfg.ranks`` processes; returns one row per model and schedule."""
    _check(cfg)
    for name in cfg.schedules:
        if name not in TORCH_SCHEDULES:
            raise ZeropipeError(
                f"no torch counterpart for {name!r}; compare one of {', '.join(TORCH_SCHEDULES)}"
            )
        chunks = generate(name, cfg.ranks, cfg.microbatches).num_stages
        if "mlp" in cfg.models and cfg.blocks < chunks:
            raise ZeropipeError(
                f"{name} on {cfg.ranks} ranks needs {chunks} stages; give --blocks >= {chunks}"
            )
        if "transformer" in cfg.models and _layers(cfg, "transformer") < chunks:
            raise ZeropipeError(
                f"{name} on {cfg.ranks} ranks needs {chunks} stages; the transformer has "
                f"{_layers_text(cfg, 'transformer')}; give more --tf-blocks"
            )
    results: list[list[dict[str, Any]]] = launch(
        _rank_main, cfg.ranks, cfg, timeout=cfg.timeout, threads=1
    )
    return results[0]


def _rank_main(rank: int, world: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    rows = []
    group_w = default_group_w() if cfg.group_w is None else cfg.group_w
    for model in cfg.models:
        work = workload(model, cfg)
        sequential, whole_batch = _sequential_time(rank, cfg, work)
        cuts = _cuts(rank, world, cfg, work, group_w)
        for name in cfg.schedules:
            ours = zeropipe_step(name, world, cfg, work, cuts[name])
            theirs = torch_step(name, rank, world, cfg, work, cuts[name])
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
                    "model": model,
                    "schedule": name,
                    "ranks": world,
                    "microbatches": cfg.microbatches,
                    "group_w": group_w,
                    "cut": cuts[name],
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


def _sequential_time(rank: int, cfg: BenchConfig, work: Workload) -> tuple[float, float]:
    """Median forward+backward time in one process: (the same microbatches, the whole batch).

    The first is the same work the pipelines do -- the same microbatch-sized
    matrix products -- and is what efficiency is measured against; the second
    shows what microbatching itself costs on this machine.
    """
    value = torch.zeros(2, dtype=torch.float64)
    x, y = work.inputs, work.targets
    dist.barrier()
    if rank == 0:  # the other ranks wait at the broadcast, leaving the cores alone
        model = work.build()
        for slot, parts in enumerate((cfg.microbatches, 1)):
            times = []
            for k in range(cfg.warmup + cfg.reps):
                t0 = time.perf_counter()
                for xi, yi in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
                    (work.loss_fn(model(xi), yi) * (len(xi) / len(x))).backward()
                if k >= cfg.warmup:
                    times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            value[slot] = statistics.median(times)
    dist.broadcast(value, 0)
    return float(value[0].item()), float(value[1].item())


def _cuts(
    rank: int, world: int, cfg: BenchConfig, work: Workload, group_w: int
) -> dict[str, list[int]]:
    """Per schedule, the cut both libraries run: balanced by measured time, or even.

    By time: every rank profiles every layer on one microbatch, and rank 0
    picks, per schedule, the cut whose simulated step is shortest
    (:func:`zeropipe.planning.balance.balance_schedule`); every rank gets rank 0's cuts.
    """
    schedules = {
        name: build_schedule(name, ranks=world, microbatches=cfg.microbatches, group_w=group_w)
        for name in cfg.schedules
    }
    if cfg.cut == "even":
        n = len(work.build())
        return {name: even_cut(n, sch.num_stages) for name, sch in schedules.items()}
    # Every rank profiles (the wire between ranks 0 and 1 is measured too); rank 0's cuts go.
    rows = len(work.inputs) // cfg.microbatches
    layers = layer_costs(
        work.build(),
        work.inputs[:rows],
        target=work.targets[:rows],
        loss_fn=work.loss_fn,
        warmup=cfg.warmup,
        repeat=max(cfg.reps, 5),
    )
    box: list[object] = [None]
    if rank == 0:
        box[0] = {name: balance_schedule(layers, sch) for name, sch in schedules.items()}
        if cfg.costs_out is not None:  # what `zeropipe plan --costs` ranks the schedules by
            out = Path(cfg.costs_out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{work.name}.json").write_text(layers.to_json())
    dist.broadcast_object_list(box, 0)
    cuts = box[0]
    assert isinstance(cuts, dict)
    return cuts


def zeropipe_step(
    name: str, world: int, cfg: BenchConfig, work: Workload, cut: list[int]
) -> Callable[[], None]:
    """One step of schedule ``name`` by zeropipe's ``Pipeline`` on this process's ranks of
    ``world``, the model cut as ``cut``; the gradients cleared after it."""
    # Every setting the comparison does not fix is Pipeline's default.
    group_w = default_group_w() if cfg.group_w is None else cfg.group_w
    pipe = Pipeline(
        work.build(),
        build_schedule(name, ranks=world, microbatches=cfg.microbatches, group_w=group_w),
        loss_fn=work.loss_fn,
        balance=cut,
    )
    params = pipe.parameters()
    x, y = work.inputs, work.targets

    def step() -> None:
        pipe.step(x, y)
        for p in params:
            p.grad = None

    return step


def torch_step(
    name: str, rank: int, world: int, cfg: BenchConfig, work: Workload, cut: list[int]
) -> Callable[[], None]:
    """The same step by torch.distributed.pipelining's schedule for ``name`` on ``rank``."""
    from torch.distributed import pipelining

    schedule = generate(name, world, cfg.microbatches)  # same placement as zeropipe's
    num_stages = schedule.num_stages
    layers = list(work.build().children())
    starts = [sum(cut[:s]) for s in range(num_stages)]
    mine = schedule.stages_of(rank)
    stages = [
        pipelining.PipelineStage(
            nn.Sequential(*layers[starts[s] : starts[s] + cut[s]]),
            s,
            num_stages,
            torch.device("cpu"),
        )
        for s in mine
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    multi = name not in ("gpipe", "1f1b")
    sched = cls(
        stages if multi else stages[0], n_microbatches=cfg.microbatches, loss_fn=work.loss_fn
    )
    first, last = 0 in mine, num_stages - 1 in mine
    params = [p for st in stages for p in st.submod.parameters()]
    x, y = work.inputs, work.targets

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
    """One table per model: step times, their ratio, and each library's efficiency."""
    group_w = default_group_w() if cfg.group_w is None else cfg.group_w
    setting = "Pipeline's defaults" if cfg.group_w is None else f"--group-w {cfg.group_w}"
    how = (
        f"each B split into I then W, each stage's W gathered in runs of {group_w} (group_w; "
        "the F/B/I order is torch's)"
        if group_w > 1
        else "the schedules exactly as torch's (group_w 1)"
    )
    head = (
        f"zeropipe vs torch.distributed.pipelining: {cfg.microbatches} microbatches, {cfg.ranks} "
        f"ranks over gloo, 1 intra-op thread per rank, median of {cfg.reps} interleaved reps\n"
        f"zeropipe runs {setting}: {how}\n"
        + (
            "both libraries run the same cut into stages, per schedule the one whose simulated "
            "step is shortest under per-layer times measured first (--cut time)"
            if cfg.cut == "time"
            else "both libraries run the same cut into stages, the same number of layers each "
            "(--cut even, what Pipeline does with an nn.Sequential and no balance=)"
        )
    )
    lines = [head]
    for model in cfg.models:
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        lines += [
            "",
            workload(model, cfg).title,
            f"{'schedule':<18}{'zeropipe s':>12}{'torch s':>10}{'ratio':>8}{'eff. zeropipe':>15}"
            f"{'eff. torch':>12}  layers per stage",
        ]
        for r in mine:
            lines.append(
                f"{r['schedule']:<18}{r['zeropipe_step_s']:>12.4f}{r['torch_step_s']:>10.4f}{r['ratio']:>8.2f}"
                f"{r['efficiency']:>15.2f}{r['torch_efficiency']:>12.2f}  {r['cut']}"
            )
        lines.append(f"layers per stage: of the model's {_layers_text(cfg, model)}")
        lines.append(
            f"sequential in one process, the same {cfg.microbatches} microbatches: "
            f"{mine[0]['sequential_s']:.4f} s (the whole batch at once: "
            f"{mine[0]['sequential_whole_batch_s']:.4f} s); efficiency = sequential / (ranks x step time)"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument(
        "--schedules", default=",".join(d.schedules), help="comma list of schedules to compare"
    )
    parser.add_argument(
        "--model",
        choices=[*MODELS, "both"],
        default="both",
        help="mlp (Linear-GELU-Linear blocks), transformer (embedding, pre-LN attention + MLP "
        "blocks, LM head, cross-entropy) or both",
    )
    parser.add_argument(
        "--ranks", type=int, default=d.ranks, help=f"pipeline ranks = processes (default {d.ranks})"
    )
    parser.add_argument("--blocks", type=int, default=d.blocks, help="mlp: blocks, one layer each")
    parser.add_argument("--width", type=int, default=d.width, help="mlp: block width")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="mlp: hidden width")
    parser.add_argument("--batch", type=int, default=d.batch, help="mlp: rows per batch")
    parser.add_argument(
        "--tf-blocks",
        type=int,
        default=d.tf_blocks,
        help="transformer: blocks, each two layers (attention, MLP)",
    )
    parser.add_argument("--d-model", type=int, default=d.d_model, help="transformer: width")
    parser.add_argument("--heads", type=int, default=d.heads, help="transformer: attention heads")
    parser.add_argument("--seq", type=int, default=d.seq, help="transformer: tokens per sequence")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="transformer: vocabulary")
    parser.add_argument(
        "--tf-batch", type=int, default=d.tf_batch, help="transformer: sequences per batch"
    )
    parser.add_argument("--microbatches", type=int, default=d.microbatches)
    parser.add_argument("--reps", type=int, default=d.reps)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument(
        "--group-w",
        type=int,
        default=None,
        help="zeropipe: split B into I + W and gather each stage's W in runs of this many "
        f"(1: the schedule as given; default: build_schedule's, {default_group_w()})",
    )
    parser.add_argument(
        "--cut",
        choices=("time", "even"),
        default=d.cut,
        help="how both libraries cut the model into stages: time (per schedule, the cut with "
        "the shortest simulated step under measured per-layer times) or even (the same number "
        "of layers per stage)",
    )
    parser.add_argument(
        "--costs-out",
        metavar="DIR",
        help="write each model's measured per-layer costs (the ones the time cut uses) to "
        "DIR/<model>.json, for `zeropipe plan --costs`; needs --cut time",
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
        models=MODELS if args.model == "both" else (args.model,),
        ranks=args.ranks,
        blocks=args.blocks,
        width=args.width,
        hidden=args.hidden,
        batch=args.batch,
        tf_blocks=args.tf_blocks,
        d_model=args.d_model,
        heads=args.heads,
        seq=args.seq,
        vocab=args.vocab,
        tf_batch=args.tf_batch,
        microbatches=args.microbatches,
        reps=args.reps,
        warmup=args.warmup,
        group_w=args.group_w,
        cut=args.cut,
        costs_out=args.costs_out,
    )
    if args.costs_out is not None and args.cut != "time":
        raise ZeropipeError("--costs-out writes the costs the time cut measures: give --cut time")
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
    """Each model's and schedule's zeropipe / torch ratio in every run, and their median."""
    lines = [
        f"zeropipe / torch step time over {len(runs)} runs, each a fresh launch:",
        f"{'schedule':<30}{'per run':<{7 * len(runs) + 2}}{'median':>6}",
    ]
    for k, row in enumerate(runs[0]):
        ratios = [rows[k]["ratio"] for rows in runs]
        each = " ".join(f"{r:6.2f}" for r in ratios)
        label = f"{row['model']} {row['schedule']}"
        lines.append(f"{label:<30}{each:<{7 * len(runs) + 2}}{statistics.median(ratios):>6.2f}")
    return "\n".join(lines)
