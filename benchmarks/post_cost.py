"""Benchmark: what a send costs to post, with the CPU idle and right after matrix products.

On a CPU, a pipeline posts each send right after the compute action that
produced its tensor.  This measures what that moment costs, side by side in
one invocation (two processes over gloo, one intra-op thread each, the
receives posted in advance as zeropipe's lowering does)::

    idle           the post alone, in a loop
    after compute  the post right after a few matrix products that stream more
                   memory than the caches hold

and, in one process, the same for two calls that do no communication at all
(a no-op Python call, ``torch.empty``), which shows that the difference is the
state the products leave the core in, not the network.  Medians over the
repetitions; the figures bound what any transfer costs on the machine.

    python benchmarks/post_cost.py
    python benchmarks/post_cost.py --kib 64 --reps 100
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from zeropipe.runtime.launch import launch


def _products(a: torch.Tensor, w: torch.Tensor, count: int) -> None:
    for _ in range(count):
        a @ w


def _timed(fn: Callable[[], object], before: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[reps // 10 :])


def _sends(numel: int, products: int, reps: int) -> float:
    """Rank 0: median seconds to post one isend, ``products`` products after the last."""
    a, w = torch.randn(64, 2048), torch.randn(2048, 2048)
    x = torch.randn(numel)
    sent = []
    tags = iter(range(reps))
    median = _timed(
        lambda: sent.append(dist.isend(x, 1, tag=next(tags))),
        lambda: _products(a, w, products),
        reps,
    )
    for work in sent:
        if work is not None:
            work.wait()
    return median


def _worker(rank: int, world: int, cfg: dict[str, int]) -> dict[str, float]:
    numel = cfg["kib"] * 1024 // 4
    out: dict[str, float] = {}
    for label, products in (("idle", 0), ("after compute", cfg["products"])):
        if rank == 1:  # every receive posted before the sends start
            bufs = [torch.empty(numel) for _ in range(cfg["reps"])]
            works = [dist.irecv(b, 0, tag=k) for k, b in enumerate(bufs)]
            dist.barrier()
            for work in works:
                if work is not None:
                    work.wait()
        else:
            dist.barrier()
            time.sleep(0.05)  # let the receives land first
            out[label] = _sends(numel, products, cfg["reps"])
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kib", type=int, default=16, help="payload of each send (KiB)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--products", type=int, default=3,
                    help="64x2048 @ 2048x2048 products before each timed call")  # fmt: skip
    args = ap.parse_args()
    cfg = {"kib": args.kib, "reps": args.reps, "products": args.products}
    sends = launch(_worker, 2, cfg, threads=1)[0]
    torch.set_num_threads(1)
    a, w = torch.randn(64, 2048), torch.randn(2048, 2048)
    local: dict[str, Callable[[], object]] = {
        "no-op Python call": lambda: None,
        "torch.empty(4096)": lambda: torch.empty(4096),
    }
    print(
        f"post cost: gloo isend of {args.kib} KiB between 2 processes (receive posted first), "
        f"1 intra-op thread each; 'after compute' = right after {args.products} products of "
        f"64x2048 @ 2048x2048; median of {args.reps}"
    )
    print(f"{'call':24} {'idle us':>9} {'after compute us':>17} {'ratio':>7}")
    rows = [("gloo isend", sends["idle"], sends["after compute"])]
    for name, fn in local.items():
        idle = _timed(fn, lambda: None, args.reps)
        cold = _timed(fn, lambda: _products(a, w, args.products), args.reps)
        rows.append((name, idle, cold))
    for name, idle, cold in rows:
        print(f"{name:24} {idle * 1e6:9.1f} {cold * 1e6:17.1f} {cold / idle:7.1f}")


if __name__ == "__main__":
    main()
