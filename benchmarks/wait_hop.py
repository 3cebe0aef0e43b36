"""Benchmark: what waiting for a transfer costs, on the calling thread and through zeropipe.

Two processes over gloo play ping-pong with one small tensor; each side posts
its receive, waits for it, and answers.  The round trip is timed two ways, in
alternating blocks within one launch:

    calling thread   ``work.wait()`` where the data is needed, as torch's
                     schedules wait (a failed peer that stays alive is noticed
                     only at gloo's own timeout)
    zeropipe         the runtime's :class:`~zeropipe.runtime.transport.endpoint.Endpoint`: a
                     pool thread blocks in ``work.wait()`` and hands the result
                     over; the caller waits in slices, checking for failed peers
    zeropipe, landing  as the runtime waits for a receive: its buffer marked
                     before it is posted (``_compat.mark_landing``), the data
                     looked for up to 50 us with the core yielded, then waited
                     on here if it landed, else through the pool as above

A round trip has a wait on each side's receive on its critical path, and
each side then waits for its own send.  Medians of the round trip.

    python benchmarks/wait_hop.py
    python benchmarks/wait_hop.py --reps 4000 --kib 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from zeropipe.base import _compat
from zeropipe.runtime.launch import launch
from zeropipe.runtime.transport.endpoint import Endpoint, connect

MODES = ("calling thread", "zeropipe", "zeropipe, landing")


def _wait(mode: str, endpoint: Endpoint, work: Any, peer: int, landing: int | None = None) -> None:
    if mode == "calling thread":
        work.wait()
    else:
        pending = endpoint.pending([work], [("the ping-pong", peer)])
        endpoint.wait(pending, landing=landing if mode == "zeropipe, landing" else None)


def _worker(rank: int, world: int, reps: int, numel: int) -> dict[str, list[float]]:
    endpoint = connect(rank, None, 60.0)
    peer = 1 - rank
    x, buf = torch.ones(numel), torch.zeros(numel)
    out: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _block in range(3):
        for mode in MODES:
            times = []
            for k in range(reps):
                if k % 100 == 0:
                    dist.barrier()
                t0 = time.perf_counter()
                landing = _compat.mark_landing(buf)
                if rank == 0:
                    sent = dist.isend(x, peer, tag=1)
                    got = dist.irecv(buf, peer, tag=2)
                    _wait(mode, endpoint, got, peer, landing)
                else:
                    got = dist.irecv(buf, peer, tag=1)
                    _wait(mode, endpoint, got, peer, landing)
                    sent = dist.isend(x, peer, tag=2)
                _wait(mode, endpoint, sent, peer)
                times.append(time.perf_counter() - t0)
            out[mode].append(statistics.median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2000, help="round trips per block")
    ap.add_argument("--kib", type=int, default=2, help="payload (KiB)")
    args = ap.parse_args()
    numel = max(1, args.kib * 1024 // 4)
    result = launch(_worker, 2, args.reps, numel, threads=1)[0]
    print(
        f"wait cost: gloo ping-pong of {args.kib} KiB between 2 processes, 1 intra-op thread "
        f"each; median round trip of {args.reps}, in 3 blocks per way, alternating"
    )
    medians = {mode: statistics.median(result[mode]) for mode in MODES}
    for mode in MODES:
        blocks = " ".join(f"{t * 1e6:.1f}" for t in result[mode])
        print(f"{mode:16} {medians[mode] * 1e6:8.1f} us   (blocks: {blocks})")
    for mode in MODES[1:]:
        extra = medians[mode] - medians["calling thread"]
        ratio = medians[mode] / medians["calling thread"]
        print(f"{mode} / calling thread: {ratio:.2f} ({extra * 1e6:.1f} us more per round trip)")


if __name__ == "__main__":
    main()
