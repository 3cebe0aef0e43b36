"""Benchmark: zeropipe's spec cost model against the zero-bubble paper's measured throughput.

The zero-bubble paper (Qi et al., arXiv 2401.10241, ICLR 2024) trains four GPT-style
models on A100 SXM 80GB GPUs with pipeline parallelism only, and reports the throughput
of 1F1B, interleaved 1F1B (1F1B-I), ZB-1p and ZB-2p for three microbatch counts each.
This script prices every row from the published setting alone -- the model's layers,
heads, hidden size, sequence length, microbatch size and count, the GPU type and count
-- with :meth:`zeropipe.costs.CostModel.from_spec` (no per-row correction), simulates

    1F1B       zeropipe's ``1f1b``
    1F1B-I     ``interleaved-1f1b`` with 2 chunks per rank
    ZB-1p      ``auto`` with one chunk per rank, memory no more than 1F1B's activations
    ZB-2p      ``auto`` with one chunk per rank, twice 1F1B's activations

and prints, per row and schedule, the published throughput ratio to 1F1B beside the
predicted one (1F1B's step time / the schedule's) and the relative error.  The ratio is
what the plan must get right (the ranking of schedules); absolute throughput depends on
the efficiency assumed and is printed for reference only.

    python benchmarks/published.py
    python benchmarks/published.py --efficiency 0.5 --rows 1.5B
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from zeropipe.costs import CostModel, initial_memory, peak_memory
from zeropipe.schedules import generate
from zeropipe.schedules.auto import search
from zeropipe.simulate import simulate
from zeropipe.specs import ModelSpec, load_hardware

SCHEDULES = ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p")


@dataclass(frozen=True)
class Row:
    model: str
    layers: int
    heads: int
    hidden: int
    gpus: int
    microbatch_size: int
    microbatches: int
    published: dict[str, float]  # schedule -> samples per GPU per second


# -- the published setting and figures (see docs/published.md for the sources) -------------
SEQ = 1024
VOCAB = 50257  # GPT-2's tokenizer, as Megatron-LM's GPT examples use
GPU = "a100-80gb"
ROWS: list[Row] = []  # filled below from the paper's tables


def model_of(row: Row) -> ModelSpec:
    return ModelSpec(
        name=row.model,
        layers=row.layers,
        hidden=row.hidden,
        heads=row.heads,
        kv_heads=row.heads,
        ffn=4 * row.hidden,
        vocab=VOCAB,
        tied_embeddings=True,
        gated=False,
        source="zero-bubble paper, Table 3",
    )


def predict(row: Row, efficiency: float) -> dict[str, float]:
    """Step time (seconds) of each schedule for this row, from the specs alone."""
    model = model_of(row)
    gpu = load_hardware(GPU)
    p, m = row.gpus, row.microbatches

    def costs(stages: int) -> CostModel:
        return CostModel.from_spec(
            model,
            gpu,
            stages=stages,
            pp=p,
            seq=SEQ,
            microbatch_size=row.microbatch_size,
            efficiency=efficiency,
        )

    out: dict[str, float] = {}
    one = generate("1f1b", p, m)
    base = costs(p)
    out["1F1B"] = simulate(one, costs=base).makespan
    inter = generate("interleaved-1f1b", p, m, chunks=2)
    out["1F1B-I"] = simulate(inter, costs=costs(2 * p)).makespan
    # ZB-1p / ZB-2p: the paper's automatic schedules under p and 2p microbatches'
    # activations, i.e. 1F1B's activation peak and twice it, on top of the weights.
    held = [peak for peak, _ in peak_memory(one, base)]
    static = initial_memory(one, base)
    for name, k in (("ZB-1p", 1), ("ZB-2p", 2)):
        limit = [w + k * (h - w) for w, h in zip(static, held, strict=True)]
        result = search(costs, p, m, limit, max_chunks=1)
        out[name] = result.timeline.makespan
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficiency", type=float, default=None, help="default: the spec's")
    parser.add_argument("--rows", default="", help="only rows of these models (comma list)")
    args = parser.parse_args()
    from zeropipe.specs import DEFAULT_EFFICIENCY

    efficiency = DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = [r for r in ROWS if not wanted or r.model in wanted]
    print(
        f"zero-bubble paper (arXiv 2401.10241) vs zeropipe's spec cost model: {GPU}, "
        f"seq {SEQ}, efficiency {efficiency}; throughput ratio to 1F1B, published | predicted"
    )
    head = f"{'model':>6} {'p':>3} {'mbs':>3} {'m':>4}"
    for name in SCHEDULES[1:]:
        head += f" {name + ' pub':>11} {'pred':>6} {'err':>6}"
    head += f" {'1F1B s/GPU/s pub':>17} {'pred':>6} {'rank ok':>7}"
    print(head)
    print("-" * len(head))
    errors: list[float] = []
    ranks_ok = 0
    for k, row in enumerate(rows, 1):
        t0 = time.perf_counter()
        times = predict(row, efficiency)
        line = f"{row.model:>6} {row.gpus:>3} {row.microbatch_size:>3} {row.microbatches:>4}"
        for name in SCHEDULES[1:]:
            pub = row.published[name] / row.published["1F1B"]
            pred = times["1F1B"] / times[name]
            err = pred / pub - 1
            errors.append(abs(err))
            line += f" {pub:>11.3f} {pred:>6.3f} {err:>+6.1%}"
        samples = row.microbatch_size * row.microbatches / times["1F1B"] / row.gpus
        order_pub = sorted(SCHEDULES, key=lambda s: -row.published[s])
        order_pred = sorted(SCHEDULES, key=lambda s: times[s])
        ok = order_pub == order_pred
        ranks_ok += ok
        line += f" {row.published['1F1B']:>17.2f} {samples:>6.2f} {'yes' if ok else 'no':>7}"
        print(line, flush=True)
        print(f"  row {k}/{len(rows)} priced in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if errors:
        print(
            f"ratio error: median {statistics.median(errors):.1%}, worst {max(errors):.1%} "
            f"(goal: every row within 10%); ranking agrees in {ranks_ok} of {len(rows)} rows"
        )


if __name__ == "__main__":
    main()
