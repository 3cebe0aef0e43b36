"""Benchmark: one library's steps in a loop, on 2 gloo ranks, for tools that watch processes.

The tiny MLP ``zeropipe bench --blocks 4 --width 64 --hidden 128`` runs (8 microbatches of
8 rows, cut [2, 2]), stepped ``--steps`` times by zeropipe's ``Pipeline`` or by
torch.distributed.pipelining (``--library``), after 20 warm-up steps; each rank prints its
median step, its process id, and what the timed steps cost it per step: CPU time by thread
(its main thread's apart), context switches and, under zeropipe, how many waits the calling
thread made itself (their data had landed) and how many it handed to a pool thread.  ``--profile`` runs the timed steps under
``cProfile`` and prints each rank's costliest calls (wall time, so torch's ops show what they
cost inside a rank that shares the cores).  ``--ready FILE`` writes rank 0's process id to
FILE when the timed steps start, so that a tool started then sees only them::

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
import resource
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
    waits = _count_waits() if args.library == "zeropipe" else None
    profile = cProfile.Profile() if args.profile else None
    times = []
    usage, threads, main_cpu = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu(), 0.0
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        cpu = time.thread_time()
        step()
        main_cpu += time.thread_time() - cpu
        if profile is not None:
            profile.disable()
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"pid": os.getpid(), "median_ms": statistics.median(times) * 1e3}
    out["cpu"] = _cpu_per_step(usage, threads, main_cpu, args.steps)
    if waits is not None:
        out["cpu"] += (
            f"\n  waits per step: {waits['here'] / args.steps:.1f} on the calling thread (their data "
            f"had landed), {waits['pool'] / args.steps:.1f} handed to a pool thread"
        )
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        out["profile"] = text.getvalue()
    return out


def _count_waits() -> dict[str, int]:
    """Count, from now on, the runtime's waits made on the calling thread and those handed
    to a pool thread (``Pending.wait_here`` and ``WaitPool.submit``)."""
    from zeropipe.runtime.transport.endpoint import Pending, WaitPool

    counts = {"here": 0, "pool": 0}
    here, submit = Pending.wait_here, WaitPool.submit

    def counted_here(self: Pending) -> None:
        counts["here"] += 1
        here(self)

    def counted_submit(self: WaitPool, job: Callable[[], None]) -> None:
        counts["pool"] += 1
        submit(self, job)

    Pending.wait_here = counted_here  # type: ignore[method-assign]
    WaitPool.submit = counted_submit  # type: ignore[method-assign]
    return counts


def _thread_cpu() -> dict[str, tuple[str, float]]:
    """Each thread's CPU seconds so far, by thread id: (its name, seconds); Linux only."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:  # the thread ended
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        utime, stime = fields.split()[11:13]
        out[tid] = (name, (int(utime) + int(stime)) / tick)
    return out


def _cpu_per_step(
    usage: resource.struct_rusage, threads: dict[str, tuple[str, float]], main: float, steps: int
) -> str:
    """What the timed steps cost the process per step: CPU by thread and context switches.

    The steps include the barrier before each.  Threads are grouped by name: the main
    thread and zeropipe's waiter threads are both "python" (the name Linux sees), gloo's
    I/O thread is "gloo_tcp_loop"; clock ticks make these figures coarse (10 ms each).
    """
    now = resource.getrusage(resource.RUSAGE_SELF)
    total = now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime
    names: dict[str, float] = {}
    for tid, (name, seconds) in _thread_cpu().items():
        names[name] = names.get(name, 0.0) + seconds - threads.get(tid, (name, 0.0))[1]
    by_thread = ", ".join(
        f"{name} {seconds / steps * 1e3:.2f}" for name, seconds in sorted(names.items()) if seconds
    )
    return (
        f"CPU per step {total / steps * 1e3:.2f} ms (main thread {main / steps * 1e3:.2f}; by "
        f"thread name: {by_thread or 'not on this OS'}), context switches per step "
        f"{(now.ru_nvcsw - usage.ru_nvcsw) / steps:.0f} voluntary, "
        f"{(now.ru_nivcsw - usage.ru_nivcsw) / steps:.0f} involuntary"
    )


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
              f"{r['median_ms']:.2f} ms over {args.steps} steps\n  {r['cpu']}")  # fmt: skip
        if "profile" in r:
            print(r["profile"])
    return results


if __name__ == "__main__":
    main()
