"""Benchmark: the planner's mixture-of-experts prices against NeMo AutoModel's published table.

NVIDIA-NeMo/Automodel, ``docs/performance-summary.md`` (2025-10-02), "Pre-Training
Performance, System: DGX-H100, Precision: BF16" published, for full sequences with no
padding, the time per global step (optimizer included), the model TFLOP/s per GPU and the
tokens per second per GPU of these runs (``ROWS``), with their layouts: global batch
(GBS), microbatch (MBS), local batch (LBS), gradient accumulation (GA), sequence, TP, PP,
EP, VP (virtual pipeline stages per rank), FSDP; kernels "TE + DeepEP".  The models'
shapes are the shipped ``deepseek-v3`` and ``qwen3-30b-a3b`` specs (their config.json).

Each row is predicted twice, with nothing fitted to it:

* **at its own layout**: pp, ep, dp = GPUs / pp (FSDP over all dp replicas: weights,
  gradients and optimizer state sharded over dp, the routed experts' over dp / ep), the
  row's microbatch size, its LBS / MBS microbatches a pipeline pass and GA passes a step
  (each pass a whole pipeline, the gradients reduced after the last); 1F1B, or interleaved
  1F1B with VP chunks a rank; every microbatch recomputed (activation checkpointing: at
  these layouts the planner's own memory prices say no run fits 80 GB without it);
  blocks cut where the slowest stage is fastest (the dense first blocks of DeepSeek-V3
  weigh less); priced by :func:`zeropipe.planning.cluster.spec_costs` on the shipped
  ``h100-sxm`` spec with ``fsdp=True`` and the planner's default constants (matmuls at
  60% of the bf16 peak, all-to-all at 80% of a link), built with the gradient reduction
  and simulated;
* **the planner's best plan**: :func:`zeropipe.planning.cluster.search` on the row's GPUs
  and batch, under the same cost factory, with every ep that divides the experts,
  microbatch sizes 1, 2, 4 and the row's, the named schedules but ``auto`` (bounded by
  wall time, so not reproducible) and ``looped-bfs``, chunks 2 and the row's VP, the H100's
  80 GB: a prediction, shown beside the published layout's.

Throughput is the published measures': tokens per second per GPU, and model TFLOP/s per
GPU as AutoModel counts them, ``6 N_active + 3 L s (d_qk + d_v)`` FLOPs a token (active
weights without the embedding; causal attention counted half), which reproduces every
published row's TFLOP/s from its tokens/s within 0.5%.

Not modelled: the optimizer step's own time (memory-bound, tens of milliseconds at these
shard sizes), FSDP's all-gathers (taken as prefetched under compute), a router's
imbalance (routing taken as balanced), recomputation held layer by layer (a recomputed
stage is held whole: peaks are over-stated, most for pp 1), TE's and DeepEP's kernels
beyond their bandwidth.

    python benchmarks/moe_table.py
    python benchmarks/moe_table.py --no-search --json rows.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from table_report import finish, within_summary

from zeropipe.core.costs import CostModel
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.cluster import Candidate, Config, divisors, search, spec_costs
from zeropipe.planning.plan_memory import recompute
from zeropipe.planning.specs import ModelSpec, load_hardware, load_model

SOURCE = (
    "NVIDIA-NeMo/Automodel, docs/performance-summary.md (2025-10-02), Pre-Training "
    "Performance, DGX-H100, BF16"
)
HARDWARE = "h100-sxm"
SEQ = 4096
SKIPPED = ("auto", "looped-bfs")  # not searched here (see the docstring)


@dataclass(frozen=True)
class Row:
    """One published row: the model, its layout and its figures."""

    name: str
    model: str  # the shipped spec
    gpus: int
    batch: int  # GBS, sequences a step
    microbatch_size: int  # MBS
    local_batch: int  # LBS: sequences a data-parallel replica runs a pipeline pass
    accumulation: int  # GA: pipeline passes a step
    tp: int
    pp: int
    ep: int
    vp: int  # virtual pipeline stages (chunks) a rank; 1: none
    fsdp: int  # data-parallel replicas sharding weights, gradients, optimizer state
    step: float  # published seconds a global step
    tflops: float  # published model TFLOP/s per GPU
    tokens: float  # published tokens/s per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Microbatches a pipeline pass."""
        return self.local_batch // self.microbatch_size

    def spec(self) -> ModelSpec:
        return load_model(self.model)

    def flops_per_token(self) -> float:
        """FLOPs a token as AutoModel counts them (see the docstring)."""
        m = self.spec()
        blocks = sum(m.block_params(moe, active=True) for moe in m.moe_blocks())
        qk, v = m.score_dims()
        return 6.0 * (blocks + m.vocab * m.hidden) + 3.0 * m.layers * (qk + v) * SEQ

    def tokens_per_gpu(self, step: float) -> float:
        return self.batch * SEQ / step / self.gpus

    def tflops_per_gpu(self, step: float) -> float:
        return self.tokens_per_gpu(step) * self.flops_per_token() / 1e12


# The table, typed in: name, GPUs, GBS, MBS, LBS, GA, TP, PP, EP, VP, FSDP, seconds a
# step, TFLOP/s per GPU, tokens/s per GPU.
ROWS: tuple[Row, ...] = (
    Row("DeepSeek V3 671B", "deepseek-v3", 256, 512, 1, 8, 1, 1, 4, 64, 8, 64,
        8.18, 250, 1002),
    Row("DeepSeek V3 671B", "deepseek-v3", 1024, 8192, 1, 8, 4, 1, 4, 64, 8, 256,
        37.87, 216, 865),
    Row("Qwen3 MoE 30B", "qwen3-30b-a3b", 8, 512, 4, 4, 16, 1, 1, 8, 1, 8,
        21.773, 277, 12040),
)  # fmt: skip


def cost_factory(row: Row) -> Any:
    """The planner's cost factory for the row's model on H100s, FSDP over dp."""
    return spec_costs(row.spec(), load_hardware(HARDWARE), seq=SEQ, fsdp=True)


def layout(row: Row) -> Config:
    """The row's own configuration for one pipeline pass (every microbatch recomputed)."""
    return Config(
        row.pp, row.dp, row.microbatch_size, row.microbatches, row.pp * row.vp,
        recompute=True, tp=row.tp, ep=row.ep,
    )  # fmt: skip


def costs(row: Row) -> CostModel:
    return cost_factory(row)(layout(row))


def predict(row: Row) -> tuple[float, float]:
    """Simulated seconds a step and peak memory (bytes, the fullest GPU) at the row's own
    layout: GA pipeline passes, the gradients reduced after the last (see the docstring)."""
    c = costs(row)
    name = "1f1b" if row.vp == 1 else "interleaved-1f1b"
    schedule = recompute(generate(name, row.pp, row.microbatches, row.vp))
    last = simulate(build_schedule(schedule, reduce_grad=row.dp > 1), c)
    step = last.makespan
    if row.accumulation > 1:
        step += (row.accumulation - 1) * simulate(build_schedule(schedule), c).makespan
    return step, max(last.peak_memory)


def schedules() -> list[str]:
    from zeropipe.core.schedules import auto  # noqa: F401  (registers auto, to be skipped)

    return [s for s in sorted(GENERATORS) if s not in SKIPPED]


def best_plan(row: Row) -> Candidate:
    """The planner's best plan for the row's GPUs and batch (see the docstring)."""
    hw = load_hardware(HARDWARE)
    model = row.spec()
    ranking = search(
        gpus=row.gpus,
        layers=model.layers,
        global_batch=row.batch,
        costs_for=cost_factory(row),
        memory=hw.memory,
        schedules=schedules(),
        microbatch_sizes=sorted({1, 2, 4, row.microbatch_size}),
        flops_per_sample=model.flops_per_token(SEQ) * SEQ,
        peak_flops=hw.peak("bf16"),
        seq=SEQ,
        top=1,
        chunks=sorted({2, row.vp} - {1}),
        ep_options=divisors(model.experts),
    )
    assert ranking.best is not None  # search raises rather than return nothing
    return ranking.best


def run(rows: Sequence[Row], plan: bool = True) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        t0 = time.perf_counter()
        step, peak = predict(row)
        entry: dict[str, Any] = {
            "row": f"{row.name}, {row.gpus} GPUs",
            "pp": row.pp,
            "ep": row.ep,
            "vp": row.vp,
            "dp": row.dp,
            "microbatch_size": row.microbatch_size,
            "microbatches": row.microbatches,
            "accumulation": row.accumulation,
            "published_step_s": row.step,
            "predicted_step_s": step,
            "ratio": step / row.step,
            "published_tokens": row.tokens,
            "predicted_tokens": row.tokens_per_gpu(step),
            "published_tflops": row.tflops,
            "predicted_tflops": row.tflops_per_gpu(step),
            "predicted_peak_gib": peak / 2**30,
        }
        if plan:
            best = best_plan(row)
            entry["best"] = {
                **{k: v for k, v in best.to_dict().items() if k != "mfu"},
                "tokens_per_gpu": row.tokens_per_gpu(best.step_time),
            }
        out.append(entry)
        print(f"  {entry['row']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'row':>28} {'layout':>14} | {'published':>9} {'predicted':>9} {'ratio':>6} "
        f"{'tok/s/GPU':>11} {'TFLOP/s':>9} {'peak GiB':>8} | best plan"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        layout_text = f"p{r['pp']} e{r['ep']} v{r['vp']} d{r['dp']}"
        text = (
            f"{r['row']:>28} {layout_text:>14} | {r['published_step_s']:>8.2f}s "
            f"{r['predicted_step_s']:>8.2f}s {r['ratio']:>6.3f} "
            f"{r['predicted_tokens']:>5.0f}/{r['published_tokens']:<5.0f} "
            f"{r['predicted_tflops']:>4.0f}/{r['published_tflops']:<4.0f} "
            f"{r['predicted_peak_gib']:>8.1f} |"
        )
        if "best" in r:
            b = r["best"]
            fits = "" if b["fits"] else " (does not fit)"
            text += (
                f" p{b['pp']} e{b.get('ep', 1)} d{b['dp']} mbs {b['microbatch_size']} "
                f"{b['schedule']} v{b['chunks']}, {b['memory_plan']}: {b['step_time']:.2f}s, "
                f"{b['tokens_per_gpu']:.0f} tok/s/GPU{fits}"
            )
        lines.append(text)
    return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]]) -> str:
    return within_summary(rows, 0.25, "at their own layout")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--no-search", action="store_true", help="only the rows' own layouts (no best plans)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = _parse(argv)
    t0 = time.perf_counter()
    out = run(ROWS, plan=not args.no_search)
    print(
        f"{SOURCE}: seconds a step against zeropipe's prediction (spec_costs on {HARDWARE}, "
        f"bf16, FSDP over dp, every microbatch recomputed, GA pipeline passes a step, no "
        f"per-row factor); layout: pipeline (p), expert (e), virtual stages (v), data (d) "
        f"parallel sizes; tok/s/GPU and TFLOP/s per GPU: predicted/published; peak: the "
        f"fullest GPU's predicted memory"
    )
    lines = [table(out), summary(out)]
    finish(out, lines, source=SOURCE, hardware=HARDWARE, json_path=args.json, started=t0)
    return out


if __name__ == "__main__":
    main()
