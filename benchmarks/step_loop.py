"""Benchmark: one library's steps in a loop, on 2 gloo ranks, for tools that watch processes.

The tiny MLP ``zeropipe bench --blocks 4 --width 64 --hidden 128`` runs (8 microbatches of
8 rows, cut [2, 2]), stepped ``--steps`` times by zeropipe's ``Pipeline`` or by
torch.distributed.pipelining (``--library``), after 20 warm-up steps; each rank prints its
median step and its process id.  ``--profile`` runs the timed steps under ``cProfile`` and
prints each rank's costliest calls (wall time, so torch's ops show what they cost inside a
rank that shares the cores).  ``--ready FILE`` writes rank 0's process id to FILE when the
timed steps start, so that a tool started then sees only them::

    python benchmarks/step_loop.py --library zeropipe
    python benchmarks/step_loop.py --library torch --profile
    python benchmarks/step_loop.py --library zeropipe --steps 600 --ready go &
    while [ ! -f go ]; do sleep 0.1; done; perf sched record -a -- sleep 2
    perf sched timehist -s                  # per thread: run time, switches, waits
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from zeropipe.apps.bench import BenchConfig, torch_step, workload, zeropipe_step
from zeropipe.runtime.launch import launch

CUT = [2, 2]
WARMUP = 20


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = BenchConfig(models=("mlp",), blocks=4, width=64, hidden=128, schedules=(args.schedule,))
    work = workload("mlp", cfg)
    step: Callable[[], None]
    if args.library == "zeropipe":
        step = zeropipe_step(args.schedule, world, cfg, work, CUT)
    else:
        step = torch_step(args.schedule, rank, world, cfg, work, CUT)
    for _ in range(WARMUP):
        step()
    if rank == 0 and args.ready:
        with open(args.ready, "w") as fh:
            fh.write(str(os.getpid()))
    profile = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        step()
        if profile is not None:
            profile.disable()
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"pid": os.getpid(), "median_ms": statistics.median(times) * 1e3}
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        out["profile"] = text.getvalue()
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--library", choices=("zeropipe", "torch"), default="zeropipe")
    p.add_argument("--schedule", default="1f1b", help="a schedule both libraries run")
    p.add_argument("--steps", type=int, default=200, help="timed steps (default 200)")
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    p.add_argument("--ready", metavar="FILE", help="write rank 0's pid here when timing starts")
    args = p.parse_args(argv)
    results: list[dict[str, Any]] = launch(_rank, 2, args, timeout=600, threads=1)
    for rank, r in enumerate(results):
        print(f"rank {rank} (pid {r['pid']}): {args.library} {args.schedule}, median step "
              f"{r['median_ms']:.2f} ms over {args.steps} steps")  # fmt: skip
        if "profile" in r:
            print(r["profile"])
    return results


if __name__ == "__main__":
    main()
