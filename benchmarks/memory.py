"""Benchmark: activation memory against step time -- recompute-ahead, torch.utils.checkpoint, offload.

A 2-rank 1F1B pipeline over gloo (``zeropipe.launch``, one process and one
intra-op thread per rank) of ``2 x blocks`` residual MLP blocks
[x + Linear(h, f) -> GELU -> dropout -> Linear(f, h)], float32, run side by
side in one invocation, repetitions interleaved (the variant order rotates)::

    (a) none          1F1B as it is
    (b) torch ckpt    every stage module wrapped in torch.utils.checkpoint (non-reentrant):
                      the recomputation runs inside the backward, after the gradient arrived
    (c) R-ahead fit   zeropipe recompute-ahead: fit_memory's choice (recompute only, costs
                      measured on (a)) for the peak (b) reaches -- by default; --budget asks
                      for a fraction of the natural peak instead.  Each R is its own action,
                      right before its backward, so it runs while the gradient is on its way
    (d) R-ahead all   zeropipe: every (stage, microbatch) recomputed, as (b) does

and prints median step times, their ratio to (a), and per-rank peak bytes of
saved activations (zeropipe's accounting; for (b) the accounting cannot see
inside torch's checkpoint, so its peak is the simulator's for "recompute
everything right before its backward", which is what it does).  The headline
figures are (c)/(a) and (c)/(b) at the same peak memory, and (d)/(b).

With ``--device`` naming an accelerator, it instead runs activation offload on
one device (both ranks in one process): offload with prefetch
(RELOAD --prefetch compute actions ahead) vs without (RELOAD right before the
backward) vs ``torch.autograd.graph.save_on_cpu`` around each stage, with the
allocator's peak.

    python benchmarks/memory.py                          # CPU, 2 ranks over gloo
    python benchmarks/memory.py --microbatches 4 --budget 0.5
    python benchmarks/memory.py --device <accelerator>   # offload comparison on a GPU
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from zeropipe.base.device import is_accelerator, peak_allocated_bytes, reset_peak_bytes
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.ir import COMPUTE_KINDS, Kind, Schedule
from zeropipe.core.passes.fit import checkpoint, fit_memory, offload, smallest_limit
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.runtime.pipeline import Pipeline


class _Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.dropout(F.gelu(self.fc1(x)), self.dropout, self.training))


class _TorchCheckpoint(nn.Module):
    """torch.utils.checkpoint around a whole stage (what a user would do without zeropipe)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        out = torch_checkpoint(self.inner, x, use_reentrant=False)
        assert isinstance(out, Tensor)
        return out


class _SaveOnCpu(nn.Module):
    """torch.autograd.graph.save_on_cpu around a whole stage (torch's activation offload)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            out = self.inner(x)
        assert isinstance(out, Tensor)
        return out


def _stages(cfg: dict[str, Any]) -> list[nn.Module]:
    torch.manual_seed(cfg["seed"])
    return [
        nn.Sequential(
            *(_Block(cfg["hidden"], cfg["ffn"], cfg["dropout"]) for _ in range(cfg["blocks"]))
        )
        for _ in range(2)
    ]


def _batch(cfg: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (cfg["batch"], cfg["seq"], cfg["hidden"])
    return torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)


# --- calibration (one process): per-stage times and bytes, for fit_memory ------------------


def _calibrate(cfg: dict[str, Any], base: Schedule) -> CostModel:
    """Run (a) locally a few times; per stage the median F and B times and the bytes saved."""
    stages = _stages(cfg)
    x, y = _batch(cfg, torch.device("cpu"))
    pipe = Pipeline(stages, base, loss_fn=F.mse_loss, mesh="local")
    times: dict[tuple[int, Kind], list[float]] = {}
    for _ in range(cfg["warmup"] + 3):
        pipe.step(x, y)
        for events in pipe.timeline().events:
            for e in events:
                if e.action.kind in COMPUTE_KINDS:
                    times.setdefault((e.action.stage, e.action.kind), []).append(e.end - e.start)
    costs = pipe.measured_costs()
    stages_cost = []
    for s, sc in enumerate(costs.stages):
        f = statistics.median(times[(s, Kind.F)])
        b = statistics.median(times[(s, Kind.B)])
        # Offload priced out: this is the recompute comparison.
        stages_cost.append(
            StageCost(
                F=f, I=b / 2, W=b / 2, B=b, R=f, OFFLOAD=1e9, RELOAD=1e9, act=sc.act, ckpt=0.0
            )
        )
    return CostModel(tuple(stages_cost), unit="bytes")


# --- the 2-rank run ------------------------------------------------------------------------


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    x, y = _batch(cfg, torch.device("cpu"))
    pipes: dict[str, Pipeline] = {}
    params: dict[str, list[nn.Parameter]] = {}
    for name, text, wrap in cfg["variants"]:
        stages = _stages(cfg)  # same seed: the same weights in every variant
        if wrap:
            stages = [_TorchCheckpoint(m) for m in stages]
        pipes[name] = Pipeline(stages, Schedule.from_text(text), loss_fn=F.mse_loss)
        params[name] = pipes[name].parameters()
    names = list(pipes)
    times: dict[str, list[float]] = {n: [] for n in names}
    actions: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    losses: dict[str, float] = {}
    gc.disable()  # a collection inside one timed step would land on one variant only
    try:
        for rep in range(cfg["warmup"] + cfg["reps"]):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                for p in params[name]:
                    p.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                loss = pipes[name].step(x, y)
                elapsed = time.perf_counter() - t0
                if rep >= cfg["warmup"]:
                    times[name].append(elapsed)
                    for e in pipes[name].timeline().events[rank]:
                        if e.action.kind in COMPUTE_KINDS:
                            key = f"{e.action.stage}{e.action.kind.value}"
                            actions[name].setdefault(key, []).append(e.end - e.start)
                losses[name] = float(loss)
            gc.collect()
    finally:
        gc.enable()
    return {
        "times": times,
        "actions": actions,
        "peaks": {n: pipes[n].peak_saved_bytes[rank] for n in names},
        "losses": losses,
    }


def _run_cpu(args: argparse.Namespace) -> None:
    from zeropipe.runtime.launch import launch

    torch.set_num_threads(args.threads)
    cfg = {k: getattr(args, k) for k in vars(args)}
    m = args.microbatches
    base = generate("1f1b", 2, m)
    costs = _calibrate(cfg, base)
    natural = simulate(base, costs).peak_memory
    everything = checkpoint(base)
    torch_peak = simulate(everything, costs).peak_memory  # what (b) holds, see the docstring
    # A rank cannot go below holding one microbatch's activations during its backward.
    floor = smallest_limit(base, costs)
    if args.budget is None:
        limits = torch_peak
    else:
        limits = [max(args.budget * p, f) for p, f in zip(natural, floor, strict=True)]
    fit = fit_memory(base, limits, costs)
    variants: list[tuple[str, str, bool]] = [
        ("(a) none", base.to_text(), False),
        ("(b) torch ckpt", base.to_text(), True),
        ("(c) R-ahead fit", fit.schedule.to_text(), False),
        ("(d) R-ahead all", everything.to_text(), False),
    ]
    cfg["variants"] = variants
    load = os.getloadavg()
    results = launch(_worker, 2, cfg, timeout=args.timeout, threads=args.threads)
    names = [v[0] for v in variants]
    # A step ends when its slower rank ends; ranks start together (barrier).
    steps = {
        n: [max(ts) for ts in zip(*(r["times"][n] for r in results), strict=True)] for n in names
    }
    med = {n: statistics.median(v) for n, v in steps.items()}
    best = {n: min(v) for n, v in steps.items()}
    replay = {
        n: _replay(Schedule.from_text(text), [r["actions"][n] for r in results])
        for n, text, _ in variants
    }
    peaks = {n: [r["peaks"][n] for r in results] for n in names}
    peaks["(b) torch ckpt"] = [int(p) for p in torch_peak]
    print(
        f"memory benchmark: 2-rank 1F1B over gloo, {args.threads} intra-op thread(s) per rank, "
        f"m={m}, stage = {args.blocks} x [Linear({args.hidden},{args.ffn})-GELU-dropout"
        f"({args.dropout})-Linear + residual], batch {args.batch} x seq {args.seq}, float32; "
        f"{args.reps} interleaved repetitions; load average before/after "
        f"{load[0]:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} core(s)"
    )
    asked = (
        "(b)'s peak" if args.budget is None else f"{args.budget:g} x natural peak (or the floor)"
    )
    print(f"fit_memory for (c), limit {asked}:")
    print("  " + fit.explain().replace("\n", "\n  "))
    print(
        f"{'variant':18} {'median ms':>10} {'vs (a)':>7} {'best ms':>9} {'vs (a)':>7} "
        f"{'replay ms':>10} {'vs (a)':>7} {'peak saved KiB (rank 0, 1)':>28}"
    )
    a = names[0]
    for n in names:
        note = "  (modelled)" if n.startswith("(b)") else ""
        kib = ", ".join(f"{p / 1024:.0f}" for p in peaks[n])
        print(
            f"{n:18} {med[n] * 1e3:10.2f} {med[n] / med[a]:7.3f} {best[n] * 1e3:9.2f} "
            f"{best[n] / best[a]:7.3f} {replay[n] * 1e3:10.2f} {replay[n] / replay[a]:7.3f} "
            f"{kib:>28}{note}"
        )
    for label, figures in (("median", med), ("best", best), ("replay", replay)):
        c, b, d = (figures[names[k]] for k in (2, 1, 3))
        print(
            f"headline ({label}): (c)/(a) = {c / figures[a]:.3f}, (c)/(b) = {c / b:.3f}, "
            f"(d)/(b) = {d / b:.3f}"
        )
    spread = {n: (min(v) / med[n], max(v) / med[n]) for n, v in steps.items()}
    print(
        "spread (min/median, max/median): "
        + "; ".join(f"{n.split()[0]} {lo:.2f}-{hi:.2f}" for n, (lo, hi) in spread.items())
    )
    losses = {round(r["losses"][n], 6) for r in results for n in names}
    print(f"same loss in every variant: {len(losses) == 1}")


def _replay(schedule: Schedule, per_rank: list[dict[str, list[float]]]) -> float:
    """The step time the schedule would take on a quiet machine: its actions' median times.

    Each action's wall time (from the runtime's own timeline) is short, so a
    competing process rarely lands inside it, and its median over the
    repetitions less so; the simulator then puts the medians on the
    schedule's dependency graph (communication taken as free).
    """
    med: dict[str, float] = {}
    for durations in per_rank:
        med.update({k: statistics.median(v) for k, v in durations.items()})
    stages = []
    for s in range(schedule.num_stages):
        f = med.get(f"{s}F", 0.0)
        b = med.get(f"{s}B", 0.0)
        stages.append(StageCost(F=f, B=b, I=b / 2, W=b / 2, R=med.get(f"{s}R", f)))
    return simulate(schedule, CostModel(tuple(stages))).makespan


# --- activation offload on one accelerator --------------------------------------------------


def _run_device(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if not is_accelerator(device):
        raise SystemExit(f"--device {args.device}: not an accelerator this torch can use")
    cfg = {k: getattr(args, k) for k in vars(args)}
    base = generate("1f1b", 2, args.microbatches)
    x, y = _batch(cfg, device)
    variants: dict[str, tuple[Schedule, Callable[[nn.Module], nn.Module] | None]] = {
        "none": (base, None),
        f"offload prefetch {args.prefetch}": (offload(base, prefetch=args.prefetch), None),
        "offload no prefetch": (offload(base, prefetch=0), None),
        "save_on_cpu": (base, _SaveOnCpu),
    }
    pipes: dict[str, Pipeline] = {}
    for name, (schedule, wrap) in variants.items():
        stages = [m.to(device) for m in _stages(cfg)]
        if wrap is not None:
            stages = [wrap(m) for m in stages]
        pipes[name] = Pipeline(stages, schedule, loss_fn=F.mse_loss, mesh="local")
    times: dict[str, list[float]] = {n: [] for n in pipes}
    peaks: dict[str, int] = {}
    names = list(pipes)
    for rep in range(args.warmup + args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            for p in pipes[name].parameters():
                p.grad = None
            torch.accelerator.synchronize(device)
            reset_peak_bytes(device)
            t0 = time.perf_counter()
            pipes[name].step(x, y)
            torch.accelerator.synchronize(device)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            peaks[name] = peak_allocated_bytes(device) or 0
    med = {n: statistics.median(v) for n, v in times.items()}
    print(
        f"activation offload on {device} (both ranks of a 2-stage 1F1B in one process), "
        f"m={args.microbatches}, {args.reps} interleaved repetitions (median)"
    )
    print(f"{'variant':24} {'step ms':>9} {'vs none':>8} {'allocator peak MiB':>19}")
    for n in names:
        print(f"{n:24} {med[n] * 1e3:9.2f} {med[n] / med['none']:8.3f} {peaks[n] / 2**20:19.1f}")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per stage")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--budget", type=float, default=None,
                    help="(c): limit as a fraction of each rank's natural peak "
                    "(default: the peak torch.utils.checkpoint reaches)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--device", default=None,
                    help="an accelerator device: run the offload comparison on it instead")  # fmt: skip
    ap.add_argument("--prefetch", type=int, default=1,
                    help="offload: RELOAD this many compute actions before the backward")  # fmt: skip
    return ap.parse_args()


def main() -> None:
    args = _parse()
    if args.device is None:
        _run_cpu(args)
    else:
        _run_device(args)


if __name__ == "__main__":
    main()
