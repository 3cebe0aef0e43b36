"""Benchmark: when does a prioritised branch's gradient become available during backward?

The model has two branches from one input, joined by an add::

    x --> all-to-all --> expert Linear ---------------\
    x --> dense: layers x [Linear(width) -> GELU] -----+--> (a + b)^2 .mean()

The "all-to-all" is a stand-in (a custom autograd Function permuting rows
in forward and back); its backward is where a real MoE layer would start the
communication, so the sooner it runs, the more of the communication hides
behind the rest of backward.  The all-to-all branch is created first, so
plain autograd (last created, first run) reaches it only after the whole
dense branch.  ``prioritize(a, stop_at=x)`` marks it.

For each variant, in interleaved repetitions, the table gives medians of:
when the all-to-all's backward started and ended, and when the whole
backward ended, all relative to the ``backward()`` call, plus the
all-to-all's position among the nodes that ran.  Times come from node hooks
(``record_backward_order``), present in both variants alike.  Gradients of
the two variants are checked equal first.  One intra-op thread.

    python benchmarks/backward_order.py
    python benchmarks/backward_order.py --layers 8 --width 1024 --reps 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from zeropipe.autograd.priority import prioritize, record_backward_order


class _FakeAllToAll(torch.autograd.Function):
    """Rows permuted forward, un-permuted backward: the shape of an all-to-all, no comm."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, perm: Tensor) -> Tensor:
        ctx.save_for_backward(perm)
        return x[perm]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        (perm,) = ctx.saved_tensors
        out = torch.empty_like(g)
        out[perm] = g
        return out, None


class _Model(nn.Module):
    def __init__(self, layers: int, width: int, batch: int) -> None:
        super().__init__()
        self.expert = nn.Linear(width, width)
        dense: list[nn.Module] = []
        for _ in range(layers):
            dense += [nn.Linear(width, width), nn.GELU()]
        self.dense = nn.Sequential(*dense)
        self.register_buffer("perm", torch.randperm(batch))

    def forward(self, x: Tensor, *, early: bool) -> tuple[Tensor, Tensor]:
        routed = _FakeAllToAll.apply(x, self.perm)
        a = self.expert(routed)  # created first: runs last unless marked
        b = self.dense(x)
        if early:
            prioritize(a, stop_at=x)
        return (a + b).square().mean(), routed


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    return ap.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _Model(args.layers, args.width, args.batch)
    x = torch.randn(args.batch, args.width, requires_grad=True)

    def once(early: bool) -> tuple[float, float, float, int, int, list[Tensor]]:
        for p in model.parameters():
            p.grad = None
        x.grad = None
        loss, routed = model(x, early=early)
        with record_backward_order(loss) as rec:
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
        e = rec.event(routed)
        end = e.end if e.end is not None else e.start
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return e.start - t0, end - t0, t1 - t0, rec.position(routed), len(rec), grads

    plain, early = once(False)[-1], once(True)[-1]
    if not all(torch.equal(a, b) for a, b in zip(plain, early, strict=True)):
        raise SystemExit("prioritize changed the gradients")

    rows: dict[str, list[tuple[float, float, float, int, int]]] = {"plain": [], "prioritize": []}
    for rep in range(args.warmup + args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        for flag in order:
            r = once(flag)[:5]
            if rep >= args.warmup:
                rows["prioritize" if flag else "plain"].append(r)

    print(
        f"backward order: all-to-all branch vs dense {args.layers} x Linear({args.width}) + GELU, "
        f"batch {args.batch}, {args.reps} reps (median), intra-op threads {args.threads}, "
        f"torch {torch.__version__}"
    )
    print(
        f"{'variant':<11} {'a2a start ms':>13} {'a2a done ms':>12} {'backward ms':>12} "
        f"{'a2a done / bwd':>15} {'a2a node #':>11}"
    )
    for name, rs in rows.items():
        start = statistics.median(r[0] for r in rs)
        done = statistics.median(r[1] for r in rs)
        total = statistics.median(r[2] for r in rs)
        pos, n = rs[0][3], rs[0][4]
        print(
            f"{name:<11} {start * 1e3:>13.2f} {done * 1e3:>12.2f} {total * 1e3:>12.1f} "
            f"{done / total:>15.2f} {f'{pos + 1}/{n}':>11}"
        )


if __name__ == "__main__":
    main()
