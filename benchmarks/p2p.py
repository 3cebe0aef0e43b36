"""The two point-to-point protocols side by side on gloo: tagged against ordered.

Both pipelines live in the same processes and their steps alternate, so load
drift hits both alike.  Step time is the slowest rank's wall time; the table
gives medians and the ratio ordered / tagged per schedule and model size::

    python benchmarks/p2p.py [--reps 20] [--ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeropipe import RuntimeOptions
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
# name -> (blocks, width, hidden, batch)
MODELS = {"mlp-512": (8, 512, 2048, 64), "tiny-64": (4, 64, 128, 16)}


def _model(blocks: int, width: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        ]
    )


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_name, (blocks, width, hidden, batch) in MODELS.items():
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        for name in SCHEDULES:
            model = _model(blocks, width, hidden)
            pipes = {
                p2p: Pipeline(
                    model, name, loss_fn=F.mse_loss, microbatches=8, options=RuntimeOptions(p2p=p2p)
                )  # type: ignore[arg-type]
                for p2p in ("tagged", "ordered")
            }
            times: dict[str, list[float]] = {p2p: [] for p2p in pipes}
            for k in range(reps + 3):
                for p2p, pipe in pipes.items():
                    dist.barrier()
                    start = time.perf_counter()
                    pipe.step(x, y)
                    took = _slowest(time.perf_counter() - start)
                    if k >= 3:  # warm-up steps learn shapes and fill caches
                        times[p2p].append(took)
            out[f"{model_name}/{name}"] = {p: statistics.median(t) for p, t in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    result = launch(_rank, args.ranks, args.reps, timeout=1800.0)[0]
    print("| model | schedule | tagged s | ordered s | ordered / tagged |")
    print("|---|---|---|---|---|")
    for key, t in result.items():
        model_name, name = key.split("/", 1)
        print(
            f"| {model_name} | {name} | {t['tagged']:.4f} | {t['ordered']:.4f} | "
            f"{t['ordered'] / t['tagged']:.2f} |"
        )


if __name__ == "__main__":
    main()
