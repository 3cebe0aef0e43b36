"""Benchmark: pipeline x data parallel, the gradient reduction overlapped with compute or not.

Four processes on gloo (``zeropipe.launch``, one intra-op thread each), mesh
(pp=2, dp=2).  Per model and schedule, three ways of running the same
per-replica batch, their steps interleaved so that load drift hits all alike:

    2x1       the two replicas' pipelines run alone (no dp group): no reduction
    2x2       dp group: each stage's REDUCE_GRAD posted right after its last
              backward on its rank, in flight while the rank computes on
    2x2 end   the same schedule with every REDUCE_GRAD moved to the end of its
              rank's actions: the reductions start only when the rank's compute is
              over (for 1f1b, one stage per rank, that is where they already are:
              the row measures the same schedule twice; zbv's first stage on a rank
              finishes well before its second)

The table gives median step time (slowest rank), the ratios to 2x1, and,
for 2x2, how much of the reductions' time ran while the pipeline still
computed (``hidden``: the part of each reduction's [post, done] before the
last compute action of any rank ended, summed over every rank's
reductions, over their total duration).
Models: ``mlp`` (zeropipe.apps.models.mlp_blocks, 8 blocks) and ``gpt`` (the
reference transformer, Attention and MLP halves).

On a machine with fewer cores than processes (4 here), 2x1 and 2x2 do not
run on the same compute: compare 2x2 with 2x2 end, and read 2x2 / 2x1 as
what the reduction costs there, not what it would cost on 4 devices::

    python benchmarks/data_parallel.py [--steps 12] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.apps.models.gpt import GPTConfig, gpt, lm_loss
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

SCHEDULES = ("1f1b", "zbv")
WAYS = ("2x1", "2x2", "2x2 end")


def _model(name: str) -> tuple[nn.Sequential, Any, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = mlp_blocks(8, 256, 1024)
        x = torch.randn(32, 256, generator=g)
        return model, F.mse_loss, x, torch.randn(32, 256, generator=g)
    cfg = GPTConfig(vocab=256, seq=64, width=128, heads=4, layers=4, dropout=0.0)
    tokens = torch.randint(0, cfg.vocab, (16, cfg.seq + 1), generator=g)
    return gpt(cfg), lm_loss, tokens[:, :-1], tokens[:, 1:]


def _at_end(schedule: Schedule) -> Schedule:
    """Every REDUCE_GRAD moved after its rank's last action: no overlap with compute."""
    return schedule.replace_actions(
        [
            [a for a in acts if a.kind is not Kind.REDUCE_GRAD]
            + [a for a in acts if a.kind is Kind.REDUCE_GRAD]
            for acts in schedule.actions
        ]
    )


def _hidden(pipe: Pipeline) -> tuple[float, float]:
    """(seconds of reduction before the pipeline's compute ended, seconds of reduction in all),
    summed over every rank: the end is the last compute action of any rank of either replica
    (events carry perf_counter times, one clock for every process on a machine)."""
    reducer = pipe.parts.reducer
    assert reducer is not None
    events = pipe.last_events[pipe.rank]
    end = torch.tensor(
        [max(e.end for e in events if e.action.kind in (Kind.F, Kind.B, Kind.I, Kind.W))],
        dtype=torch.float64,
    )
    dist.all_reduce(end, op=dist.ReduceOp.MAX)
    compute_end = end.item()
    sums = torch.zeros(2, dtype=torch.float64)
    for red in reducer.last:
        if red.done:
            done = max(red.done)
            sums[0] += max(0.0, min(done, compute_end) - red.posted)
            sums[1] += done - red.posted
    dist.all_reduce(sums)
    return sums[0].item(), sums[1].item()


def _rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group = mesh.get_group("pp")
    dp = mesh.get_local_rank("dp")
    rows = []
    for model_name in ("mlp", "gpt"):
        for name in SCHEDULES:
            model, loss_fn, x, y = _model(model_name)
            m = args.microbatches
            built = build_schedule(name, ranks=2, microbatches=m, reduce_grad=True)
            pipes = {
                "2x1": Pipeline(model, name, loss_fn=loss_fn, microbatches=m, mesh=pp_group),
                "2x2": Pipeline(model, built, loss_fn=loss_fn, mesh=mesh),
                "2x2 end": Pipeline(model, _at_end(built), loss_fn=loss_fn, mesh=mesh),
            }  # fmt: skip
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            hidden: list[tuple[float, float]] = []
            for step in range(args.steps + 1):
                for k in range(len(WAYS)):
                    way = WAYS[(step + k) % len(WAYS)]
                    model.zero_grad(set_to_none=True)
                    dist.barrier()
                    start = time.perf_counter()
                    pipes[way].step(x, y)
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if step == 0:
                        continue  # boundary shapes learnt, memory first touched
                    times[way].append(took.item())
                    if way == "2x2":
                        hidden.append(_hidden(pipes[way]))
            h = sum(a for a, _ in hidden) / max(1e-12, sum(b for _, b in hidden))
            rows.append(
                {
                    "model": model_name,
                    "schedule": name,
                    **{w: statistics.median(times[w]) for w in WAYS},
                    "hidden": h,
                    "rank": rank,
                    "pp": mesh.get_local_rank("pp"),
                    "dp": dp,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per way")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    results = launch(_rank, 4, args, timeout=1800.0)
    print(f"torch {torch.__version__}, 4 processes on gloo, mesh pp=2 x dp=2, m={args.microbatches},"
          f" {args.steps} timed steps, medians (ms)")  # fmt: skip
    print(f"{'model':6} {'schedule':9} {'2x1':>8} {'2x2':>8} {'2x2 end':>8} "
          f"{'2x2/2x1':>8} {'end/2x2':>8} {'hidden':>7}")  # fmt: skip
    for row in results[0]:
        print(
            f"{row['model']:6} {row['schedule']:9} {1e3 * row['2x1']:8.1f} "
            f"{1e3 * row['2x2']:8.1f} {1e3 * row['2x2 end']:8.1f} "
            f"{row['2x2'] / row['2x1']:8.2f} {row['2x2 end'] / row['2x2']:8.2f} "
            f"{row['hidden']:7.0%}"
        )


if __name__ == "__main__":
    main()
