"""Benchmark: the planned and the measured bubble of ``zeropipe train``'s default run.

The README's first command ends in ``zeropipe train``: a 4-block GPT on 2 gloo ranks under
``zbv``, 300 steps.  Its ``timeline.png`` draws one step (``trace_step``, step 10) twice:
as it ran, and as the schedule simulated under costs taken from that same step
(:func:`zeropipe.core.simulate.costs_from_timeline`: each action's median work, the median
post of a send or receive, and the median transfer latency of the consumers that waited
for their data).  This script runs that command ``--runs`` times and prints, per run, the
two bubble rates (1 - busy / (ranks x makespan); a wait for data is idle in both), their
difference in points, the latency the plan charged, and what the plan would say with no
latency (as it did before it charged one).

    python benchmarks/train_bubble.py --runs 3
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from statistics import median

from zeropipe.apps.train import train
from zeropipe.apps.train_config import TrainConfig
from zeropipe.core.simulate import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="launches of the default run")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    args = parser.parse_args()
    print("run  measured  planned  difference  latency ms  planned with no latency")
    gaps, old_gaps = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            summary = train(TrainConfig(out=out, steps=args.steps, quiet=True))
        trace = summary["trace"]
        measured, planned = trace["measured_bubble"], trace["planned_bubble"]
        costs = trace["costs"]
        no_latency = simulate(trace["timeline"].schedule, replace(costs, latency=0.0))
        gaps.append(abs(measured - planned))
        old_gaps.append(abs(measured - no_latency.bubble_rate))
        print(
            f"{run + 1:>3}  {measured:>7.1%}  {planned:>7.1%}  {100 * (planned - measured):>+8.1f} pt"
            f"  {1e3 * costs.latency:>10.2f}  {no_latency.bubble_rate:>7.1%}"
        )
    print(
        f"median |difference|: {100 * median(gaps):.1f} points "
        f"(with no latency: {100 * median(old_gaps):.1f})"
    )


if __name__ == "__main__":
    main()
