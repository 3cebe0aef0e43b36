"""``zeropipe plan``: rank the ways to train a model on a cluster, before renting it.

Two modes, one table:

* ``--model CONFIG --gpus N --gpu KIND --seq S --global-batch G``: price the model from
  its spec and the accelerator's datasheet (:mod:`zeropipe.planning.specs`) for every pipeline
  depth, data-parallel degree, tensor-parallel degree (inside a node), microbatch size,
  chunking and schedule (:func:`zeropipe.planning.cluster.search`); ``--pp``, ``--dp`` and
  ``--tp`` fix or restrict a dimension; for a mixture of experts, ``--ep`` the
  expert-parallel degrees (inside dp); ``--cp`` the context-parallel degrees (each sequence
  sharded over cp GPUs, ring attention).
* ``--costs COSTS.json --ranks R --microbatches M``: one pipeline whose costs were
  measured (``zeropipe profile --out``, ``zeropipe bench --costs-out``); rank the
  schedules for it, each with the measured layers cut where its own simulated step is
  shortest (as ``zeropipe bench`` cuts them).

No torch: like ``schedules`` and ``simulate`` it runs on a laptop (matplotlib only for ``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zeropipe.apps import plan_size
from zeropipe.apps.cli_args import int_at_least, positive_float, share
from zeropipe.apps.plan_output import cluster_header, footer, format_table, to_json
from zeropipe.core import render
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ScheduleError, ZeropipeError
from zeropipe.core.schedules import GENERATORS
from zeropipe.planning.cluster import (
    GiB,
    Ranking,
    divisors,
    fixed_costs,
    schedule_cut,
    search,
)
from zeropipe.planning.cluster import spec_costs as spec_cost_factory
from zeropipe.planning.pricing.context_parallel import ROTATIONS, RingAttention, check_cp
from zeropipe.planning.pricing.moe import check_ep, check_sequence_parallel
from zeropipe.planning.pricing.tensor_parallel import check_tp
from zeropipe.planning.pricing.transformer import Kernels
from zeropipe.planning.specs import (
    ATTENTION_KINDS,
    DEFAULT_EFFICIENCY,
    HardwareSpec,
    ModelSpec,
    hardware_names,
    load_hardware,
    load_model,
)

__all__ = ["add_arguments", "run_cli"]

_SKIPPED_BY_DEFAULT = ("looped-bfs",)  # all of a chunk's activations at once: never a contender


def _default_schedules() -> list[str]:
    from zeropipe.core.schedules import auto  # noqa: F401  (registers "auto")

    return [s for s in sorted(GENERATORS) if s not in _SKIPPED_BY_DEFAULT]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,2,4, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``zeropipe plan``: each mode's own section, then what both share."""
    parser.description = (
        "Rank pipeline depth (pp), data-parallel degree (dp), tensor-parallel degree (tp), "
        "microbatch size, chunks, schedule and recompute/offload plan by simulated step "
        "time, and say whether each fits in memory. With --model/--gpus/--gpu the costs "
        "come from the model's shape and the GPU's datasheet; with --costs from a measured "
        "cost model (one pipeline)."
    )
    cluster = parser.add_argument_group("cluster mode")
    _add_model_and_cluster(cluster)
    _add_cluster_search_space(cluster)
    _add_measured_costs(parser.add_argument_group("measured-costs mode"))
    _add_schedules_and_memory(parser)
    _add_output(parser)


def _add_model_and_cluster(spec: Any) -> None:
    """Cluster mode's model, its training shape and the GPUs it runs on."""
    spec.add_argument(
        "--model",
        metavar="CONFIG",
        help="a shipped model name or a Hugging Face config.json (file or folder)",
    )
    spec.add_argument("--gpus", type=int_at_least(1), metavar="N", help="GPUs in the run")
    spec.add_argument("--gpu", metavar="KIND", help=f"GPU kind: {', '.join(hardware_names())}")
    spec.add_argument("--seq", type=int_at_least(1), metavar="S", help="tokens per sequence")
    spec.add_argument(
        "--global-batch", type=int_at_least(1), metavar="G", help="sequences per optimizer step"
    )
    spec.add_argument("--dtype", default="bf16", help="compute dtype (default bf16)")
    spec.add_argument(
        "--efficiency",
        type=share,
        metavar="E",
        help=f"share of the GPU's dense peak a matmul reaches, in (0, 1] (default "
        f"{DEFAULT_EFFICIENCY})",
    )
    spec.add_argument(
        "--attention",
        choices=ATTENTION_KINDS,
        default="flash",
        help="how attention runs: flash (default: a fused kernel) or unfused (the score "
        "matrices pass through memory and are kept for backward)",
    )
    spec.add_argument("--dropout", action="store_true", help="the model trains with dropout layers")
    ac = "price every block checkpointed on its own (torch.utils.checkpoint around each)"
    spec.add_argument("--checkpoint-blocks", action="store_true", help=ac)


def _add_cluster_search_space(spec: Any) -> None:
    """Cluster mode's dimensions to search: microbatch sizes, pp x dp x tp, and how tensor
    parallelism and the optimizer's state are laid out."""
    spec.add_argument(
        "--microbatch-sizes",
        type=_int_list,
        default=[1, 2, 4, 8],
        metavar="LIST",
        help="sequences per microbatch to try (default 1,2,4,8)",
    )
    for flag, what, default in (
        ("--pp", "pipeline depths", "every divisor of the GPUs up to the layers"),
        ("--dp", "data-parallel degrees", "whatever the GPUs leave"),
        ("--tp", "tensor-parallel degrees", "every divisor of a node's GPUs"),
        (
            "--ep",
            "expert-parallel degrees of a mixture of experts: its routed experts sharded "
            "over ep of the dp replicas (ep inside dp, as Megatron-LM and torchtitan lay it "
            "out: ep neighbouring replicas, on NVLink while they share a node, across the "
            "network beyond); ep divides dp and the experts, and",
            "every divisor of the experts; 1 for a dense model",
        ),
        (
            "--cp",
            "context-parallel degrees (each sequence sharded over cp GPUs, ring attention "
            "with causal load balancing, cp placed after tp inside a node, across the "
            "network where tp x cp exceeds it; seq divisible by 2 x cp)",
            "1",
        ),
    ):
        spec.add_argument(
            flag,
            type=_int_list,
            metavar="LIST",
            help=f"comma-separated {what} to consider, one to fix it (default: {default})"
            + {"--ep": "", "--cp": "; pp x dp x tp x cp = --gpus"}.get(
                flag, "; pp x dp x tp (x cp) = --gpus"
            ),
        )
    spec.add_argument(
        "--cp-attention",
        choices=ROTATIONS,
        default="ring",
        help="how cp's attention moves keys and values: ring (default: Megatron-LM's ring, "
        "each step hidden under the attention in hand), allgather (torch's context_parallel, "
        "hidden under the first sub-attention only) or gather (zeropipe's own: gathered whole "
        "under a dense mask, nothing overlapped, the mask kept: local x whole bytes a layer)",
    )
    spec.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with tp > 1, cut the norms, dropout and residual stream along the sequence "
        "too (Korthikanti et al.): the same collective bytes, activations divided by tp "
        "(default: on; --no-sequence-parallel as Megatron-LM ran before it, and for a "
        "mixture of experts or latent attention at tp > 1, whose experts take whole sequences)",
    )
    spec.add_argument(
        "--tp-across-nodes",
        action="store_true",
        help="allow a --tp that does not divide a node's GPUs; its collectives are then "
        "priced on the network (default: tensor parallelism stays inside a node)",
    )
    spec.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="shard the fp32 master weights and Adam moments over the data-parallel "
        "replicas (ZeRO-1 / a distributed optimizer): 6 + 12/dp bytes per parameter "
        "instead of 18 (routed experts: over the dp/ep replicas holding them)",
    )
    spec.add_argument(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and optimizer state over the data-parallel replicas "
        "(FSDP / ZeRO-3): 18/dp bytes per parameter, 18/(dp/ep) per routed-expert weight; "
        "gradients reduce-scattered, weight all-gathers taken as hidden under compute",
    )


def _add_measured_costs(measured: Any) -> None:
    """Measured-costs mode: one pipeline whose costs a cost file holds."""
    measured.add_argument(
        "--costs", metavar="COSTS.json", help="a cost model JSON (zeropipe profile --out)"
    )
    measured.add_argument("--ranks", type=int_at_least(1), metavar="R", help="pipeline ranks")
    measured.add_argument(
        "--microbatches", type=int_at_least(1), metavar="M", help="microbatches per step"
    )


def _add_schedules_and_memory(parser: argparse.ArgumentParser) -> None:
    """Both modes: the schedules and chunkings to try, and the memory each GPU has."""
    parser.add_argument(
        "--schedules",
        metavar="LIST",
        help="comma-separated generators (default: all but looped-bfs; 'auto' is searched "
        "for the few configurations with the best bounds)",
    )
    parser.add_argument(
        "--chunks",
        type=_int_list,
        default=[2],
        metavar="LIST",
        help="chunks per rank for the interleaved schedules (default 2)",
    )
    parser.add_argument(
        "--memory",
        type=positive_float,
        metavar="GiB",
        help="memory per GPU (default: the GPU's; with --costs: no limit, and the cost "
        "file's unit unless it is bytes)",
    )


def _add_output(parser: argparse.ArgumentParser) -> None:
    """Both modes: what is shown and written, and --force past the size limit."""
    parser.add_argument(
        "--top", type=int_at_least(1), default=10, metavar="K", help="rows to show (default 10)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the best plan's timeline")
    parser.add_argument("--json", metavar="FILE", help="write the ranking as JSON")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr while searching"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"search even when the largest configuration's schedules would take more than "
        f"about a minute (more than {plan_size.PLAN_LIMIT:,} actions)",
    )


def _schedules(args: argparse.Namespace) -> list[str]:
    if not args.schedules:
        return _default_schedules()
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if "auto" in names:
        _default_schedules()  # registers auto
    unknown = [s for s in names if s not in GENERATORS]
    if unknown or not names:
        raise ZeropipeError(
            f"--schedules: unknown schedule(s) {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(sorted(GENERATORS))}"
        )
    return names


def _progress(args: argparse.Namespace) -> Any:
    if args.quiet:
        return None
    return lambda line: print(f"plan: {line}", file=sys.stderr, flush=True)


def run_cli(args: argparse.Namespace) -> int:
    if args.costs:
        cluster_only = ("model", "gpus", "gpu", "seq", "global_batch", "pp", "dp", "tp", "ep", "cp")
        given = [f for f in (*cluster_only, "tp_across_nodes", "fsdp") if getattr(args, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ZeropipeError(f"--costs plans one measured pipeline: drop {flags}")
        header, ranking, unit = _run_measured(args)
    else:
        missing = [
            f for f in ("model", "gpus", "gpu", "seq", "global_batch") if not getattr(args, f)
        ]
        if missing:
            flags = ", ".join("--" + f.replace("_", "-") for f in missing)
            raise ZeropipeError(
                f"zeropipe plan needs {flags} (or --costs FILE --ranks R --microbatches M "
                f"for a measured pipeline); see 'zeropipe plan --help'"
            )
        if args.ranks or args.microbatches:
            raise ZeropipeError("--ranks and --microbatches go with --costs; drop them")
        header, ranking, unit = _run_cluster(args)
    cluster = not args.costs
    for line in header:
        print(line)
    print()
    print(format_table(ranking.candidates, unit=unit, cluster=cluster))
    print()
    print(footer(ranking))
    for note in ranking.notes:
        print(f"note: {note}")
    best = ranking.best
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(ranking, header), indent=1))
        print(f"wrote ranking: {args.json}")
    if args.plot and best is not None and best.timeline is not None:
        title = (
            f"{best.schedule}, pp {best.pp} x dp {best.dp} x tp {best.tp}"
            + (f" (ep {best.ep})" if best.ep > 1 else "")
            + (f" x cp {best.cp}" if best.cp > 1 else "")
            + f", mbs {best.microbatch_size}, "
            f"{best.microbatches} microbatches, memory plan {best.memory_plan}"
        )
        print(f"wrote plot: {render.render_png(best.timeline, args.plot, title)}")
    if best is not None and not best.fits:
        # The table above says what each would need; the exit code says it failed.
        raise ZeropipeError(
            f"no configuration fits the memory limit; the best one ({best.schedule}, pp "
            f"{best.pp} x dp {best.dp} x tp {best.tp}, mbs {best.microbatch_size}) is "
            f"{best.memory_plan}. Use more GPUs (a deeper pipeline or more tensor "
            f"parallelism holds fewer weights per GPU), a GPU with more memory, or shorter "
            f"sequences" + ("" if args.costs else ", or check --memory, --tp and --shard-optimizer")
        )
    return 0


def _check_cluster_flags(args: argparse.Namespace, model: Any, hw: Any) -> None:
    """--gpus whole nodes, --pp / --dp divisors of it, --pp no deeper than the model."""
    node = hw.gpus_per_node
    if args.gpus > node and args.gpus % node:
        raise ZeropipeError(
            f"--gpus {args.gpus} is not a whole number of {hw.name} nodes ({node} GPUs "
            f"each); give at most {node} or a multiple of {node}, e.g. "
            f"{args.gpus // node * node} or {(args.gpus // node + 1) * node}"
        )
    for flag in ("pp", "dp"):
        bad = [v for v in getattr(args, flag) or () if args.gpus % v]
        if bad:
            raise ZeropipeError(
                f"--{flag} {','.join(map(str, bad))} does not divide --gpus {args.gpus}: "
                f"pp x dp x tp = gpus; give divisors of {args.gpus}"
            )
    if args.pp and max(args.pp) > model.layers:
        raise ZeropipeError(
            f"--pp {max(args.pp)}: deeper than the model's {model.layers} blocks; give at "
            f"most {model.layers}"
        )
    if args.cp_attention != "ring" and not args.cp:
        raise ZeropipeError(f"--cp-attention {args.cp_attention} needs --cp (e.g. --cp 1,2,4)")


def _run_cluster(args: argparse.Namespace) -> tuple[list[str], Ranking, str]:
    model = load_model(args.model)
    hw = load_hardware(args.gpu)
    peak = hw.peak(args.dtype)
    _check_cluster_flags(args, model, hw)
    memory = args.memory * GiB if args.memory else hw.memory
    tp_options = _tp_options(args, model, hw)
    ep_options = _ep_options(args, model)
    header = cluster_header(args, model, hw, memory, tp_options, ep_options)
    schedules = _schedules(args)
    cp_options = _cp_options(args, model)
    plan_size.refuse_largest(args, model, tp_options, schedules, cp_options)
    ranking = search(
        gpus=args.gpus,
        layers=model.layers,
        global_batch=args.global_batch,
        costs_for=spec_cost_factory(
            model,
            hw,
            seq=args.seq,
            dtype=args.dtype,
            efficiency=args.efficiency,
            shard_optimizer=args.shard_optimizer,
            attention=args.attention,
            dropout=args.dropout,
            checkpoint_blocks=args.checkpoint_blocks,
            sequence_parallel=args.sequence_parallel,
            tp_across_nodes=args.tp_across_nodes,
            fsdp=args.fsdp,
            kernels=Kernels(ring=RingAttention(args.cp_attention)) if args.cp else None,
        ),
        memory=memory,
        schedules=schedules,
        microbatch_sizes=args.microbatch_sizes,
        flops_per_sample=model.flops_per_token(args.seq) * args.seq,
        peak_flops=peak,
        seq=args.seq,
        progress=_progress(args),
        top=args.top,
        chunks=args.chunks,
        pp_options=args.pp,
        dp_options=args.dp,
        tp_options=tp_options,
        ep_options=ep_options,
        cp_options=cp_options,
    )
    return header, ranking, "bytes"


def _cp_options(args: argparse.Namespace, model: ModelSpec) -> list[int]:
    """The context-parallel degrees to search: --cp's, each checked against the model and
    --seq (a bad one is an error naming the fix), or 1."""
    for cp in args.cp or []:
        try:
            moe = model.experts > 0 or model.mla is not None
            check_cp(cp, seq=args.seq, attention=args.attention, moe=moe, name=model.name)
        except ScheduleError as exc:
            raise ZeropipeError(f"--cp {cp}: {exc}") from None
        if args.gpus % cp:
            raise ZeropipeError(
                f"--cp {cp} does not divide --gpus {args.gpus}: pp x dp x tp x cp = gpus; give "
                f"a divisor of {args.gpus}"
            )
    return sorted(set(args.cp or [1]))


def _ep_options(args: argparse.Namespace, model: ModelSpec) -> list[int]:
    """The expert-parallel degrees to search: --ep's, each checked against the model (a bad
    one is an error naming the fix), or every divisor of the experts up to --gpus."""
    if args.ep is None:
        return [e for e in divisors(model.experts) if e <= args.gpus] if model.is_moe else [1]
    for ep in args.ep:
        try:
            check_ep(ep, model=model, dp=None, tp=1)
        except ScheduleError as exc:
            raise ZeropipeError(f"--ep {ep}: {exc}") from None
        if args.gpus % ep:
            raise ZeropipeError(
                f"--ep {ep} does not divide --gpus {args.gpus}: ep divides dp (ep inside dp); "
                f"give a divisor of {args.gpus}"
            )
    return sorted(set(args.ep))


def _tp_options(args: argparse.Namespace, model: ModelSpec, hw: HardwareSpec) -> list[int]:
    """The tensor-parallel degrees to search: --tp's, each checked (a bad one is an error
    naming the fix), or every divisor of a node's GPUs that the model and --gpus take (a
    mixture of experts takes tp > 1 without sequence parallelism only)."""
    node = hw.gpus_per_node
    if args.tp is None:
        out = []
        for tp in divisors(node):
            try:
                check_tp(tp, heads=model.heads, kv_heads=model.kv_heads, ffn=model.ffn,
                         gpus_per_node=node)  # fmt: skip
                check_ep(1, model=model, dp=None, tp=tp)  # a mixture's shared experts cut evenly
                check_sequence_parallel(model, tp, args.sequence_parallel)
            except ScheduleError:
                continue
            if args.gpus % tp == 0:
                out.append(tp)
        return out
    for tp in args.tp:
        if args.gpus % tp:
            raise ZeropipeError(
                f"--tp {tp} does not divide --gpus {args.gpus}: pp x dp x tp = gpus; give a "
                f"divisor of {args.gpus}"
            )
        if tp > node and not args.tp_across_nodes:
            raise ZeropipeError(
                f"--tp {tp} is more than the {node} GPUs of a {hw.name} node: tensor "
                f"parallelism runs collectives on every block, on the node's link; give at most "
                f"{node} (one of {','.join(map(str, divisors(node)))}), or add --tp-across-nodes "
                f"to price it on the network"
            )
        try:
            check_tp(tp, heads=model.heads, kv_heads=model.kv_heads, ffn=model.ffn,
                     gpus_per_node=node, cross_node=args.tp_across_nodes, model=model.name)  # fmt: skip
            check_ep(1, model=model, dp=None, tp=tp)
            check_sequence_parallel(model, tp, args.sequence_parallel)
        except ScheduleError as exc:
            fix = "" if args.tp_across_nodes or node % tp == 0 else " (or add --tp-across-nodes)"
            raise ZeropipeError(f"--tp {tp}: {exc}{fix}") from None
    return sorted(set(args.tp))


def _run_measured(args: argparse.Namespace) -> tuple[list[str], Ranking, str]:
    if not args.ranks or not args.microbatches:
        raise ZeropipeError("--costs needs --ranks R and --microbatches M")
    path = Path(args.costs)
    if not path.is_file():
        raise ZeropipeError(f"cost file {path} does not exist (write one: zeropipe profile --out)")
    try:
        costs = CostModel.from_json(path.read_text())
    except ScheduleError as exc:
        raise ScheduleError(f"cost file {path}: {exc}", rule=exc.rule) from exc
    except UnicodeDecodeError as exc:
        raise ZeropipeError(f"cannot read cost file {path}: {exc}") from exc
    memory = None
    if args.memory:
        memory = args.memory * GiB if costs.unit == "bytes" else args.memory
    meta = costs.meta
    flops = float(meta.get("flops_per_microbatch", 0.0))
    mbs = int(meta.get("microbatch_size", 1))
    header = [
        f"costs: {path} ({len(costs.stages)} stage(s), memory in {costs.unit}), "
        f"{args.ranks} rank(s), {args.microbatches} microbatches",
        "memory limit: "
        + ("none" if memory is None else _fmt_memory(memory, costs.unit) + " per rank"),
    ]
    if len(costs.stages) % args.ranks and args.ranks % len(costs.stages):
        raise ZeropipeError(
            f"--ranks {args.ranks} does not go with the {len(costs.stages)} stage(s) of "
            f"{path}: give a divisor of the stage count (ranks holding several stages)"
        )
    schedules = _schedules(args)
    plan_size.refuse_too_big(args, schedules, args.ranks, args.microbatches, f"--costs {path}")
    ranking = search(
        gpus=args.ranks,
        layers=max(len(costs.stages), 2 * args.ranks),
        global_batch=args.microbatches * mbs,
        costs_for=fixed_costs(costs),
        costs_for_schedule=schedule_cut(costs),
        memory=memory,
        schedules=schedules,
        microbatch_sizes=[mbs],
        flops_per_sample=flops / mbs,
        peak_flops=float(meta.get("peak_flops", 0.0)),
        seq=int(meta.get("seq", 0)),
        progress=_progress(args),
        top=args.top,
        chunks=args.chunks,
        pp_options=[args.ranks],
    )
    return header, ranking, costs.unit


def _fmt_memory(value: float, unit: str) -> str:
    return f"{value / GiB:.1f} GiB" if unit == "bytes" else f"{value:.4g} {unit}"
