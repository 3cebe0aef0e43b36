"""Benchmark: two independent heavy branches, parallel_map against plain autograd.

Plain autograd runs independent CPU branches one after another, forward and
backward.  This script builds ``branches`` equal MLPs -- ``layers`` x
[Linear(width, width) -> tanh] -- each fed its own input, and times in
interleaved repetitions (the order alternates, so drift in a shared
machine's load hits both alike):

    plain      out_i = branch_i(x_i) for each i, then loss.backward()
    parallel   outs = parallel_map(branches, xs), then loss.backward()

and prints medians of forward and backward wall time and the headline ratios
parallel / plain (the physical limit with 2 branches on >= 2 free cores is
0.5).  Gradients of the two variants are checked equal before timing.

Every intra-op pool is set to one thread (``--threads``, also through
``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` before torch is imported) so each
branch owns one core; the table says so.

    python benchmarks/parallel_branches.py                  # 2 branches, 4 x 1024, batch 256
    python benchmarks/parallel_branches.py --reps 30 --batch 128
"""

from __future__ import annotations

import os

# Before torch is imported: worker threads read these when they first run an op.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import gc
import statistics
import threading
import time

import torch
from torch import Tensor, nn

from zeropipe.autograd.parallel import BranchPool, parallel_map


def _branch(layers: int, width: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--branches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (per branch)")
    return ap.parse_args()


def _machine_parallelism(width: int, batch: int, n: int) -> float:
    """How much faster ``n`` raw threads do ``n`` equal matmul loops than one thread does.

    A control for the table: on an idle machine with ``n`` free cores it is
    about ``n``; other load on the machine lowers it, and with it every ratio
    parallel_map can reach.
    """
    a, w = torch.randn(batch, width), torch.randn(width, width)

    def loop() -> None:
        for _ in range(10):
            a @ w

    t0 = time.perf_counter()
    for _ in range(n):
        loop()
    serial = time.perf_counter() - t0
    threads = [threading.Thread(target=loop) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - t0)


def _zero(model: nn.Module, xs: list[Tensor]) -> None:
    for p in model.parameters():
        p.grad = None
    for x in xs:
        x.grad = None


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.ModuleList(_branch(args.layers, args.width) for _ in range(args.branches))
    xs = [torch.randn(args.batch, args.width, requires_grad=True) for _ in range(args.branches)]
    pool = BranchPool(max_workers=max(1, args.branches - 1))  # + the calling thread

    def plain() -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = [m(x) for m, x in zip(model, xs, strict=True)]
        t1 = time.perf_counter()
        sum(o.square().mean() for o in outs).backward()
        return t1 - t0, time.perf_counter() - t1

    def parallel() -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = parallel_map(model, xs, pool=pool)
        t1 = time.perf_counter()
        sum(o.square().mean() for o in outs).backward()
        return t1 - t0, time.perf_counter() - t1

    # Same gradients (float32 here; the tests check float64 exactly).
    grads = []
    for variant in (plain, parallel):
        _zero(model, xs)
        variant()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads, strict=True)):
        raise SystemExit("parallel_map gradients differ from plain autograd")

    times: dict[str, list[tuple[float, float]]] = {"plain": [], "parallel": []}
    variants = [("plain", plain), ("parallel", parallel)]
    machine: list[float] = []
    for rep in range(args.warmup + args.reps):
        for name, variant in variants if rep % 2 == 0 else variants[::-1]:
            _zero(model, xs)
            gc.collect()
            t = variant()
            if rep >= args.warmup:
                times[name].append(t)
        if rep >= args.warmup:
            machine.append(_machine_parallelism(args.width, args.batch, args.branches))
    pool.close()

    med = {
        k: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v))
        for k, v in times.items()
    }
    print(
        f"parallel branches: {args.branches} x [{args.layers} x Linear({args.width}) + tanh], "
        f"batch {args.batch}, {args.reps} reps (median), intra-op threads {args.threads} "
        f"per branch, {os.cpu_count()} cores, torch {torch.__version__}"
    )
    print(
        f"machine control: {args.branches} raw threads ran {args.branches} matmul loops "
        f"{statistics.median(machine):.2f}x faster than one thread (median; idle ideal "
        f"{min(args.branches, os.cpu_count() or 1)}x)"
    )
    print(
        f"{'variant':<10} {'forward ms':>11} {'backward ms':>12} {'fwd ratio':>10} {'bwd ratio':>10}"
    )
    base_f, base_b = med["plain"]
    for name, (f, b) in med.items():
        print(
            f"{name:<10} {f * 1e3:>11.1f} {b * 1e3:>12.1f} {f / base_f:>10.2f} {b / base_b:>10.2f}"
        )


if __name__ == "__main__":
    main()
