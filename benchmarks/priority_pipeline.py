"""Input-gradient-first backward in a 2-rank 1F1B pipeline: upstream wait and step time.

Every B runs as I then W inside the action.  With ``input_first`` the nodes
leading to the stage input are marked by backward priority and the input
gradient's send is posted from inside the backward, the moment it exists;
without it, the send is posted by the SEND_B action after the whole B.  Both run in the same processes,
interleaved, on the runtime benchmark's model (8 x Linear(512,2048)-GELU-
Linear(2048,512), batch 64, 8 microbatches), one intra-op thread per rank.

    python benchmarks/priority_pipeline.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeropipe import build_schedule
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.core.ir import Kind
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions


def _rank(rank: int, world: int, reps: int, schedule: str) -> dict[str, Any]:
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    pipes = {
        flag: Pipeline(
            mlp_blocks(),
            build_schedule(schedule, ranks=world, microbatches=8),
            loss_fn=F.mse_loss,
            options=RuntimeOptions(input_first=flag),
        )
        for flag in (True, False)
    }
    out: dict[str, Any] = {str(f): {"step": [], "wait": []} for f in pipes}
    for k in range(reps + 3):
        for flag, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            step = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
            for p in pipe.parameters():
                p.grad = None
            if k >= 3:
                out[str(flag)]["step"].append(step.item())
                out[str(flag)]["wait"].append(pipe.last_waits.get(Kind.RECV_B, 0.0))
    return {f: {k: statistics.median(v) for k, v in d.items()} for f, d in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    res = launch(_rank, 2, args.reps, args.schedule, timeout=900)
    upstream = res[0]  # rank 0 waits for rank 1's input gradients
    on, off = upstream["True"], upstream["False"]
    print(f"{args.schedule}, 2 ranks over gloo, median of {args.reps} interleaved steps")
    print(f"{'':<28}{'input first':>12}{'send after B':>14}{'ratio':>8}")
    print(
        f"{'upstream wait for grads (s)':<28}{on['wait']:>12.4f}{off['wait']:>14.4f}{on['wait'] / off['wait']:>8.2f}"
    )
    print(
        f"{'step time (s)':<28}{on['step']:>12.4f}{off['step']:>14.4f}{on['step'] / off['step']:>8.2f}"
    )


if __name__ == "__main__":
    main()
