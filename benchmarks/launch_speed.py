"""Benchmark: how long ``zeropipe.launch`` takes to start ranks that do nothing.

Ranks are forked from a fork server that imported torch and zeropipe once
(``zeropipe.runtime.rank_process``): the first launch in a process starts that server,
later ones only fork.  Each line is one launch of ``--ranks`` ranks, wall seconds from
the call to its return, in one process, in order.

    python benchmarks/launch_speed.py
    python benchmarks/launch_speed.py --ranks 4 --launches 5
"""

from __future__ import annotations

import argparse
import time

from zeropipe.runtime.launch import launch


def nothing(rank: int, world: int) -> int:
    return rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    for k in range(args.launches):
        start = time.perf_counter()
        launch(nothing, args.ranks)
        note = " (starts the fork server)" if k == 0 else ""
        print(f"launch {k + 1}: {args.ranks} ranks in {time.perf_counter() - start:.2f} s{note}")


if __name__ == "__main__":
    main()
