"""Benchmark: the pipeline efficiency this machine allows before any schedule runs.

``zeropipe bench`` reports efficiency as sequential time / (ranks x step time),
where the sequential time is one process computing alone.  A pipeline's ranks
compute at the same time; if the cores slow each other down (shared caches,
memory bandwidth, a noisy neighbour on a VM), no schedule and no runtime can
reach 1.0.  This measures by how much: the bench model's forward and backward
over its microbatches (the work ``bench``'s sequential column times), in one
process alone and then in ``--ranks`` processes at once, each with one
intra-op thread, alternating in trials within one launch::

    slowdown = median step of the slowest of the concurrent processes / median step alone

1 / slowdown bounds the efficiency any schedule can reach here; the simulated
best schedule's efficiency times that is what a perfect runtime would show.

    python benchmarks/ceiling.py
    python benchmarks/ceiling.py --model mlp --trials 9 --reps 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from zeropipe.apps.bench import BenchConfig, workload


def _steps(model: str, reps: int, start: Any, out: Any) -> None:
    torch.set_num_threads(1)
    cfg = BenchConfig()
    work = workload(model, cfg)
    net = work.build()
    xs = work.inputs.tensor_split(cfg.microbatches)
    ys = work.targets.tensor_split(cfg.microbatches)

    def step() -> None:
        for x, y in zip(xs, ys, strict=True):
            (work.loss_fn(net(x), y) * (len(x) / len(work.inputs))).backward()
        net.zero_grad(set_to_none=True)

    for _ in range(cfg.warmup):
        step()
    if start is not None:
        start.wait()  # the concurrent processes time the same stretch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times))


def _run(ctx: Any, model: str, reps: int, processes: int) -> float:
    """The slowest process's median step, ``processes`` of them computing at once."""
    out = ctx.Queue()
    start = ctx.Barrier(processes) if processes > 1 else None
    procs = [ctx.Process(target=_steps, args=(model, reps, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    medians = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(medians)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("mlp", "transformer", "both"), default="both")
    p.add_argument("--ranks", type=int, default=2, help="processes computing at once")
    p.add_argument("--trials", type=int, default=5, help="alone / together pairs per model")
    p.add_argument("--reps", type=int, default=10, help="timed steps per process per trial")
    args = p.parse_args(argv)
    models = ("mlp", "transformer") if args.model == "both" else (args.model,)
    ctx = mp.get_context("spawn")
    print(
        f"{args.ranks} processes at once against one alone, 1 intra-op thread each, "
        f"the bench model's microbatched forward + backward, median of {args.reps} steps"
    )
    print(f"{'model':<12} {'alone s':>8} {'together s':>10} {'slowdown':>8}   per trial")
    for model in models:
        alone, together, ratios = [], [], []
        for _ in range(args.trials):
            a = _run(ctx, model, args.reps, 1)
            t = _run(ctx, model, args.reps, args.ranks)
            alone.append(a)
            together.append(t)
            ratios.append(t / a)
        print(
            f"{model:<12} {statistics.median(alone):>8.4f} {statistics.median(together):>10.4f} "
            f"{statistics.median(ratios):>8.3f}   " + " ".join(f"{r:.3f}" for r in ratios),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
