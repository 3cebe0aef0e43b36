"""Benchmark: the planned and the measured bubble of ``zeropipe train``'s default run.

The README's first command ends in ``zeropipe train``: a 4-block GPT on 2 gloo ranks under
``zbv``, 300 steps.  Its ``timeline.png`` draws one step (``trace_step``, step 10) twice:
as it ran, and as the schedule simulated under costs taken from that same step
(:func:`zeropipe.core.simulate.costs_from_timeline`: each action's median work, the median
post of a send or receive, and the median transfer latency of the consumers that waited
for their data).  This script runs that command ``--runs`` times and prints, per run, the
two bubble rates (1 - busy / (ranks x makespan); a wait for data is idle in both), their
difference in points, the latency the plan charged, what the plan would say with no
latency (as it did before it charged one), both makespans, and how much longer the traced
step's actions ran than their medians (time the plan cannot foresee).

    python benchmarks/train_bubble.py --runs 3
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from statistics import median

from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train
from zeropipe.core.simulate import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="launches of the default run")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    args = parser.parse_args()
    print(
        "run  measured  planned  difference  latency ms  no latency  "
        "makespan ms (ran, planned)  work beyond the medians ms"
    )
    gaps, old_gaps = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            summary = train(TrainConfig(out=out, steps=args.steps, quiet=True))
        trace = summary["trace"]
        measured, planned = trace["measured_bubble"], trace["planned_bubble"]
        costs = trace["costs"]
        timeline = trace["timeline"]
        no_latency = simulate(timeline.schedule, replace(costs, latency=0.0))
        plan = simulate(timeline.schedule, costs)
        ranks = range(timeline.num_ranks)
        # What the traced step computed beyond each action's typical (median) time: an
        # action slowed by the machine idles its peers, which the plan cannot foresee.
        extra = sum(timeline.busy(r) for r in ranks) - sum(plan.busy(r) for r in ranks)
        gaps.append(abs(measured - planned))
        old_gaps.append(abs(measured - no_latency.bubble_rate))
        print(
            f"{run + 1:>3}  {measured:>7.1%}  {planned:>7.1%}  {100 * (planned - measured):>+8.1f} pt"
            f"  {1e3 * costs.latency:>10.2f}  {no_latency.bubble_rate:>10.1%}"
            f"  {1e3 * timeline.makespan:>12.1f}, {1e3 * plan.makespan:>6.1f}"
            f"  {1e3 * extra:>+14.1f}"
        )
    print(
        f"median |difference|: {100 * median(gaps):.1f} points "
        f"(with no latency: {100 * median(old_gaps):.1f})"
    )


if __name__ == "__main__":
    main()
