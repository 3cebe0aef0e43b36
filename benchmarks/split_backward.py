"""Benchmark: split backward (I then W) against one full backward B on the same stage.

Zero-bubble schedules only pay off if splitting the backward is (nearly)
free: I + W must cost about what B costs.  This script builds one pipeline
stage -- ``blocks`` x [x + Linear(h, f) -> GELU -> Linear(f, h)] -- and times,
in interleaved repetitions (the order rotates every repetition, so drift in
a shared machine's load hits every variant alike):

    B native     plain nn.Linear, ``out.backward(g)``            (the baseline)
    B prepared   prepare_split'ed stage, recorded, plain backward (full mode of the Function)
    I, W         prepared stage: ``stash.input_backward`` then ``stash.weight_backward``

and prints medians and the headline ratio (I + W) / B.  Forward times are
shown too (recording puts one custom autograd Function per linear) but are
not part of the ratio.

CPU runs use one intra-op thread (``--threads``), as every zeropipe benchmark.
Both wall time and this thread's CPU time are reported: on a machine shared
with other processes the latter is the steadier of the two.

On CPU with glibc malloc, ``--grads none`` (fresh ``.grad`` tensors every
time) can make W page in its gradient buffers afresh where B happens to
reuse freed heap memory: the "page faults" column shows it.  Compare with
``MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=1000000000`` in
the environment to see the split's own cost without that artefact.

    python benchmarks/split_backward.py                      # batch 8 x seq 8 x 512
    python benchmarks/split_backward.py --layout flat --batch 64
    python benchmarks/split_backward.py --grads keep          # later microbatches of a step
"""

from __future__ import annotations

import argparse
import copy
import gc
import resource
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from zeropipe.autograd.split_backward import WeightGradStash, prepare_split


class _Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def _stage(blocks: int, hidden: int, ffn: int) -> nn.Module:
    return nn.Sequential(*(_Block(hidden, ffn) for _ in range(blocks)))


def _zero(model: nn.Module, keep: bool) -> None:
    for p in model.parameters():
        if not keep:
            p.grad = None


_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _clock() -> tuple[float, float, int]:
    # Wall time; this thread's CPU time, which ignores time lost to other processes on a
    # shared machine (CPU autograd runs on the calling thread; one intra-op thread); and
    # minor page faults, which show when an action pays for fresh memory from the OS.
    return time.perf_counter(), time.thread_time(), resource.getrusage(_RUSAGE).ru_minflt


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["tokens", "flat"], default="tokens",
                    help="tokens: (batch, seq, hidden); flat: (batch, hidden)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8, help="ignored with --layout flat")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--grads", choices=["none", "keep"], default="none",
                    help="none: .grad reset to None before every backward (first microbatch "
                    "of a step); keep: gradients accumulate (later microbatches)")  # fmt: skip
    ap.add_argument("--no-fuse", action="store_true",
                    help="WeightGradStash(fuse_accumulation=False): autograd's mm-then-add_")  # fmt: skip
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def _max_grad_diff(native: nn.Module, prepared: nn.Module, x0: Tensor, g: Tensor) -> float:
    """Largest |grad(I+W) - grad(B)| over parameters and the input, from fresh gradients."""
    _zero(native, keep=False)
    _zero(prepared, keep=False)
    x_ref, x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    native(x_ref).backward(g)
    stash = WeightGradStash()
    with stash.recording(prepared):
        out = prepared(x)
    stash.input_backward(out, g)
    stash.weight_backward()
    pairs = [(x_ref, x), *zip(native.parameters(), prepared.parameters(), strict=True)]
    return max((a.grad - b.grad).abs().max().item() for a, b in pairs)  # type: ignore[operator]


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    native = _stage(args.blocks, args.hidden, args.ffn)
    prepared = prepare_split(copy.deepcopy(native))
    shape: tuple[int, ...] = (args.batch, args.hidden)
    if args.layout == "tokens":
        shape = (args.batch, args.seq, args.hidden)
    x0 = torch.randn(shape)
    g = torch.randn(shape)
    diff = _max_grad_diff(native, prepared, x0, g)
    keep = args.grads == "keep"
    names = ("F native", "F recorded", "B native", "B prepared", "I", "W", "I+W")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    faults: dict[str, list[float]] = {k: [] for k in names}
    held: list[int] = []

    def record(name: str, start: tuple[float, float, int], end: tuple[float, float, int]) -> None:
        wall[name].append(end[0] - start[0])
        cpu[name].append(end[1] - start[1])
        faults[name].append(end[2] - start[2])

    def run_native() -> None:
        _zero(native, keep)
        x = x0.clone().requires_grad_()
        c0 = _clock()
        out = native(x)
        c1 = _clock()
        out.backward(g)
        c2 = _clock()
        record("F native", c0, c1)
        record("B native", c1, c2)

    def run_prepared_full() -> None:
        _zero(prepared, keep)
        x = x0.clone().requires_grad_()
        stash = WeightGradStash()
        with stash.recording(prepared):
            out = prepared(x)
        c1 = _clock()
        out.backward(g)
        record("B prepared", c1, _clock())

    def run_split() -> None:
        _zero(prepared, keep)
        x = x0.clone().requires_grad_()
        stash = WeightGradStash(fuse_accumulation=not args.no_fuse)
        c0 = _clock()
        with stash.recording(prepared):
            out = prepared(x)
        c1 = _clock()
        stash.input_backward(out, g)
        c2 = _clock()
        held.append(stash.nbytes)
        c3 = _clock()
        stash.weight_backward()
        c4 = _clock()
        record("F recorded", c0, c1)
        record("I", c1, c2)
        record("W", c3, c4)
        wall["I+W"].append(wall["I"][-1] + wall["W"][-1])
        cpu["I+W"].append(cpu["I"][-1] + cpu["W"][-1])
        faults["I+W"].append(faults["I"][-1] + faults["W"][-1])

    variants: list[Callable[[], None]] = [run_native, run_prepared_full, run_split]
    gc.disable()  # a collection inside one timed region would land on one variant only
    try:
        for rep in range(args.warmup + args.reps):
            if rep == args.warmup:
                for series in (*wall.values(), *cpu.values(), *faults.values()):
                    series.clear()
            k = rep % len(variants)
            for run in variants[k:] + variants[:k]:
                run()
            gc.collect()
    finally:
        gc.enable()

    med_wall = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    print(
        f"split backward, stage = {args.blocks} x [Linear({args.hidden},{args.ffn})-GELU-"
        f"Linear({args.ffn},{args.hidden}) + residual], input {tuple(shape)} float32, "
        f"grads={args.grads}, fuse_accumulation={not args.no_fuse}"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
        f"{args.reps} interleaved repetitions after {args.warmup} warm-up, medians; "
        "cpu = this thread's CPU time"
    )
    print()
    print(f"{'action':<12} {'wall ms':>9} {'/B':>7} {'cpu ms':>9} {'/B':>7} {'page faults':>12}")
    for name in names:
        w, c = med_wall[name], med_cpu[name]
        print(
            f"{name:<12} {w:>9.3f} {w / med_wall['B native']:>7.3f} "
            f"{c:>9.3f} {c / med_cpu['B native']:>7.3f} "
            f"{statistics.median(faults[name]):>12.0f}"
        )
    print()
    print("(I+W)/B    ratio of medians   median of per-repetition ratios   (goal <= 1.10)")
    for label, med, runs in (("wall", med_wall, wall), ("cpu", med_cpu, cpu)):
        ratio = med["I+W"] / med["B native"]
        # Each repetition times B and I+W within ~0.1 s of each other, so their ratio is
        # barely touched by load that comes and goes on a shared machine.
        pairs = zip(runs["I+W"], runs["B native"], strict=True)
        paired = statistics.median([s / b for s, b in pairs])
        print(f"  {label:<4}     {ratio:>16.3f}   {paired:>31.3f}")
    print(f"held between I and W: {held[-1] / 2**20:.2f} MiB (stash.nbytes)")
    print(f"max |grad(I+W) - grad(B)| over parameters and input: {diff:.3g}")


if __name__ == "__main__":
    main()
