"""How much ``zeropipe plan`` may simulate without ``--force``: a search whose schedules would
take minutes is refused up front, with the estimate (the rates below, measured here).

    refuse_too_big(args, schedules, pp, microbatches, what)  one pipeline's schedules
    refuse_largest(args, model, tp_options, schedules)       the largest configuration a
                                                              search from specs would price
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from zeropipe.apps import cli_args
from zeropipe.planning.cluster import layouts

__all__ = [
    "CLUSTER_LIMIT",
    "CLUSTER_RATE",
    "PLAN_LIMIT",
    "PLAN_RATE",
    "refuse_largest",
    "refuse_too_big",
]

# How much a plan simulates without --force.  With --costs every schedule is priced (each
# at several cuts), at about 20,000 actions a second (2 ranks, 4,000 microbatches, nine
# schedules: ~430,000 actions in 22 s on a 2-core VM, 2026-11-28): about a minute in all.
# From specs the search prunes by bounds, so the work follows the largest configuration's
# schedule more than the count of schedules: about 14,000 of its actions a second
# (llama-3-8b on 8 GPUs, global batch 40,000: pp 8 x 2 chunks x 40,000 microbatches,
# ~1.9 million actions, 139 s, 1 GB); about half a minute.
PLAN_RATE = 20_000.0
PLAN_LIMIT = 1_200_000
CLUSTER_RATE = 14_000.0
CLUSTER_LIMIT = 400_000


def refuse_too_big(
    args: argparse.Namespace, schedules: Sequence[str], pp: int, microbatches: int, what: str
) -> None:
    """Refuse up front a pipeline of ``pp`` ranks and ``microbatches`` (up to the most chunks
    of --chunks and zbv's 2) that would take minutes to simulate: with --costs all
    ``schedules`` of it, from specs its one largest schedule (see CLUSTER_LIMIT)."""
    if args.force:
        return
    chunks = max([*args.chunks, 2])
    size = f"{pp} rank(s) x up to {chunks} chunk(s) x {microbatches} microbatches"
    one = 3.0 * pp * chunks * microbatches
    if args.costs:
        cli_args.refuse_too_big(
            one * len(schedules),
            PLAN_LIMIT,
            rate=PLAN_RATE,
            action_bytes=cli_args.ACTION_BYTES / len(schedules),  # one schedule is held at a time
            what=f"{what}: {len(schedules)} schedule(s) of {size}",
            fix="give fewer --microbatches or --ranks, or fewer --schedules",
        )
    else:
        cli_args.refuse_too_big(
            one,
            CLUSTER_LIMIT,
            rate=CLUSTER_RATE,
            what=f"{what}: a schedule of {size}",
            fix="give a smaller --global-batch or larger --microbatch-sizes, or fix --pp / --dp",
        )


def refuse_largest(
    args: argparse.Namespace,
    model: Any,
    tp_options: list[int],
    schedules: Sequence[str],
    cp_options: Sequence[int] = (1,),
) -> None:
    """Refuse up front a search whose largest configuration would take minutes to simulate
    (cp GPUs sharing each sequence leave fewer replicas, so more microbatches each)."""
    mbs = min(args.microbatch_sizes)
    every = [
        layout
        for cp in cp_options
        if args.gpus % cp == 0
        for layout in layouts(args.gpus // cp, model.layers, args.pp, args.dp, tp_options)
    ]
    pp, dp, tp = max(
        every or [(1, 1, 1)],
        key=lambda layout: layout[0] * math.ceil(args.global_batch / (layout[1] * mbs)),
    )
    refuse_too_big(
        args,
        schedules,
        pp,
        math.ceil(args.global_batch / (dp * mbs)),
        f"the largest configuration, pp {pp} x dp {dp} x tp {tp} at microbatch size {mbs}",
    )
