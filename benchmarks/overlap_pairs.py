"""Benchmark: dualpipev's overlapped pairs run at once against one half after the other.

``RuntimeOptions(overlap=True)`` runs each ``(aFj;bBk)`` pair's forward and backward at
the same time (the backward on a second thread); ``overlap=False`` runs them in sequence.
Both pipelines live in the same process(es), built on identical copies of the model,
and their steps alternate, so load drift hits both alike.  Step time is the wall time
of ``pipe.step`` (over gloo: the slowest rank's); the table gives medians and the
ratio on / off, for an MLP and a transformer block, in one process (every rank played
by one executor) and on 2 gloo processes (one per rank), without and with an emulated
slow link::

    python benchmarks/overlap_pairs.py [--reps 15] [--delay-ms 3] [--microbatches 8]

The emulated slow link (:class:`SlowLink`) stands for a link between nodes: it wraps
a pipeline's transport, stamps every sent payload with the sender's clock, and makes
the receiver's wait end no earlier than ``delay`` after the send (the clock,
``time.monotonic``, is one for every process of a machine).  It delays each transfer
by a fixed latency, as a cross-node hop would; it does not model bandwidth.  Its
receive waits may run at once in a pair when the transport it wraps allows that.

Each rank computes with one intra-op thread; a pair adds a second thread per rank.
On a machine with fewer cores than ranks x 2 threads (the 2-core machine this was
written on runs 2 ranks x 2 threads) the halves of a pair compete for cores: what
overlap can win there is the time one half waits for data (the slow link), not
compute run side by side.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe import RuntimeOptions
from zeropipe.core.ir import Action, Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.runtime.step.executor import LocalTransport
from zeropipe.runtime.transport.base import Transport
from zeropipe.runtime.transport.tagged import DistributedTransport


class SlowLink:
    """A transport whose every transfer arrives ``delay`` seconds after it was sent.

    The sender appends its clock (a float64 scalar) to the payload; the receiver
    removes it and, once the data is in, sleeps until that time plus ``delay``.
    Everything else is the wrapped transport's.
    """

    def __init__(self, inner: Transport, delay: float) -> None:
        self._inner, self._delay = inner, delay
        # Waits may run at once where the wrapped transport's may: the sleep is this wait's own.
        self.concurrent_waits = isinstance(inner, (LocalTransport, DistributedTransport))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def start_step(self, schedule: Schedule, signature: Hashable, step: int | None = None) -> None:
        self._inner.start_step(schedule, signature, step)

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        stamp = torch.tensor([time.monotonic()], dtype=torch.float64)
        self._inner.send(action, (*tensors, stamp))

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        *data, stamp = self._inner.wait_recv(action)
        late = float(stamp[0]) + self._delay - time.monotonic()
        if late > 0:
            time.sleep(late)
        return tuple(data)


# -- the models --------------------------------------------------------------------
class Block(nn.Module):
    """A transformer block: attention and an MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _mlp() -> tuple[nn.Sequential, tuple[int, ...]]:
    width = 256
    blocks = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(8)
    ]
    return nn.Sequential(*blocks), (32, width)  # rows per microbatch


def _transformer() -> tuple[nn.Sequential, tuple[int, ...]]:
    return nn.Sequential(*[Block(128, 4) for _ in range(4)]), (4, 64, 128)


MODELS: dict[str, Callable[[], tuple[nn.Sequential, tuple[int, ...]]]] = {
    "mlp": _mlp,
    "transformer": _transformer,
}


def _pipes(name: str, microbatches: int, delay: float) -> tuple[dict[bool, Pipeline], Tensor]:
    """The overlap-on and -off pipelines on identical copies of ``name``, and a batch."""
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    schedule = build_schedule("dualpipev", ranks=2, microbatches=microbatches)
    pipes = {}
    for overlap in (True, False):
        options = RuntimeOptions(overlap=overlap, p2p="tagged")
        pipe = Pipeline(copy.deepcopy(model), schedule, loss_fn=F.mse_loss, options=options)
        if delay > 0:
            pipe.parts = replace(pipe.parts, transport=SlowLink(pipe.parts.transport, delay))
        pipes[overlap] = pipe
    return pipes, torch.randn(shape[0] * microbatches, *shape[1:])


def _timed(
    pipes: dict[bool, Pipeline], x: Tensor, reps: int, barrier: Callable[[], None]
) -> dict[bool, list[float]]:
    """Per overlap setting: the wall time of each of ``reps`` steps, the two alternating."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps + 2):  # two warm-up steps each: shapes learnt, memory touched
        for overlap in (True, False) if rep % 2 else (False, True):
            barrier()
            start = time.perf_counter()
            pipes[overlap].step(x, x)
            took = time.perf_counter() - start
            if rep >= 2:
                times[overlap].append(took)
    return times


def _cases(delays: Sequence[float]) -> list[tuple[str, float]]:
    return [(name, d) for name in MODELS for d in delays]


def _run_local(
    args: argparse.Namespace, delays: Sequence[float]
) -> list[tuple[str, float, dict[bool, list[float]]]]:
    torch.set_num_threads(1)
    out = []
    for name, delay in _cases(delays):
        pipes, x = _pipes(name, args.microbatches, delay)
        out.append((name, delay, _timed(pipes, x, args.reps, lambda: None)))
    return out


def _gloo_rank(
    rank: int, world: int, reps: int, microbatches: int, delays: Sequence[float]
) -> list[Any]:
    out = []
    for name, delay in _cases(delays):
        pipes, x = _pipes(name, microbatches, delay)
        times = _timed(pipes, x, reps, dist.barrier)
        # The step of the slowest rank.
        slowest = {}
        for overlap, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[overlap] = t.tolist()
        out.append((name, delay, slowest))
    return out


def _print(where: str, rows: list[tuple[str, float, dict[bool, list[float]]]]) -> None:
    for name, delay, times in rows:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        link = f"{delay * 1e3:.0f} ms" if delay > 0 else "none"
        print(
            f"{where:<7} {name:<12} {link:>9} {off * 1e3:>10.2f} {on * 1e3:>10.2f} {on / off:>8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed steps per setting")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=3.0, help="the emulated link's delay")
    args = parser.parse_args()
    delays = (0.0, args.delay_ms / 1e3)
    print(
        f"dualpipev, 2 ranks, {args.microbatches} microbatches; median step of {args.reps} "
        f"alternating steps; ratio = on / off (below 1: overlap is faster)"
    )
    print(
        f"{'where':<7} {'model':<12} {'slow link':>9} {'off (ms)':>10} {'on (ms)':>10} {'ratio':>8}"
    )
    _print("local", _run_local(args, delays))
    rows = launch(_gloo_rank, 2, args.reps, args.microbatches, delays, threads=1, timeout=900.0)
    _print("gloo", rows[0])


if __name__ == "__main__":
    main()
