"""Benchmark: how long generate + validate + simulate takes for large schedules.

Each case is timed in interleaved repetitions (case order rotates each round so
a shared machine's load drifts over all alike):

    generate   zeropipe.core.schedules.generate(name, ranks, microbatches)
    validate   zeropipe.core.validate.validate(schedule)       -> dependency graph
    simulate   zeropipe.core.simulate.simulate(schedule, graph=graph)

and the median of each and of their sum is printed.  By default the cases are
the planning core's goals (seconds for the whole of generate + validate +
simulate, in one process):

    zbv   p=64,  m=256    < 0.75        auto  p=8,  m=24    < 0.2
    zbv   p=128, m=1024   < 10          auto  p=32, m=96    < 1

``auto`` is the search under unit costs within 1F1B's peak (its own
candidates validated and simulated inside ``generate``).  ``--schedules`` with
``--ranks`` and ``--microbatches`` times other cases instead; ``--profile NAME``
runs the three steps once under cProfile and prints where the time goes.  Pure
Python, one process, no torch work.

    python benchmarks/schedule_speed.py
    python benchmarks/schedule_speed.py --schedules zbv,1f1b --ranks 32 --microbatches 256
    python benchmarks/schedule_speed.py --profile zbv --ranks 64 --microbatches 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import sys
import time

from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

STEPS = ("generate", "validate", "simulate")


def _once(name: str, ranks: int, microbatches: int) -> tuple[dict[str, float], int]:
    t0 = time.perf_counter()
    s = generate(name, ranks, microbatches)
    t1 = time.perf_counter()
    graph = validate(s)
    t2 = time.perf_counter()
    simulate(s, graph=graph)
    t3 = time.perf_counter()
    actions = sum(len(a) for a in s.actions)
    return {"generate": t1 - t0, "validate": t2 - t1, "simulate": t3 - t2}, actions


def _profile(name: str, ranks: int, microbatches: int, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    _once(name, ranks, microbatches)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    print(out.getvalue())


GOALS: list[tuple[str, int, int, float]] = [
    ("zbv", 64, 256, 0.75),
    ("zbv", 128, 1024, 10.0),
    ("auto", 8, 24, 0.2),
    ("auto", 32, 96, 1.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", help="comma-separated generator names (default: the goals)")
    parser.add_argument("--ranks", type=int, default=32, help="with --schedules or --profile")
    parser.add_argument("--microbatches", type=int, default=256, help="likewise")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", metavar="NAME", help="cProfile one run of NAME instead")
    parser.add_argument("--top", type=int, default=20, help="rows of the profile to print")
    args = parser.parse_args()

    if args.profile:
        _profile(args.profile, args.ranks, args.microbatches, args.top)
        return

    if args.schedules:
        names = [n.strip() for n in args.schedules.split(",") if n.strip()]
        cases = [(n, args.ranks, args.microbatches, math.nan) for n in names]
    else:
        cases = GOALS
    times: list[dict[str, list[float]]] = [{k: [] for k in STEPS} for _ in cases]
    actions = [0] * len(cases)
    for rep in range(args.reps):
        shift = rep % len(cases)
        for c in list(range(len(cases)))[shift:] + list(range(len(cases)))[:shift]:
            name, ranks, m, _ = cases[c]
            step_times, actions[c] = _once(name, ranks, m)
            for k, v in step_times.items():
                times[c][k].append(v)
            print(f"  rep {rep + 1}/{args.reps}: {name} p={ranks} m={m} done", file=sys.stderr)

    print(
        f"generate + validate + simulate, default chunks; median of {args.reps} "
        f"interleaved repetitions, seconds"
    )
    header = f"{'schedule':<10}{'p':>5}{'m':>6}{'actions':>9}" + "".join(f"{k:>10}" for k in STEPS)
    header += f"{'total':>9}{'goal':>7}  verdict"
    print(header)
    print("-" * len(header))
    missed = 0
    for c, (name, ranks, m, goal) in enumerate(cases):
        med = {k: statistics.median(times[c][k]) for k in STEPS}
        total = statistics.median(sum(times[c][k][i] for k in STEPS) for i in range(args.reps))
        row = f"{name:<10}{ranks:>5}{m:>6}{actions[c]:>9}" + "".join(
            f"{med[k]:>10.3f}" for k in STEPS
        )
        if math.isnan(goal):
            print(row + f"{total:>9.3f}")
            continue
        verdict = "meets" if total < goal else "MISSES"
        missed += total >= goal
        print(row + f"{total:>9.3f}{goal:>7g}  {verdict}")
    if not args.schedules:
        print(f"{len(cases) - missed} of {len(cases)} goals met")


if __name__ == "__main__":
    main()
