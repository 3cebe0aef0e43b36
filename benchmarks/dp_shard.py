"""Benchmark: replicated vs FSDP2-sharded data parallel, 2 pipeline ranks x 2 replicas on CPU.

Four processes (zeropipe.launch, gloo, one intra-op thread each) run the same
MLP under the same schedule twice over, once with ``Pipeline(mesh=...)``
(replicated stages, REDUCE_GRAD all-reduces) and once with ``dp_shard=True``
(FSDP2: all-gather at step start, reduce-scatter at REDUCE_GRAD).  Steps of
the two alternate, so that drift on a shared machine hits both alike; each
step time is the slowest rank's.  Also printed: parameter + gradient bytes a
rank holds between steps (what sharding saves; optimizer state would follow
the parameters).

    python benchmarks/dp_shard.py
    python benchmarks/dp_shard.py --width 512 --layers 8 --steps 10 --schedule zbv
"""

from __future__ import annotations

import argparse
import functools
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

PP, DP = 2, 2


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks)


def _held_bytes(pipe: Pipeline) -> int:
    total = 0
    for p in pipe.parameters():
        for t in (p, p.grad):
            if t is not None:
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


def _run(rank: int, world: int, args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    dp = mesh.get_local_rank("dp")
    pipes = {}
    for mode in ("replicated", "sharded"):
        model = _model(args.width, args.blocks)
        pipes[mode] = Pipeline(
            model,
            args.schedule,
            loss_fn=F.mse_loss,
            microbatches=args.microbatches,
            mesh=mesh,
            options=RuntimeOptions(dp_shard=mode == "sharded"),
        )
    g = torch.Generator().manual_seed(1)
    rows = args.rows * args.microbatches
    x = torch.randn(DP * rows, args.width, generator=g)
    y = torch.randn(DP * rows, args.width, generator=g)
    xs, ys = torch.tensor_split(x, DP)[dp], torch.tensor_split(y, DP)[dp]
    times: dict[str, list[float]] = {m: [] for m in pipes}
    losses: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        for mode, pipe in pipes.items():
            for p in pipe.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            loss = pipe.step(xs, ys)
            took = time.perf_counter() - start
            if step >= args.warmup:
                times[mode].append(took)
            losses[mode] = loss.item()
    return {"times": times, "held": {m: _held_bytes(p) for m, p in pipes.items()}, "loss": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks (2 linears each)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    out = launch(functools.partial(_run, args=args), PP * DP, timeout=600)
    params = sum(p.numel() for p in _model(args.width, args.blocks).parameters())
    print(
        f"{PP} pp x {DP} dp, gloo on CPU, 1 intra-op thread per rank; MLP {args.blocks} x "
        f"({args.width} -> {4 * args.width} -> {args.width}), {params / 1e6:.2f} M float32 "
        f"parameters; {args.schedule}, {args.microbatches} microbatches of {args.rows} rows per "
        f"replica; median of {args.steps} steps (slowest rank per step), {args.warmup} warm-up"
    )
    print(f"{'mode':<11} {'median step ms':>15} {'min ms':>8} {'held MiB/rank':>14} {'loss':>10}")
    medians = {}
    for mode in ("replicated", "sharded"):
        per_step = [max(o["times"][mode][k] for o in out) for k in range(args.steps)]
        medians[mode] = statistics.median(per_step)
        held = max(o["held"][mode] for o in out) / 2**20
        loss = out[0]["loss"][mode]
        print(
            f"{mode:<11} {medians[mode] * 1e3:>15.2f} {min(per_step) * 1e3:>8.2f} "
            f"{held:>14.2f} {loss:>10.6f}"
        )
    print(f"sharded / replicated step time: {medians['sharded'] / medians['replicated']:.2f}")


if __name__ == "__main__":
    main()
