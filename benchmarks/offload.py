"""Benchmark: the step-time cost of weight offload and of activation offload, with prefetch.

One device, one process, a model of ``--stages`` stages of ``--layers``
[Linear(h, h) -> GELU] layers, float32, run as ``looped-bfs`` on one rank
(every microbatch through stage 0, then stage 1, ...: fairscale
OffloadModel's order).  Variants, repetitions interleaved (the order rotates)::

    resident       the whole model on the device, nothing moves
    W-offload p1   offload_weights(prefetch=1): the model lives on the host; each stage's
                   weights are reloaded one compute action ahead, on the copy stream
    W-offload p0   offload_weights(prefetch=0): reloaded right before use (the copy is
                   exposed; shows what prefetch buys)
    A-offload p1   the resident model, every (stage, microbatch)'s saved activations
                   offloaded after F and reloaded one compute action before its backward

Printed: median step time, its ratio to ``resident`` (goals: W-offload p1 <= 1.10,
A-offload p1 <= 1.05), the peak bytes of weights resident on the device
(the runtime's accounting) and, on an accelerator, the allocator's peak
during the step above what was allocated before it.  With ``--cap-gib`` the
weight-offload variants run under
``set_per_process_memory_fraction`` so that the process may not hold the
whole model: the cap is on what a weight-offload step allocates beyond what the
other variants' resident models already hold in the process.

    python benchmarks/offload.py                                  # CPU smoke run, small sizes
    python benchmarks/offload.py --device cuda                    # hidden 4096, 8 stages x 2
    python benchmarks/offload.py --device cuda --cap-gib 0.75 --only weights
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zeropipe import RuntimeOptions
from zeropipe.base.device import (
    allocated_bytes,
    is_accelerator,
    peak_allocated_bytes,
    reset_peak_bytes,
)
from zeropipe.core.ir import Schedule
from zeropipe.core.passes.fit import offload, offload_weights
from zeropipe.core.schedules import generate
from zeropipe.runtime.pipeline import Pipeline


def _model(stages: int, layers: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(stages * layers)]
    )


def _sync(device: torch.device) -> None:
    if is_accelerator(device):
        torch.get_device_module(device.type).synchronize(device)


def _timed(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    for p in pipe.parameters():
        p.grad = None  # as optimizer.zero_grad() does between steps
    _sync(device)
    start = time.perf_counter()
    pipe.step(x, y)
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096 (GPU), 128 (CPU)")
    parser.add_argument("--rows", type=int, default=None, help="rows per microbatch")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="Linear+GELU layers per stage")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--only", choices=["weights", "activations"], default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    accel = is_accelerator(device)
    hidden = args.hidden or (4096 if accel else 128)
    rows = args.rows or (1024 if accel else 32)
    m = args.microbatches
    base = generate("looped-bfs", 1, m, chunks=args.stages)
    x = torch.randn(rows * m, hidden)
    y = torch.randn(rows * m, hidden)

    variants: dict[str, Schedule] = {"resident": base}
    if args.only != "activations":
        variants["W-offload p1"] = offload_weights(base, prefetch=1)
        variants["W-offload p0"] = offload_weights(base, prefetch=0)
    if args.only != "weights":
        variants["A-offload p1"] = offload(base, prefetch=1)
    model_bytes = 0
    pipes: dict[str, Pipeline] = {}
    for name, schedule in variants.items():
        model = _model(args.stages, args.layers, hidden)  # built on the host
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Weight offload keeps the model on the host (pinned); the others move it to the device.
        pipes[name] = Pipeline(
            model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(device=device)
        )
    total = (
        torch.get_device_module(device.type).get_device_properties(device).total_memory
        if accel
        else 0
    )

    def run(name: str) -> tuple[float, int | None]:
        pipe = pipes[name]
        mod = torch.get_device_module(device.type) if accel else None
        capped = args.cap_gib is not None and mod is not None and name.startswith("W-")
        before = allocated_bytes(device)
        if capped and mod is not None:
            # The other variants' resident models stay allocated in this process: the cap
            # is on what this step may allocate beyond them.
            mod.empty_cache()
            mod.set_per_process_memory_fraction(
                min(1.0, ((before or 0) + args.cap_gib * 2**30) / total), device
            )
        try:
            reset_peak_bytes(device)
            seconds = _timed(pipe, x.to(device), y.to(device), device)
            peak = peak_allocated_bytes(device)
        finally:
            if capped and mod is not None:
                mod.set_per_process_memory_fraction(1.0, device)
        above = None if peak is None or before is None else peak - before
        return seconds, above

    names = list(pipes)
    for name in names:  # warm up: allocator, copy stream, pinned buffers, kernels
        run(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int | None] = {}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            seconds, above = run(name)
            times[name].append(seconds)
            peaks[name] = above

    print(
        f"device {device}  hidden {hidden}  rows/microbatch {rows}  microbatches {m}  "
        f"stages {args.stages} x {args.layers} layers  model {model_bytes / 2**20:.0f} MiB  "
        f"reps {args.reps}" + ("  (CPU: 1 intra-op thread)" if device.type == "cpu" else "")
    )
    if args.cap_gib is not None and accel:
        print(
            f"weight-offload steps capped at {args.cap_gib} GiB of device memory beyond what "
            f"the other variants hold (set_per_process_memory_fraction)"
        )
    goals: dict[str, float] = {"W-offload p1": 1.10, "A-offload p1": 1.05}
    ref = statistics.median(times["resident"])
    header = f"{'variant':<14} {'median ms':>10} {'ratio':>7} {'goal':>6} {'weights MiB':>12}"
    print(header + f" {'device peak MiB':>16}")
    fmt: Callable[[int | None], str] = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    for name in names:
        med = statistics.median(times[name])
        goal = goals.get(name)
        resident = max(pipes[name].memory.report.weights)
        print(
            f"{name:<14} {med * 1e3:>10.2f} {med / ref:>7.3f} "
            f"{'' if goal is None else f'<={goal:.2f}':>6} {fmt(resident):>12} "
            f"{fmt(peaks.get(name)):>16}"
        )


if __name__ == "__main__":
    main()
