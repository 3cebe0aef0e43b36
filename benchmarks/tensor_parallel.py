"""Benchmark: pipeline x tensor parallelism (pp 2 x tp 2), zeropipe beside torch.distributed.pipelining.

Four gloo processes (``zeropipe.runtime.launch.launch``, one intra-op thread each) form
the mesh ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))``.  Every process
builds the whole model and makes it tensor-parallel over ``mesh["tp"]`` (torch's
``parallelize_module``); then the same cut into stages (even: the same number of layers
each) runs under

    zeropipe  ``Pipeline(model, schedule, loss_fn, microbatches=m, balance=cut, mesh=mesh)``,
              Pipeline's defaults otherwise (what a user gets)
    torch     ``PipelineStage`` on the very stage modules of this pp rank (group: a fresh
              group of the "pp" sub-mesh's ranks, see below) under torch's schedule of the
              same family:
              gpipe ScheduleGPipe, 1f1b Schedule1F1B, zbv ScheduleZBVZeroBubble,
              interleaved-zb ScheduleInterleavedZeroBubble (same stage placement)

Two models:

    mlp          blocks of Linear-GELU-Linear, each block's up projection ColwiseParallel
                 and its down projection RowwiseParallel (one all-reduce per block forward)
    transformer  zeropipe.apps.models.gpt with tied=False, made tensor-parallel by
                 parallelize_gpt (Megatron's layout: q, k, v, up by columns; proj, down by rows)

Exactness first: per model and schedule, one step of each library on float64 copies must give
the loss and every gradient (``DTensor.full_tensor()``) of the plain, unparallel model run on
the whole batch within 1e-10; the script prints "exact: yes/no" per library.  Then, on
float32, interleaved repetitions (zeropipe step, torch step, ...): each step's time is the
slowest rank's wall time (a barrier, the step, a MAX all-reduce of the elapsed time); the
table gives each library's median and the ratio zeropipe / torch.

Every pair runs; a library that raises is reported, not fatal.  Each library's part of a pair
(building it, the exactness step, each timed step) runs inside a ``try`` on every rank, and
the ranks then agree, by a collective every rank reaches, whether any of them failed and why
(the earliest failure, by wall clock, is the cause: the ranks it leaves waiting fail later).
A library that failed reads "fails" in that pair's row, on every rank alike, with its error's
first line beneath the table (and its cause's, where that line only introduces it); it is not
run again for the pair, and the other library is timed alone (ratio n/a).  On torch 2.13
that is torch on the MLP under zbv and interleaved-zb: the stage output is a RowwiseParallel
output (an ``AsyncCollectiveTensor``, a view), and ``stage_backward_input`` raises "Can't
detach views in-place".  The transformer's stage outputs are residual sums, plain tensors.

Why a failure cannot hang the other ranks:

    torch     one pp rank raises in its backward; its pp peer is then left waiting in a
              point-to-point receive that will never be matched, which no collective can
              interrupt.  So every torch build gets fresh pp groups (the "pp" sub-mesh's
              ranks, ``new_subgroups_by_enumeration``) whose timeout is ``p2p_timeout``
              (``--p2p-timeout``, 30 s; far above any wait of a working step): the waiting
              peer fails after that long, everyone reaches the agreement, and the broken
              group, pending operations and all, is never used again.  Tried on torch 2.13:
              the pairs after a failed one run and are exact; with the mesh's own pp group
              the waiting ranks would sit out the launch's timeout instead.  A torch failure
              costs up to ``p2p_timeout`` per failed pair.  Both tp ranks of a pp rank run
              the same stage on their halves, so they fail alike and the tp group's
              collectives stay matched; a failure on one tp rank alone would leave its
              partner in a tp collective until the launch's timeout, which ends the run.
    zeropipe  a rank that fails in ``Pipeline.step`` writes why to the store, and its peers'
              waits fail at once (``zeropipe.runtime.transport.failures``).

The script exits 1 if zeropipe fails or is not exact on any pair, or if torch is not exact
where it ran: zeropipe must run every pair, and a wrong result from either would make the
comparison meaningless.  A torch failure alone leaves the exit status 0.

With four processes on a machine of fewer cores the ranks are oversubscribed: the step times
measure the work and the waits of both libraries on shared cores, not what four devices would do.

    python benchmarks/tensor_parallel.py [--reps 10] [--warmup 2] [--microbatches 4] [--json]
    python benchmarks/tensor_parallel.py --quick      # tiny sizes, 2 reps (the test runs this)
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.apps.models.gpt import GPTConfig, gpt, gpt_layers, lm_loss, parallelize_gpt
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.core.schedules import generate
from zeropipe.planning.balance import even_cut
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

PP, TP = 2, 2
TOLERANCE = 1e-10  # float64: the pipelines' sums differ from the plain model's by rounding only
MODELS = ("mlp", "transformer")
# zeropipe generator -> torch.distributed.pipelining schedule class (same stage placement).
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "zbv", "interleaved-zb")


@dataclass(frozen=True)
class Config:
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    models: tuple[str, ...] = MODELS
    microbatches: int = 4
    reps: int = 10
    warmup: int = 2
    # mlp
    blocks: int = 8
    width: int = 256
    hidden: int = 1024
    batch: int = 32
    # transformer (batch in sequences of `seq` tokens)
    tf_blocks: int = 3
    d_model: int = 128
    heads: int = 4
    seq: int = 64
    vocab: int = 512
    tf_batch: int = 8
    timeout: float = 600.0
    p2p_timeout: float = 30.0  # torch's pp groups: how long a peer left waiting waits (seconds)


QUICK = Config(
    reps=2,
    warmup=1,
    blocks=4,
    width=16,
    hidden=32,
    batch=8,
    tf_blocks=1,
    d_model=16,
    heads=2,
    seq=8,
    vocab=32,
    tf_batch=8,
    timeout=300.0,
    p2p_timeout=5.0,  # a tiny step's waits take milliseconds
)


# -- the models -------------------------------------------------------------------------
def _data(model: str, cfg: Config, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The batch, seeded alike on every rank: (inputs, targets)."""
    g = torch.Generator().manual_seed(0)
    if model == "mlp":
        x = torch.randn(cfg.batch, cfg.width, generator=g, dtype=dtype)
        return x, torch.randn(cfg.batch, cfg.width, generator=g, dtype=dtype)
    tokens = torch.randint(cfg.vocab, (cfg.tf_batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss_fn(model: str) -> Callable[[Tensor, Tensor], Tensor]:
    return F.mse_loss if model == "mlp" else lm_loss


def _build(model: str, cfg: Config, dtype: torch.dtype, tp_mesh: Any | None) -> nn.Sequential:
    """The model (seeded: the same weights everywhere), tensor-parallel over ``tp_mesh`` if given."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if model == "mlp":
        net = mlp_blocks(cfg.blocks, cfg.width, cfg.hidden).to(dtype)
        if tp_mesh is not None:
            for block in net:  # Linear(width, hidden), GELU, Linear(hidden, width)
                plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
                parallelize_module(block, tp_mesh, plan)
        return net
    gcfg = GPTConfig(
        vocab=cfg.vocab,
        seq=cfg.seq,
        width=cfg.d_model,
        heads=cfg.heads,
        layers=cfg.tf_blocks,
        dropout=0.0,
        tied=False,  # torch.distributed.pipelining has no parameters tied across stages
    )
    net = gpt(gcfg).to(dtype)
    if tp_mesh is not None:
        parallelize_gpt(net, tp_mesh)
    return net


def _title(model: str, cfg: Config) -> str:
    if model == "mlp":
        return (
            f"mlp: {cfg.blocks} x Linear({cfg.width},{cfg.hidden})-GELU-Linear({cfg.hidden},"
            f"{cfg.width}), up Colwise / down Rowwise, batch {cfg.batch}"
        )
    return (
        f"transformer: gpt (tied=False), {cfg.tf_blocks} blocks, width {cfg.d_model}, "
        f"{cfg.heads} heads, vocab {cfg.vocab}, batch {cfg.tf_batch} x {cfg.seq} tokens, "
        "parallelize_gpt"
    )


def _layers(model: str, cfg: Config) -> int:
    return cfg.blocks if model == "mlp" else gpt_layers(cfg.tf_blocks)


# -- the two libraries' steps -------------------------------------------------------------
@dataclass
class _Run:
    """One library's pipeline on this rank: a step, the parameters it owns, named."""

    step: Callable[[], Tensor | None]  # the loss where this rank has it, else None
    params: list[tuple[str, nn.Parameter]]


def _cut(name: str, model: str, cfg: Config) -> list[int]:
    return even_cut(_layers(model, cfg), generate(name, PP, cfg.microbatches).num_stages)


def _zeropipe(name: str, net: nn.Sequential, work: tuple[str, Config], mesh: Any,
              x: Tensor, y: Tensor) -> _Run:  # fmt: skip
    model, cfg = work
    names = {id(p): n for n, p in net.named_parameters()}
    pipe = Pipeline(
        net,
        name,
        _loss_fn(model),
        microbatches=cfg.microbatches,
        balance=_cut(name, model, cfg),
        mesh=mesh,
    )
    params = [(names[id(p)], p) for p in pipe.parameters()]
    return _Run(lambda: pipe.step(x, y), params)


def _fresh_pp_group(mesh: Any, seconds: float) -> Any:
    """This rank's pp group, new (all ranks call this together), its waits bounded by ``seconds``."""
    columns = [mesh.mesh[:, t].tolist() for t in range(mesh.mesh.shape[1])]  # one per tp rank
    group, _ = dist.new_subgroups_by_enumeration(columns, timeout=timedelta(seconds=seconds))
    return group


def _torch(name: str, net: nn.Sequential, work: tuple[str, Config], mesh: Any,
           x: Tensor, y: Tensor) -> _Run:  # fmt: skip
    from torch.distributed import pipelining

    model, cfg = work
    names = {id(p): n for n, p in net.named_parameters()}
    schedule = generate(name, PP, cfg.microbatches)  # zeropipe's placement: torch's
    num_stages = schedule.num_stages
    cut = _cut(name, model, cfg)
    layers = list(net.children())
    starts = [sum(cut[:s]) for s in range(num_stages)]
    pp_rank = mesh.get_local_rank("pp")
    mine = schedule.stages_of(pp_rank)
    group = _fresh_pp_group(mesh, cfg.p2p_timeout)  # see the module's docstring
    stages = [
        pipelining.PipelineStage(
            nn.Sequential(*layers[starts[s] : starts[s] + cut[s]]),
            s,
            num_stages,
            torch.device("cpu"),
            group=group,
        )
        for s in mine
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    single = name in ("gpipe", "1f1b")
    sched = cls(
        stages[0] if single else stages,
        n_microbatches=cfg.microbatches,
        loss_fn=_loss_fn(model),
    )
    first, last = 0 in mine, num_stages - 1 in mine
    params = [(names[id(p)], p) for st in stages for p in st.submod.parameters()]

    def step() -> Tensor | None:
        args = (x,) if first else ()
        if not last:
            sched.step(*args)
            return None
        losses: list[Tensor] = []
        sched.step(*args, target=y, losses=losses)
        return torch.stack(losses).mean()  # equal microbatches: the batch's mean

    return _Run(step, params)


LIBRARIES: dict[str, Callable[..., _Run]] = {"zeropipe": _zeropipe, "torch": _torch}


# -- exactness ----------------------------------------------------------------------------
def _full(grad: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    # full_tensor() is a collective over "tp": both tp ranks of a pp rank own the same
    # parameters in the same order, so they call it alike.
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _reference(model: str, cfg: Config) -> tuple[float, dict[str, Tensor]]:
    """Loss and gradients of the plain model (no pipeline, no TP) on the whole batch, float64."""
    net = _build(model, cfg, torch.float64, None)
    x, y = _data(model, cfg, torch.float64)
    loss = _loss_fn(model)(net(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    return float(loss.item()), grads


# -- failures ----------------------------------------------------------------------------
# A failure on one rank, as that rank saw it: (wall time of the raise, world rank, reason).
_Failure = tuple[float, int, str]


def _reason(exc: BaseException) -> str:
    """The error's type and first line (its first sentence), and its cause's where that line
    only introduces it (torch's "Failed to run stage backward input:" raises from the cause)."""

    def first(e: BaseException) -> str:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        line = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""  # gloo's source location
        return line.split(". ", 1)[0]

    text = f"{type(exc).__name__}: {first(exc)}".rstrip()
    if text.endswith(":") and exc.__cause__ is not None:
        text += f" {first(exc.__cause__)}"
    return text


def _attempt(fn: Callable[[], Any]) -> tuple[Any, _Failure | None]:
    """``fn()``, or None and the failure if it raises (on this rank only: see _agree)."""
    try:
        return fn(), None
    except Exception as exc:
        return None, (time.time(), dist.get_rank(), _reason(exc))


def _agree(failure: _Failure | None, phase: str) -> str | None:
    """Every rank calls this: None if no rank failed, else the first failure's reason, alike
    everywhere (the earliest raise is the cause; peers it left waiting fail later)."""
    everyone: list[_Failure | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    failed = sorted(f for f in everyone if f is not None)
    if not failed:
        return None
    _, rank, reason = failed[0]
    return f"{reason} (world rank {rank}, {phase})"


# -- exactness ----------------------------------------------------------------------------
def _exactness(library: str, name: str, model: str, cfg: Config, mesh: Any,
               ref: tuple[float, dict[str, Tensor]]) -> tuple[float | None, str | None]:  # fmt: skip
    """The worst difference (loss or any gradient) from the plain model over every rank, or
    None and why the library failed."""
    ref_loss, ref_grads = ref

    def local() -> tuple[float, list[str]]:
        net = _build(model, cfg, torch.float64, mesh["tp"])
        x, y = _data(model, cfg, torch.float64)
        run = LIBRARIES[library](name, net, (model, cfg), mesh, x, y)
        loss = run.step()
        worst = 0.0 if loss is None else abs(float(loss.item()) - ref_loss)
        seen = []
        for pname, p in run.params:
            if p.grad is None:
                worst = float("inf")  # a parameter of this rank's stages got no gradient
                continue
            got = _full(p.grad)
            worst = max(worst, float((got - ref_grads[pname]).abs().max().item()))
            seen.append(pname)
        return worst, seen

    result, failure = _attempt(local)
    failed = _agree(failure, "exactness step")
    if failed is not None:
        return None, failed
    worst, seen = result
    # Between them, the ranks must have checked every parameter of the model.
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    covered = {n for names in everyone for n in names or []}
    if covered != set(ref_grads):
        worst = float("inf")
    out = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item()), None


# -- timing -------------------------------------------------------------------------------
def _timed(step: Callable[[], None]) -> tuple[float, str | None]:
    """Wall time of one step on the slowest rank (everyone starts together), or why it failed."""
    dist.barrier()
    t0 = time.perf_counter()
    _, failure = _attempt(step)
    t = torch.tensor([time.perf_counter() - t0, failure is not None], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[1].item():  # some rank failed: all of them know, and agree on why
        return float("nan"), _agree(failure, "timed step")
    return float(t[0].item()), None


def _timing_step(library: str, name: str, model: str, cfg: Config, mesh: Any) -> Callable[[], None]:
    net = _build(model, cfg, torch.float32, mesh["tp"])
    x, y = _data(model, cfg, torch.float32)
    run = LIBRARIES[library](name, net, (model, cfg), mesh, x, y)

    def step() -> None:
        run.step()
        for _, p in run.params:
            p.grad = None

    return step


def pairs(cfg: Config) -> list[tuple[str, str]]:
    """The (model, schedule) pairs this configuration runs: all of them."""
    return [(model, name) for model in cfg.models for name in cfg.schedules]


def _pair(model: str, name: str, cfg: Config, mesh: Any,
          ref: tuple[float, dict[str, Tensor]]) -> dict[str, Any]:  # fmt: skip
    """One row: both libraries' exactness and timing on one pair, each guarded (see the top)."""
    errors: dict[str, float | None] = {}
    failures: dict[str, str | None] = {}
    for lib in ("torch", "zeropipe"):  # torch first: the library expected to fail, if any
        errors[lib], failures[lib] = _exactness(lib, name, model, cfg, mesh, ref)
    steps: dict[str, Callable[[], None]] = {}
    for lib in LIBRARIES:
        if failures[lib] is None:
            step, failure = _attempt(partial(_timing_step, lib, name, model, cfg, mesh))
            failures[lib] = _agree(failure, "building the timed pipeline")
            if failures[lib] is None:
                steps[lib] = step
    times: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
    for k in range(cfg.warmup + cfg.reps):  # interleaved, so drift hits both alike
        for lib in list(steps):
            t, failures[lib] = _timed(steps[lib])
            if failures[lib] is not None:
                del steps[lib]  # not run again for this pair
            elif k >= cfg.warmup:
                times[lib].append(t)
    med = {lib: statistics.median(times[lib]) if lib in steps else None for lib in LIBRARIES}
    row: dict[str, Any] = {
        "model": model,
        "schedule": name,
        "pp": PP,
        "tp": TP,
        "microbatches": cfg.microbatches,
        "reps": cfg.reps,
        "cut": _cut(name, model, cfg),
    }
    for lib in LIBRARIES:
        err = errors[lib]  # None where the exactness step failed
        row[f"{lib}_failure"] = failures[lib]  # None, or the reason, the rank and the phase
        row[f"{lib}_error"] = err
        row[f"{lib}_exact"] = None if err is None else err <= TOLERANCE
        row[f"{lib}_step_s"] = med[lib]  # None unless every timed step ran
    zp, th = row["zeropipe_step_s"], row["torch_step_s"]
    row["ratio"] = None if zp is None or th is None else zp / th
    return row


def _rank_main(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    # A torch schedule that raises logs its whole action table first, on every failing rank;
    # the table's note gives the error, so keep that log out of the output.
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.CRITICAL)
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    rows = []
    for model in cfg.models:
        ref = _reference(model, cfg)
        rows += [_pair(model, name, cfg, mesh, ref) for name in cfg.schedules]
    return rows


def run(cfg: Config) -> list[dict[str, Any]]:
    """One launch of pp x tp = 4 processes; one row per model and schedule (rank 0's)."""
    for name in cfg.schedules:
        if name not in TORCH_SCHEDULES:
            raise SystemExit(f"--schedules: {name!r} has no torch counterpart here; "
                             f"one of {', '.join(TORCH_SCHEDULES)}")  # fmt: skip
    results: list[list[dict[str, Any]]] = launch(
        _rank_main, PP * TP, cfg, timeout=cfg.timeout, threads=1
    )
    return results[0]


# -- output -------------------------------------------------------------------------------
def _yes(exact: bool | None) -> str:
    return "-" if exact is None else "yes" if exact else "NO"


def _secs(row: dict[str, Any], lib: str) -> str:
    return "fails" if row[f"{lib}_failure"] else f"{row[f'{lib}_step_s']:.4f}"


def format_table(rows: list[dict[str, Any]], cfg: Config) -> str:
    lines = [
        f"pp {PP} x tp {TP} over gloo (4 processes, 1 intra-op thread each), "
        f"{cfg.microbatches} microbatches, median of {cfg.reps} interleaved reps "
        "(slowest rank's wall time); the same even cut for both libraries; zeropipe runs "
        "Pipeline's defaults",
        f"exact: one float64 step equals the plain model's loss and gradients within {TOLERANCE:g}",
    ]
    for model in cfg.models:
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        lines += [
            "",
            _title(model, cfg),
            f"{'schedule':<16}{'zeropipe s':>11}{'torch s':>10}{'ratio':>8}"
            f"  {'exact: zeropipe':<17}{'torch':<7}layers per stage",
        ]
        for r in mine:
            ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
            lines.append(
                f"{r['schedule']:<16}{_secs(r, 'zeropipe'):>11}{_secs(r, 'torch'):>10}"
                f"{ratio:>8}  {_yes(r['zeropipe_exact']) + ' ':<17}"
                f"{_yes(r['torch_exact']):<7}{r['cut']}"
            )
        for r in mine:
            for lib in LIBRARIES:
                if r[f"{lib}_failure"]:
                    why = f"{lib} fails on {r['schedule']}: {r[f'{lib}_failure']}"
                    lines += textwrap.wrap(
                        why,
                        96,
                        subsequent_indent="    ",
                        break_on_hyphens=False,
                        break_long_words=False,
                    )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> tuple[Config, bool]:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=None, help=f"timed steps each (default {d.reps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps (default {d.warmup})")
    p.add_argument("--microbatches", type=int, default=d.microbatches)
    p.add_argument("--schedules", default=",".join(d.schedules), help="comma list")
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps (for the test)")
    p.add_argument(
        "--p2p-timeout",
        type=float,
        default=None,
        help="seconds a torch rank waits for a pipeline peer before giving up, which is what "
        f"a torch failure on another rank costs (default {d.p2p_timeout:g}, "
        f"--quick {QUICK.p2p_timeout:g})",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else d
    cfg = replace(
        cfg,
        schedules=tuple(s for s in args.schedules.split(",") if s),
        models=MODELS if args.model == "both" else (args.model,),
        microbatches=args.microbatches,
        reps=cfg.reps if args.reps is None else args.reps,
        warmup=cfg.warmup if args.warmup is None else args.warmup,
        p2p_timeout=cfg.p2p_timeout if args.p2p_timeout is None else args.p2p_timeout,
    )
    if cfg.reps < 1 or cfg.warmup < 0 or cfg.microbatches < 1:
        p.error("--reps and --microbatches must be at least 1, --warmup at least 0")
    if not cfg.p2p_timeout > 0:
        p.error("--p2p-timeout must be positive")
    return cfg, args.json


def problems(rows: list[dict[str, Any]]) -> list[str]:
    """What makes the run fail: zeropipe failing or inexact anywhere, torch inexact where it ran."""
    out = []
    for r in rows:
        pair = f"{r['model']} {r['schedule']}"
        if r["zeropipe_failure"]:
            out.append(f"{pair}: zeropipe fails: {r['zeropipe_failure']}")
        for lib in LIBRARIES:
            if r[f"{lib}_exact"] is False:
                out.append(f"{pair}: {lib} not exact (worst difference {r[f'{lib}_error']:.3g})")
    return out


def main(argv: list[str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run the benchmark; returns (exit status: 1 if :func:`problems` found any, the rows)."""
    cfg, as_json = _parse(argv)
    rows = run(cfg)
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        print(format_table(rows, cfg), flush=True)
    found = problems(rows)
    for what in found:
        print(what, file=sys.stderr)
    return (1 if found else 0), rows


if __name__ == "__main__":
    sys.exit(main()[0])
