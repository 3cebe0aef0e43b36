"""What ``zeropipe plan`` shows and writes: the lines above the table (what a cluster plan
assumes), the ranking as an aligned table, its footer, and its JSON form (and the
candidates read back from it)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from zeropipe.core.errors import ZeropipeError
from zeropipe.planning.cluster import Candidate, GiB, Ranking
from zeropipe.planning.specs import DEFAULT_EFFICIENCY, DEFAULT_STATE_BYTES

__all__ = ["candidates_from_json", "cluster_header", "footer", "format_table", "to_json"]


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def format_table(candidates: Sequence[Candidate], *, unit: str, cluster: bool = True) -> str:
    """The ranking as an aligned text table, with an ep or cp column only where a candidate
    uses it; ``cluster=False`` drops dp, tp, ep, cp, mbs and the throughput columns a
    measured single pipeline does not know."""
    memory_title = "peak GiB" if unit == "bytes" else f"peak ({unit})"
    titles = ["#", "pp", "dp", "tp", "ep", "cp", "mbs", "m", "chunks", "schedule", "memory plan"]
    titles += ["step s"]
    titles += ["tokens/s", "MFU", "bubble", memory_title, "fits"]
    rows = []
    for n, c in enumerate(candidates, 1):
        peak = c.peak_memory / GiB if unit == "bytes" else c.peak_memory
        row = [str(n), str(c.pp), str(c.dp), str(c.tp), str(c.ep), str(c.cp)]
        row += [str(c.microbatch_size)]
        row += [str(c.microbatches)]
        row += [str(c.chunks), c.schedule, c.memory_plan, f"{c.step_time:.4g}"]
        row += [_num(c.tokens_per_second, ",.0f"), _num(100 * c.mfu, ".1f") + "%"]
        row += [f"{c.bubble:.1%}", f"{peak:.3g}" if unit == "bytes" else f"{peak:.4g}"]
        row += ["yes" if c.fits else "NO"]
        rows.append(row)
    drop = {
        i for i, name in ((4, "ep"), (5, "cp")) if all(getattr(c, name) == 1 for c in candidates)
    }
    if not cluster:
        measured = {2, 3, 4, 5, 6}
        drop |= measured | {12, 13} if all(math.isnan(c.mfu) for c in candidates) else measured
    keep = [i for i in range(len(titles)) if i not in drop]
    table = [[titles[i] for i in keep]] + [[r[i].replace("-%", "-") for i in keep] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keep))]
    left = {keep.index(i) for i in (9, 10) if i in keep}  # text columns
    lines = []
    for r in table:
        pairs = enumerate(zip(r, widths, strict=True))
        cells = [v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def footer(ranking: Ranking) -> str:
    return (
        f"{ranking.priced} of {ranking.considered} configurations simulated, "
        f"{ranking.pruned} pruned (a lower bound on their step time, or not fitting, kept "
        f"them out of the top), {ranking.refused} refused by a schedule or the cost model; "
        f"{ranking.seconds:.1f} s"
    )


def to_json(ranking: Ranking, header: Sequence[str]) -> dict[str, Any]:
    """The ranking as a JSON object; :func:`candidates_from_json` reads its candidates."""
    return {
        "format": "zeropipe-plan",
        "version": 1,
        "header": list(header),
        "considered": ranking.considered,
        "priced": ranking.priced,
        "pruned": ranking.pruned,
        "refused": ranking.refused,
        "seconds": ranking.seconds,
        "notes": list(ranking.notes),
        "candidates": [_finite(c.to_dict()) for c in ranking.candidates],
    }


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: an unknown figure is null.
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def candidates_from_json(data: dict[str, Any]) -> list[Candidate]:
    if data.get("format") != "zeropipe-plan":
        raise ZeropipeError("not a zeropipe plan: field 'format' must be 'zeropipe-plan'")
    return [
        Candidate.from_dict({k: math.nan if v is None else v for k, v in row.items()})
        for row in data.get("candidates", [])
    ]


def cluster_header(
    args: argparse.Namespace,
    model: Any,
    hw: Any,
    memory: float,
    tp_options: list[int],
    ep_options: list[int],
) -> list[str]:
    """The lines above the table: model, cluster, step and what the prices assume."""
    peak = hw.peak(args.dtype)
    tokens = args.global_batch * args.seq
    tp_text = "1" if tp_options == [1] else ",".join(map(str, tp_options))
    tensor = (
        f"tensor parallel tp in {{{tp_text}}}"
        + ("" if args.tp_across_nodes else " inside a node")
        + (", sequence parallel" if args.sequence_parallel else ", no sequence parallelism")
    )
    experts = ""
    if model.is_moe:
        experts = (
            f"; a mixture of experts: {model.active_params() / 1e9:.1f}B active, "
            f"{model.experts_per_token} of {model.experts} experts"
            + (f" + {model.shared_experts} shared" if model.shared_experts else "")
            + f", {model.layers - len(set(model.dense_blocks))} MoE blocks"
            + (", latent attention" if model.mla is not None else "")
            + f"; expert parallel ep in {{{','.join(map(str, ep_options))}}} inside dp"
        )
    return [
        f"model: {model.name}, {model.params() / 1e9:.1f}B parameters, {model.layers} blocks, "
        f"hidden {model.hidden}{experts}",
        f"cluster: {args.gpus} x {hw.name} ({peak / 1e12:.0f} TFLOP/s {args.dtype}, "
        f"{hw.memory / GiB:.1f} GiB, {hw.gpus_per_node} per node; "
        f"{hw.intra_bandwidth / 1e9:.0f} GB/s in a node, {hw.inter_bandwidth / 1e9:.0f} GB/s "
        f"across nodes)",
        f"step: {args.global_batch} sequences of {args.seq} tokens ({tokens:,} tokens); "
        f"memory limit {memory / GiB:.1f} GiB per GPU",
        f"assumed: matmuls at {args.efficiency or DEFAULT_EFFICIENCY:.0%} of peak, "
        f"{args.attention} attention{', dropout' if args.dropout else ''}"
        f"{', every block checkpointed' if args.checkpoint_blocks else ''}, "
        + _state_text(args)
        + f", offload at {hw.host_bandwidth / 1e9:.0f} GB/s to host; {tensor}"
        + _context_text(args)
        + f"; ranks laid out tp innermost, then{' cp, then' if args.cp else ''} dp",
    ]


def _context_text(args: argparse.Namespace) -> str:
    """What the header says of context parallelism (nothing without --cp)."""
    if not args.cp:
        return ""
    how = {
        "ring": "ring attention as Megatron-LM runs it (zeropipe's own cp: --cp-attention gather)",
        "allgather": "keys and values all-gathered as torch's context_parallel does",
        "gather": "keys and values gathered whole as zeropipe's own cp does, under a dense "
        "mask, nothing overlapped",
    }[args.cp_attention]
    return (
        f"; context parallel cp in {{{','.join(map(str, args.cp))}}}: {how}, causal load "
        f"balancing, gradients reduced over dp x cp"
    )


def _state_text(args: argparse.Namespace) -> str:
    """What the header says a parameter's weight, gradient and Adam state cost."""
    if args.fsdp:
        return "18/dp bytes of weight/gradient/Adam state per parameter (FSDP over dp)"
    if args.shard_optimizer:
        return (
            "6 + 12/dp bytes of weight/gradient/Adam state per parameter (optimizer sharded "
            "over dp)"
        )
    return (
        f"{DEFAULT_STATE_BYTES:g} bytes of weight/gradient/Adam state per parameter "
        f"(no optimizer sharding)"
    )
