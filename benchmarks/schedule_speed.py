"""Benchmark: how long generate + validate + simulate takes for a large schedule.

For each schedule (default: zbv, 1f1b, interleaved-1f1b, zb-h2 at 32 ranks and
256 microbatches) the script times, in interleaved repetitions (schedule
order rotates each round so a shared machine's load drifts over all alike):

    generate   zeropipe.schedules.generate(name, ranks, microbatches)
    validate   zeropipe.validate.validate(schedule)       -> dependency graph
    simulate   zeropipe.simulate.simulate(schedule, graph=graph)

and prints the median of each and of their sum.  The goal for zbv at
p=32, m=256 is a total under 2 s.  ``--profile NAME`` runs the three steps
once under cProfile and prints where the time goes.  Pure Python, one
process, no torch work.

    python benchmarks/schedule_speed.py
    python benchmarks/schedule_speed.py --ranks 16 --microbatches 64 --reps 5
    python benchmarks/schedule_speed.py --profile zbv
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from zeropipe.schedules import generate
from zeropipe.simulate import simulate
from zeropipe.validate import validate

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--schedules",
        default="zbv,1f1b,interleaved-1f1b,zb-h2",
        help="comma-separated generator names (default: %(default)s)",
    )
    parser.add_argument("--goal", type=float, default=2.0, help="seconds allowed for zbv")
    parser.add_argument("--profile", metavar="NAME", help="cProfile one run of NAME instead")
    parser.add_argument("--top", type=int, default=20, help="rows of the profile to print")
    args = parser.parse_args()

    if args.profile:
        _profile(args.profile, args.ranks, args.microbatches, args.top)
        return

    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in STEPS} for n in names}
    actions: dict[str, int] = {}
    for rep in range(args.reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            step_times, actions[name] = _once(name, args.ranks, args.microbatches)
            for k, v in step_times.items():
                times[name][k].append(v)

    print(
        f"generate + validate + simulate, p={args.ranks}, m={args.microbatches}, "
        f"default chunks; median of {args.reps} interleaved repetitions, seconds"
    )
    header = f"{'schedule':<18}{'actions':>9}" + "".join(f"{k:>10}" for k in STEPS)
    print(header + f"{'total':>10}")
    print("-" * (len(header) + 10))
    totals = {}
    for name in names:
        med = {k: statistics.median(times[name][k]) for k in STEPS}
        totals[name] = statistics.median(
            sum(times[name][k][i] for k in STEPS) for i in range(args.reps)
        )
        row = f"{name:<18}{actions[name]:>9}" + "".join(f"{med[k]:>10.3f}" for k in STEPS)
        print(row + f"{totals[name]:>10.3f}")
    if "zbv" in totals:
        verdict = "meets" if totals["zbv"] < args.goal else "MISSES"
        print(f"zbv total {totals['zbv']:.3f} s {verdict} the {args.goal:g} s goal")


if __name__ == "__main__":
    main()
