"""Benchmark: where a linear is faster recorded for split backward than plain, under B only.

On a stage whose schedule runs only full backwards B, the pipeline leaves an
``nn.Linear`` plain when its weight is under ``PLAIN_BELOW_BYTES`` and records
the larger ones (their weight gradients then go into ``.grad`` with one fused
product, into memory kept from the last step).  This times one stage of
``Linear(w, 4w)-GELU-Linear(4w, w)`` blocks, 1f1b over 8 microbatches, in one
process with one intra-op thread, with every linear plain and with every linear
recorded, alternating in rounds within one launch, for several widths::

    python benchmarks/plain_linears.py
    python benchmarks/plain_linears.py --widths 64,128 --rounds 5 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from zeropipe import build_schedule
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.runtime import parts
from zeropipe.runtime.pipeline import Pipeline

MICROBATCHES = 8


def _step_ms(width: int, blocks: int, rows: int, recorded: bool, steps: int) -> float:
    """Median step of a fresh one-stage pipeline, every linear recorded or every one plain."""
    default = parts.PLAIN_BELOW_BYTES
    parts.PLAIN_BELOW_BYTES = 0 if recorded else 1 << 62
    try:
        model = mlp_blocks(blocks, width, 4 * width)
        pipe = Pipeline(
            model, build_schedule("1f1b", ranks=1, microbatches=MICROBATCHES), loss_fn=F.mse_loss
        )
    finally:
        parts.PLAIN_BELOW_BYTES = default
    x = torch.randn(rows * MICROBATCHES, width)
    y = torch.randn(rows * MICROBATCHES, width)
    times = []
    for k in range(steps + 3):  # 3 warm-up steps
        start = time.perf_counter()
        pipe.step(x, y)
        model.zero_grad(set_to_none=True)
        if k >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,128,256,512", help="comma list of block widths")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per width")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(
        f"one stage of {args.blocks} x Linear(w, 4w)-GELU-Linear(4w, w), 1f1b over "
        f"{MICROBATCHES} microbatches of {args.rows} rows, 1 thread; step ms, median of "
        f"{args.rounds} rounds (limit: plain below {parts.PLAIN_BELOW_BYTES // 1024} KiB)"
    )
    print(f"{'w':>5} {'weight KiB':>11} {'plain':>9} {'recorded':>9} {'plain/recorded':>15}")
    for width in (int(w) for w in args.widths.split(",")):
        plain, recorded = [], []
        for _ in range(args.rounds):
            plain.append(_step_ms(width, args.blocks, args.rows, False, args.steps))
            recorded.append(_step_ms(width, args.blocks, args.rows, True, args.steps))
        p, r = statistics.median(plain), statistics.median(recorded)
        kib = width * 4 * width * 4 // 1024
        print(f"{width:>5} {kib:>11} {p:>9.2f} {r:>9.2f} {p / r:>15.2f}")


if __name__ == "__main__":
    main()
