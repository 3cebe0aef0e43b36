"""Benchmark: the planner's context-parallel prices against torchtitan's published H100 tables.

pytorch/torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (end of 2024; torch,
torchao and torchtitan of 2024-12-23/26; Grand Teton hosts of 8 H100 (96 GB HBM2e, 500 W)
on NVLink, 400 Gb/s RDMA per GPU) published, in tokens per second per GPU (TPS/GPU):

* **Table 2**, FSDP + CP + torch.compile + Float8, Llama 3.1 8B on 8 GPUs, local batch 1,
  full activation checkpointing: FSDP 8 / CP 1 at 32,768 tokens a sequence, FSDP 4 / CP 2
  at 65,536, FSDP 2 / CP 4 at 131,072, FSDP 1 / CP 8 at 262,144.
* **Table 6**, FSDP + TP + PP + CP + torch.compile + Float8 + AsyncTP + 1F1B, Llama 3.1
  405B on 512 GPUs, TP 8, PP 8, local batch 8, full activation checkpointing: the same
  four FSDP / CP pairs and sequences.

What is checked is each row's throughput over its table's first row, predicted against
published: the rows keep the tokens a GPU holds (``seq / cp`` = 32,768) and a step's
tokens, and change only the attention span and the ring.  Each row is priced at its own
layout, with nothing fitted to it: :func:`zeropipe.planning.cluster.spec_costs` on the
shipped ``h100-sxm`` spec (bf16 matmuls at 60% of peak), FSDP over the ``dp x cp`` ranks
(as torchtitan's ``dp_shard_cp`` mesh shards), every block checkpointed on its own (full
activation checkpointing: each block keeps its input and runs its forward again before its
backward, ``checkpoint_blocks``), tp placed innermost and cp after it (Table 6: tp 8 fills a
node, so its ring crosses the network; Table 2: inside the node); Table 6 runs 1F1B on 8
ranks with torchtitan's default of as many microbatches as pipeline ranks (8 of one
sequence); Table 2 one microbatch on one stage.  The kernels are the rows' own
(:data:`TORCHTITAN`, :class:`zeropipe.planning.pricing.transformer.Kernels`):

* attention is torch's flash SDPA backend, FlashAttention-2, at
  ``FLASH_ATTENTION_2_EFFICIENCY`` (33%) of the bf16 peak, not the 60% a large matmul
  reaches: at 32,768 tokens it is most of an 8B step, and the part that grows with cp;
* the blocks' linears run in Float8, ``FLOAT8_LINEAR_SPEEDUP`` (1.49) times faster, a
  factor derived from torchtitan's Table 1 (the same 8B on the same 8 GPUs at 8,192
  tokens, selective checkpointing, with and without Float8: :func:`float8_check`), which
  leaves attention an even larger share;
* context parallelism is torch's ``context_parallel`` as torchtitan configures it: keys
  and values all-gathered (``context_parallel_rotate_method = "allgather"``), the
  all-gather hidden only under the first of the cp sub-attentions, their float32 gradients
  passed around a ring backward; the keys and values travel as wide as the queries
  (torchtitan's Llama repeats its 8 key/value heads to the query heads before attention);
  after each sub-attention but the first, torch's float32 merges of the partial output and
  sums of the gradients, priced by the bytes they move.

Below the table, each row's step over the row before it, published and predicted: as
priced (fixed costs plus costs in proportion to cp) these rise steadily; the published ones
rise and fall, which no step of that form reproduces row for row.

    python benchmarks/long_context_table.py
    python benchmarks/long_context_table.py --json rows.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from table_report import finish, within_summary

from zeropipe.core.costs import CostModel
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.cluster import Config, spec_costs
from zeropipe.planning.pricing.context_parallel import RingAttention
from zeropipe.planning.pricing.transformer import FLASH_ATTENTION_2_EFFICIENCY, Kernels
from zeropipe.planning.specs import HardwareSpec, load_hardware, load_model, price_stages

SOURCE = (
    "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (2024-12), Tables 2 "
    "and 6, TPS/GPU"
)
HARDWARE = "h100-sxm"
BAR = 0.20  # a row's ratio to its table's first, predicted over published, within 20%
# The rows' kernels (the module docstring): FlashAttention-2, Float8 linears, torch's
# all-gather context parallelism moving keys and values as wide as the queries.
TORCHTITAN = Kernels(
    attention_efficiency=FLASH_ATTENTION_2_EFFICIENCY,
    float8_linears=True,
    ring=RingAttention("allgather", expanded_kv=True),
)
# Table 1: Llama 3.1 8B, FSDP 8 on 8 GPUs, local batch 2 of torchtitan's llama3_8b.toml's
# 8,192 tokens, selective activation checkpointing, TPS/GPU with torch.compile and with
# torch.compile + Float8: what FLOAT8_LINEAR_SPEEDUP comes from.
TABLE_1 = {"seq": 8192, "local_batch": 2, "gpus": 8, "bf16": 6667, "float8": 8532}
# Of the blocks' linears' forward, the share torchtitan's selective checkpointing ("op"
# policy: every op's output saved but every second matmul's) recomputes in backward.
SELECTIVE_RECOMPUTE = 0.5


@dataclass(frozen=True)
class Row:
    """One published row: its table, model, layout and tokens per second per GPU."""

    table: int
    model: str  # the shipped spec
    gpus: int
    tp: int
    pp: int
    fsdp: int  # data-parallel replicas (FSDP over dp x cp ranks)
    cp: int
    seq: int
    local_batch: int  # sequences a replica runs a step
    tokens: float  # published TPS/GPU

    @property
    def microbatches(self) -> int:
        """torchtitan's default of 2024: as many microbatches as pipeline ranks."""
        return self.pp if self.pp > 1 else 1

    @property
    def name(self) -> str:
        return f"T{self.table} FSDP {self.fsdp} CP {self.cp}"

    def tokens_per_gpu(self, step: float) -> float:
        return self.local_batch * self.fsdp * self.seq / step / self.gpus


ROWS: tuple[Row, ...] = (
    Row(2, "llama-3-8b", 8, 1, 1, 8, 1, 32_768, 1, 3890),
    Row(2, "llama-3-8b", 8, 1, 1, 4, 2, 65_536, 1, 2540),
    Row(2, "llama-3-8b", 8, 1, 1, 2, 4, 131_072, 1, 1071),
    Row(2, "llama-3-8b", 8, 1, 1, 1, 8, 262_144, 1, 548),
    Row(6, "llama-3.1-405b", 512, 8, 8, 8, 1, 32_768, 8, 76),
    Row(6, "llama-3.1-405b", 512, 8, 8, 4, 2, 65_536, 8, 47),
    Row(6, "llama-3.1-405b", 512, 8, 8, 2, 4, 131_072, 8, 31),
    Row(6, "llama-3.1-405b", 512, 8, 8, 1, 8, 262_144, 8, 16),
)


def layout(row: Row) -> Config:
    """The row's configuration."""
    size = row.local_batch // row.microbatches
    return Config(row.pp, row.fsdp, size, row.microbatches, row.pp, tp=row.tp, cp=row.cp)


def rows_hardware() -> HardwareSpec:
    """The H100s the rows ran on, as far as published: 96 GB of HBM2e at 2.4 TB/s, and at a
    500 W limit a peak between the NVL's and the SXM's, taken here at the NVL's (835 of
    989 TFLOP/s bf16, every dtype scaled alike)."""
    sxm = load_hardware(HARDWARE)
    flops = {k: v * 835 / 989 for k, v in sxm.flops.items()}
    return replace(sxm, name="h100-hbm2e-500w", memory=96e9, memory_bandwidth=2.4e12, flops=flops)


def costs(
    row: Row, kernels: Kernels = TORCHTITAN, hardware: HardwareSpec | None = None
) -> CostModel:
    """The planner's cost model for the row's model and layout on ``hardware`` (default the
    shipped H100 SXM), FSDP over dp x cp, every block checkpointed, with ``kernels``."""
    model, hardware = load_model(row.model), hardware or load_hardware(HARDWARE)
    factory = spec_costs(
        model, hardware, seq=row.seq, fsdp=True, kernels=kernels, checkpoint_blocks=True
    )
    return factory(layout(row))


def float8_check() -> dict[str, float]:
    """Table 1's Float8 speedup, published and as priced: the 8B on 8 GPUs (FSDP 8, half the
    blocks' linear forward recomputed: :data:`SELECTIVE_RECOMPUTE`), attention as
    FlashAttention-2, the linears in bf16 and in Float8."""
    seq, batch, gpus = TABLE_1["seq"], TABLE_1["local_batch"], TABLE_1["gpus"]
    model, hardware = load_model("llama-3-8b"), load_hardware(HARDWARE)
    steps = []
    for float8 in (False, True):
        kernels = Kernels(FLASH_ATTENTION_2_EFFICIENCY, float8_linears=float8)
        factory = spec_costs(model, hardware, seq=seq, fsdp=True, kernels=kernels)
        schedule = build_schedule(generate("1f1b", 1, 1), reduce_grad=True)
        step = simulate(schedule, factory(Config(1, gpus, batch, 1, 1))).makespan
        # The blocks alone (a stage between the embedding's and the head's): their W is
        # their linears' forward FLOPs at the linears' rate.
        only = {"stages": 3, "blocks": [0, model.layers, 0], "kernels": kernels}
        blocks = price_stages(model, hardware, seq=seq, microbatch_size=batch, **only)[1]
        steps.append(step + SELECTIVE_RECOMPUTE * blocks.W)
    return {
        "predicted": steps[0] / steps[1],
        "published": TABLE_1["float8"] / TABLE_1["bf16"],
    }


def predict(
    row: Row, kernels: Kernels = TORCHTITAN, hardware: HardwareSpec | None = None
) -> tuple[float, float]:
    """Simulated seconds a step (1F1B, the gradients reduced over dp x cp) and peak memory
    (bytes, the fullest GPU), with ``kernels`` on ``hardware``."""
    schedule = generate("1f1b", row.pp, row.microbatches)
    reduced = build_schedule(schedule, reduce_grad=row.fsdp * row.cp > 1)
    timeline = simulate(reduced, costs(row, kernels, hardware))
    return timeline.makespan, max(timeline.peak_memory)


def run(
    rows: Sequence[Row], kernels: Kernels = TORCHTITAN, hardware: HardwareSpec | None = None
) -> list[dict[str, Any]]:
    """Each row predicted with ``kernels`` on ``hardware``, with its ratio to the first row
    of its table."""
    out: list[dict[str, Any]] = []
    first: dict[int, dict[str, Any]] = {}
    for row in rows:
        step, peak = predict(row, kernels, hardware)
        entry: dict[str, Any] = {
            "row": row.name,
            "table": row.table,
            "seq": row.seq,
            "predicted_step_s": step,
            "predicted_tokens": row.tokens_per_gpu(step),
            "published_tokens": row.tokens,
            "predicted_peak_gib": peak / 2**30,
        }
        base = first.setdefault(row.table, entry)
        entry["predicted_ratio"] = entry["predicted_tokens"] / base["predicted_tokens"]
        entry["published_ratio"] = row.tokens / base["published_tokens"]
        entry["ratio"] = entry["predicted_ratio"] / entry["published_ratio"]
        out.append(entry)
    return out


def step_growth(rows: Sequence[dict[str, Any]], table_number: int) -> dict[str, list[float]]:
    """Each row's step over the step of the row before it in ``table_number``, published and
    predicted.  The rows double the sequence and cp and keep the tokens a GPU holds, so a
    step of fixed costs plus costs in proportion to cp (attention's span, the keys and values
    gathered, the merges after each sub-attention) grows by factors that move steadily, one
    way, from row to row."""
    mine = [r for r in rows if r["table"] == table_number]
    steps = {
        "published": [1 / r["published_ratio"] for r in mine],
        "predicted": [1 / r["predicted_ratio"] for r in mine],
    }
    return {k: [b / a for a, b in pairwise(v)] for k, v in steps.items()}


def growth_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per table: its step growth row to row, published and predicted."""
    lines = []
    for number in sorted({r["table"] for r in rows}):
        growth = step_growth(rows, number)
        published = " ".join(f"{g:.2f}" for g in growth["published"])
        predicted = " ".join(f"{g:.2f}" for g in growth["predicted"])
        lines.append(
            f"Table {number}, a row's step over the row before it: published {published}; "
            f"predicted {predicted}"
        )
    return lines


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'row':>20} {'seq':>8} | {'tok/s/GPU':>9} {'published':>9} | "
        f"{'to first':>8} {'published':>9} {'error':>7} | {'peak GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['row']:>20} {r['seq']:>8} | {r['predicted_tokens']:>9.1f} "
            f"{r['published_tokens']:>9.0f} | {r['predicted_ratio']:>8.3f} "
            f"{r['published_ratio']:>9.3f} {r['ratio'] - 1:>+7.1%} | "
            f"{r['predicted_peak_gib']:>8.1f}"
        )
    return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """How many rows but each table's first have a ratio to it within the bar."""
    checked = [r for r in rows if r["predicted_ratio"] != 1.0 or r["published_ratio"] != 1.0]
    return within_summary(checked, BAR, "of the published in their ratio to their table's first")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--attention-efficiency",
        type=float,
        metavar="E",
        help="what if: attention at E of the peak instead of FlashAttention-2's measured "
        f"{FLASH_ATTENTION_2_EFFICIENCY}",
    )
    p.add_argument(
        "--rows-hardware",
        action="store_true",
        help="what if: priced on the rows' own H100s (rows_hardware) instead of the SXM spec",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = _parse(argv)
    t0 = time.perf_counter()
    kernels = TORCHTITAN
    if args.attention_efficiency is not None:
        kernels = replace(kernels, attention_efficiency=args.attention_efficiency)
    hardware = rows_hardware() if args.rows_hardware else load_hardware(HARDWARE)
    out = run(ROWS, kernels, hardware)
    print(
        f"{SOURCE}: tokens/s per GPU against zeropipe's prediction (spec_costs on "
        f"{hardware.name}, attention at {kernels.attention_efficiency} of the peak, "
        f"the rows' kernels: FlashAttention-2, Float8 linears, keys and values all-gathered "
        f"over cp after tp; FSDP over dp x cp, every block checkpointed, no per-row "
        f"factor); to "
        f"first: a row's tokens/s over its table's first row, predicted and published; error: "
        f"predicted ratio over published"
    )
    check = float8_check()
    lines = [
        table(out),
        summary(out),
        *growth_lines(out),
        f"Table 1, Float8 over bf16 at 8,192 tokens (where FLOAT8_LINEAR_SPEEDUP comes from): "
        f"predicted {check['predicted']:.3f}, published {check['published']:.3f}",
    ]
    finish(out, lines, source=SOURCE, hardware=hardware.name, json_path=args.json, started=t0)
    return out


if __name__ == "__main__":
    main()
