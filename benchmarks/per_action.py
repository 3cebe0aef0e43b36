"""Benchmark: what the runtime itself costs per action, on stages that do almost nothing.

Every stage is one ``nn.Linear(16, 16)`` and every microbatch one row, so an
action's measured time is the runtime's own work (dispatch, bookkeeping, the
recording linear, posting a transfer) plus a few microseconds of arithmetic.
The same arithmetic without a pipeline (forward, and forward + backward, of
that linear on that row) is timed beside it and printed as "plain PyTorch".

Two runs, each a 2-rank pipeline:

    local        one process plays both ranks (no transfers)
    distributed  one process per rank over gloo, one intra-op thread each

The figures are medians over every action of a kind in ``--steps`` steps:
F, B (1f1b, ``group_w=1``), I and W (zb-h1), the post of each SEND / RECV,
and "between actions": from one action's end to the next one's start on a
rank (the executor's loop).  Distributed F and B are counted only on the
stage that receives nothing (stage 0's F, the last stage's B): elsewhere they
include the wait for the peer.  The step's share outside the actions
(splitting the batch, the end-of-step barrier) is "per step, outside actions".

A second table puts the whole runtime beside torch's on one stage (no
transfers): a step of 1f1b over 8 microbatches of the tiny MLP that
``zeropipe bench --blocks 4 --width 64 --hidden 128`` runs (4 blocks of
Linear(64, 128) - GELU - Linear(128, 64), batch 64), zeropipe's ``Pipeline``
against torch's ``Schedule1F1B`` and a plain loop over the microbatches, in one
process, interleaved, median of ``--steps`` steps.

    python benchmarks/per_action.py
    python benchmarks/per_action.py --steps 400 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from zeropipe import build_schedule
from zeropipe.apps.models.mlp import mlp_blocks
from zeropipe.core.ir import Kind
from zeropipe.core.simulate import Event
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

WIDTH = 16
MICROBATCHES = 8
ROWS = [
    ("F", "F"),
    ("B", "B"),
    ("I", "I"),
    ("W", "W"),
    ("SEND_F", "SEND_F post"),
    ("SEND_B", "SEND_B post"),
    ("RECV_F", "RECV_F post"),
    ("RECV_B", "RECV_B post"),
    ("gap", "between actions (local: any rank)"),
    ("outside", "per step, outside actions"),
]


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)]


def _measure(schedule: str, steps: int, distributed: bool) -> dict[str, list[float]]:
    """Per kind, the durations (seconds) of this process's actions over ``steps`` steps."""
    pipe = Pipeline(
        _stages(),
        build_schedule(schedule, ranks=2, microbatches=MICROBATCHES),
        F.mse_loss,
        mesh=None if distributed else "local",
    )
    x, y = torch.randn(MICROBATCHES, WIDTH), torch.randn(MICROBATCHES, WIDTH)
    params = pipe.parameters()
    found: dict[str, list[float]] = {}
    for k in range(steps + steps // 10):
        t0 = time.perf_counter()
        pipe.step(x, y)
        wall = time.perf_counter() - t0
        for p in params:
            p.grad = None
        if k < steps // 10:  # warm-up
            continue
        lanes = [sorted(lane, key=lambda e: e.start) for lane in pipe.last_events if lane]
        for events in lanes:
            for e in events:
                if _counted(e, distributed, pipe.schedule.num_stages):
                    found.setdefault(e.action.kind.value, []).append(e.end - e.start)
            found.setdefault("gap", []).extend(b.start - a.end for a, b in pairwise(events))
        span = max(ev[-1].end for ev in lanes) - min(ev[0].start for ev in lanes)
        found.setdefault("outside", []).append(wall - span)
    return found


def _counted(e: Event, distributed: bool, stages: int) -> bool:
    if not distributed:
        return True
    kind, s = e.action.kind, e.action.stage
    if kind is Kind.F:
        return s == 0
    if kind in (Kind.B, Kind.I):
        return s == stages - 1
    return True


def _plain(reps: int) -> dict[str, float]:
    """The same arithmetic with no pipeline: a Linear(16, 16) forward and backward on one row."""
    lin = _stages()[0]
    x = torch.randn(1, WIDTH, requires_grad=True)
    g = torch.randn(1, WIDTH)

    def fwd() -> None:
        lin(x)

    def both() -> None:
        torch.autograd.backward(lin(x), g)
        lin.weight.grad = lin.bias.grad = x.grad = None

    return {"F": _median(fwd, reps), "F+B": _median(both, reps)}


def _median(fn: Callable[[], None], reps: int) -> float:
    for _ in range(reps // 10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _merge(parts: list[dict[str, list[float]]]) -> dict[str, float]:
    merged: dict[str, list[float]] = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return {key: statistics.median(values) for key, values in merged.items() if values}


def _local(steps: int) -> dict[str, float]:
    return _merge([_measure(name, steps, False) for name in ("1f1b", "zb-h1")])


def _rank_main(rank: int, world: int, steps: int) -> list[dict[str, list[float]]]:
    return [_measure(name, steps, True) for name in ("1f1b", "zb-h1")]


def _distributed(steps: int) -> dict[str, float]:
    results: list[list[dict[str, list[float]]]] = launch(_rank_main, 2, steps, threads=1)
    return _merge([part for rank in results for part in rank])


def _one_stage_rank(rank: int, world: int, steps: int) -> dict[str, float]:
    """One process: a 1f1b step of the tiny MLP under zeropipe, torch, and a plain loop."""
    from torch.distributed import pipelining

    x, y = torch.randn(64, 64), torch.randn(64, 64)
    ours, theirs = mlp_blocks(4, 64, 128), mlp_blocks(4, 64, 128)
    pipe = Pipeline(
        ours,
        build_schedule("1f1b", ranks=1, microbatches=MICROBATCHES, group_w=1),
        loss_fn=F.mse_loss,
    )
    stage = pipelining.PipelineStage(theirs, 0, 1, torch.device("cpu"))
    sched = pipelining.Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)

    def zeropipe_step() -> None:
        pipe.step(x, y)
        ours.zero_grad(set_to_none=True)

    def torch_step() -> None:
        sched.step(x, target=y, losses=[])
        theirs.zero_grad(set_to_none=True)

    def plain_step() -> None:
        for xi, yi in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
            torch.autograd.backward(F.mse_loss(theirs(xi), yi) / MICROBATCHES)
        theirs.zero_grad(set_to_none=True)

    runs = {
        "zeropipe Pipeline": zeropipe_step,
        "torch Schedule1F1B": torch_step,
        "plain loop": plain_step,
    }
    found: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):  # interleaved blocks, so drift hits all alike
        for name, fn in runs.items():
            found[name].append(_median(fn, steps))
    return {name: statistics.median(times) for name, times in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps per schedule")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plain = _plain(args.steps * 10)
    local = _local(args.steps)
    dist_ = _distributed(args.steps)
    one_stage: dict[str, float] = launch(_one_stage_rank, 1, args.steps, threads=1)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "local_s": local,
                    "distributed_s": dist_,
                    "plain_s": plain,
                    "one_stage_s": one_stage,
                }
            )
        )
        return 0
    ref = {"F": plain["F"], "B": plain["F+B"] - plain["F"]}
    print(
        f"runtime cost per action: 2 stages of Linear({WIDTH},{WIDTH}), {MICROBATCHES} one-row "
        f"microbatches, 2 ranks, 1 intra-op thread, median over {args.steps} steps per schedule "
        "(1f1b for F/B, zb-h1 for I/W), microseconds"
    )
    print(f"\n{'action':<36}{'local':>10}{'gloo, 2 ranks':>16}{'plain PyTorch':>16}")
    for key, label in ROWS:
        cells = [_cell(local.get(key)), _cell(dist_.get(key)), _cell(ref.get(key))]
        print(f"{label:<36}{cells[0]:>10}{cells[1]:>16}{cells[2]:>16}")
    base = one_stage["plain loop"]
    print(
        f"\none stage, 1f1b over {MICROBATCHES} microbatches of 4 x Linear(64,128)-GELU-"
        f"Linear(128,64), batch 64, one process, median step (ms) and over the plain loop"
    )
    for name, seconds in one_stage.items():
        print(f"{name:<36}{seconds * 1e3:>10.3f}{seconds / base:>16.2f}")
    return 0


def _cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
