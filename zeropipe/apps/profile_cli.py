"""``zeropipe profile``: measure a reference model's stages on this machine and write the
cost model that ``zeropipe simulate --costs FILE``, ``--schedule auto`` and ``zeropipe plan
--costs FILE`` take.  torch is imported only when the command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zeropipe.apps.cli_args import int_at_least
from zeropipe.core.errors import ZeropipeError

__all__ = ["add_arguments", "run_cli"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure a reference model's stages on this machine (median F, I, W, B, R times in "
        "seconds, activation bytes per microbatch) and write the cost model that "
        "`zeropipe simulate --costs FILE` and `--schedule auto` take."
    )
    parser.add_argument(
        "--model", choices=("gpt", "mlp"), default="gpt", help="reference model (default gpt)"
    )
    parser.add_argument(
        "--blocks",
        type=int_at_least(1),
        default=4,
        metavar="N",
        help="the model's blocks: a GPT block is 2 layers (attention, MLP), an MLP block "
        "(Linear-GELU-Linear) 1 (default 4)",
    )
    parser.add_argument(
        "--width", type=int_at_least(1), default=128, metavar="D", help="model width (default 128)"
    )
    parser.add_argument(
        "--seq",
        type=int_at_least(1),
        default=64,
        metavar="T",
        help="GPT sequence length (default 64)",
    )
    parser.add_argument(
        "--microbatch-size",
        type=int_at_least(1),
        default=8,
        metavar="B",
        help="rows per microbatch (default 8)",
    )
    parser.add_argument(
        "--stages",
        type=int_at_least(1),
        metavar="S",
        help="cut the model into S stages (default: one stage per layer)",
    )
    parser.add_argument(
        "--balance",
        action="store_true",
        help="cut by measured layer time (zeropipe.planning.balance) instead of equal layer counts",
    )
    parser.add_argument(
        "--repeat",
        type=int_at_least(1),
        default=7,
        metavar="R",
        help="timed repetitions, median kept (default 7)",
    )
    parser.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=2,
        metavar="K",
        help="untimed repetitions first (default 2)",
    )
    parser.add_argument(
        "--threads",
        type=int_at_least(1),
        default=1,
        metavar="T",
        help="intra-op threads while measuring (default 1, as one pipeline rank)",
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the cost model here")
    parser.add_argument(
        "--json", action="store_true", help="print the cost model JSON instead of the table"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Profile a reference model's stages; print the costs, or write them as JSON."""
    import torch

    from zeropipe.apps.models import GPTConfig, gpt, mlp_blocks
    from zeropipe.apps.models.gpt import LAYERS, lm_loss
    from zeropipe.core.ir import Kind
    from zeropipe.planning.balance import balance, even_cut
    from zeropipe.planning.plan import layer_costs, profile
    from zeropipe.runtime.step.stage import split_layers

    gen = torch.Generator().manual_seed(0)
    target: Any = None
    loss_fn: Any = None
    if args.model == "gpt":
        heads = max(h for h in (8, 4, 2, 1) if args.width % h == 0)
        cfg = GPTConfig(seq=args.seq, width=args.width, heads=heads, layers=args.blocks)
        model = gpt(cfg)
        sample = torch.randint(0, cfg.vocab, (args.microbatch_size, cfg.seq), generator=gen)
        target, loss_fn = sample, lm_loss
        what = LAYERS
    else:
        model = mlp_blocks(args.blocks, args.width, 4 * args.width)
        sample = torch.randn(args.microbatch_size, args.width, generator=gen)
        what = "one per block"
    layers = len(model)
    counted = f"{args.blocks} block{'s' * (args.blocks != 1)}, {layers} layers ({what})"
    parts = args.stages or layers
    if parts > layers:
        raise ZeropipeError(
            f"--stages {parts}: the model has {counted}, and a stage needs a layer; "
            f"give --stages {layers} or fewer, or more --blocks"
        )
    options = {"warmup": args.warmup, "repeat": args.repeat, "threads": args.threads}
    if args.balance:
        per_layer = layer_costs(model, sample, target=target, loss_fn=loss_fn, **options)
        cut = balance([c.F + c.time(Kind.B) for c in per_layer.stages], parts)
    else:
        cut = even_cut(layers, parts)
    costs = profile(split_layers(model, cut), sample, target=target, loss_fn=loss_fn, **options)
    costs.meta.update(
        {
            "model": args.model,
            "blocks": args.blocks,
            "layers": layers,
            "width": args.width,
            "cut": cut,
            "microbatch_size": args.microbatch_size,
        }
    )
    if args.out:
        Path(args.out).write_text(costs.to_json())
    if args.json:
        print(costs.to_json())
        return 0
    print(
        f"{args.model}: {counted}, in {parts} stage(s) of {cut} layers, microbatch "
        f"{args.microbatch_size}, {args.threads} thread(s), median of {args.repeat}"
    )
    print(
        f"{'stage':>5} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'B ms':>8} {'R ms':>8} "
        f"{'act KiB':>9} {'act_w KiB':>9} {'out KiB':>8}"
    )
    for s, c in enumerate(costs.stages):
        ms = [1e3 * x for x in (c.F, c.I, c.W, c.time(Kind.B), c.time(Kind.R))]
        kib = [x / 1024 for x in (c.act, c.act_w, c.boundary_bytes)]
        print(
            f"{s:>5} "
            + " ".join(f"{x:>8.3f}" for x in ms)
            + f" {kib[0]:>9.1f} {kib[1]:>9.1f} {kib[2]:>8.1f}"
        )
    print(f"runtime overhead per compute action: {1e6 * costs.overhead:.0f} us")
    print(f"wire: {costs.meta['comm']}")
    if args.out:
        print(f"wrote costs: {args.out}")
    return 0
