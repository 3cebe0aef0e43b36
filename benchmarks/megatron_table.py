"""Benchmark: the planner's tensor-parallel cost model against Megatron-LM's weak-scaling table.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv 2104.04473), Table 1, trained GPT models of 1.7 to 1008
billion parameters on up to 3,072 A100 80GB GPUs of NVIDIA's Selene (DGX A100 nodes: 8
GPUs on NVLink/NVSwitch, 8 HDR InfiniBand adapters of 200 Gb/s per node), sequence 2048,
vocabulary 51,200, and published for each row the attention heads, hidden size, layers,
tensor- (t) and pipeline-parallel (p) sizes, GPUs, batch size, achieved teraFLOP/s per
GPU, percent of the 312 teraFLOP/s peak and the aggregate petaFLOP/s (``ROWS``).

Where the figures were read: the table as quoted, figure for figure, by two independent
notes on the paper in public repositories found through a code search (the two agree on
every cell; the paper's PDF itself was not reachable from here).  The run settings
Table 1 does not print come from the scripts Megatron-LM ships to reproduce it:
``examples/sc21/run_table_1.sh`` of NVIDIA/Megatron-LM (commit 79a3bb6b, microbatch
size, ``--num-layers-per-virtual-pipeline-stage`` (the interleaved schedule) and the
data-parallel implementation of each row; full activation recomputation, layer by layer,
``--activations-checkpoint-method uniform``) and ``examples/sc21/CONFIG.sh`` (as kept in
the OpenGPTX/Megatron-LM fork, commit 6b27e3ad: ``--fp16``, sequence 2048, the GPT-2
BPE vocabulary).  Nothing else is taken from them.

Each row is predicted twice, with nothing fitted to the row:

* **at its own layout**: t, p, d = GPUs / (t p), its batch and microbatch size; 1F1B, or
  interleaved 1F1B with the script's chunks; every microbatch recomputed (R before each
  backward); layers cut evenly (Megatron-LM's layout), embedding on the first stage,
  head and loss on the last; priced by ``costs_from_spec`` on the shipped ``a100-80gb``
  spec with ``tp=t`` and no sequence parallelism (Table 1 predates it), fp16, Megatron's
  unfused attention and dropout, fp16 gradients all-reduced (2 bytes a parameter, as
  Megatron-LM reduces them without ``--accumulate-allreduce-grads-in-fp32``), transfers
  blocking (each send and receive occupies its rank, as in ``benchmarks/published.py``);
  built with the all-reduce and simulated;
* **the planner's best plan**: :func:`zeropipe.planning.cluster.search` on the row's GPUs
  and batch, under the same cost model, with tp in 1, 2, 4, 8 and 16 (16 crosses a node:
  its collectives priced on the network), microbatch sizes 1, 2, 4, 8 and the row's, the
  named schedules but ``auto`` (its search is bounded by wall time, so not reproducible)
  and ``looped-bfs``, chunks 2 and the row's, the A100's 80 GB.

Throughput is teraFLOP/s per GPU as the paper counts it: ``96 B s l h^2 (1 + s / (6 h) +
V / (16 l h))`` FLOPs an iteration (which counts a recomputed forward) over the step time
and the GPUs; for a plan that recomputes less it is the same measure of sequences per
second.

One constant is set for this check, and not fitted to it: the share of the fp16 peak a
large Megatron-LM matmul reaches on an A100, ``matmul_efficiency()``, read from the
zero-bubble paper's profiled weight-gradient times (``benchmarks/published.py``, its
Table 9: a W pass is only the linears' weight-gradient matmuls, ``2 T n`` FLOPs a block):
0.79, where the planner's default is 0.6.  The tensor-parallel constants are the shipped
ones (:mod:`zeropipe.planning.pricing.tensor_parallel`).

Not modelled: torch DDP's overlap of the gradient all-reduce with the backward (rows
1.7B to 18B ran with it; their all-reduce is priced after the backward), Megatron's
layer-by-layer recomputation's memory (a recomputed stage is held whole between R and
its backward, so small-pp layouts look larger than they were), the optimizer step,
kernel launch overhead.

    python benchmarks/megatron_table.py
    python benchmarks/megatron_table.py --rows 1.7B,18B --json rows.json
    python benchmarks/megatron_table.py --no-search
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from table_report import finish, within_summary

from zeropipe.core.costs import CostModel
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.balance import even_cut
from zeropipe.planning.cluster import Candidate, Config, search
from zeropipe.planning.plan_memory import recompute
from zeropipe.planning.specs import ModelSpec, costs_from_spec, load_hardware

SOURCE = (
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM, SC21, arXiv 2104.04473"
)
HARDWARE = "a100-80gb"
SEQ = 2048
VOCAB = 51200
GRAD_BYTES = 2.0  # fp16 gradients all-reduced
TP_OPTIONS = (1, 2, 4, 8, 16)  # 16 crosses an 8-GPU node: priced on the network
SKIPPED = ("auto", "looped-bfs")  # not searched here (see the docstring)


@dataclass(frozen=True)
class Row:
    """One row of Table 1, and the run settings of examples/sc21/run_table_1.sh."""

    params: str  # the paper's parameter count, billions
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU, published
    percent: int  # of the theoretical peak, published
    aggregate: float  # petaFLOP/s over all GPUs, published
    microbatch_size: int  # run_table_1.sh
    layers_per_chunk: int | None = None  # --num-layers-per-virtual-pipeline-stage

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (the interleaved schedule's v)."""
        if self.layers_per_chunk is None:
            return 1
        return self.layers // (self.pp * self.layers_per_chunk)

    @property
    def microbatches(self) -> int:
        return self.batch // (self.dp * self.microbatch_size)

    def spec(self) -> ModelSpec:
        return ModelSpec(
            name=f"megatron-{self.params}",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.heads,
            ffn=4 * self.hidden,
            vocab=VOCAB,
            tied_embeddings=True,
            gated=False,
            source=f"{SOURCE}, Table 1",
        )

    def flops(self) -> float:
        """FLOPs of one iteration as the paper counts them (recomputation included)."""
        s, l, h = SEQ, self.layers, self.hidden
        return 96.0 * self.batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))

    def tflops_per_gpu(self, step: float) -> float:
        return self.flops() / step / self.gpus / 1e12


# Table 1, typed in: parameters (billions), heads, hidden, layers, t, p, GPUs, batch,
# teraFLOP/s per GPU, % of peak, aggregate petaFLOP/s; then run_table_1.sh's microbatch
# size (MBS) and layers per virtual pipeline stage.
ROWS: tuple[Row, ...] = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, 16),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, 16),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, 16),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, 8),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, 4),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, 2, 5),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, 2, 5),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, 1, 3),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, 1, 1),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, 1),
)


def _published_benchmark() -> ModuleType:
    path = Path(__file__).with_name("published.py")
    spec = importlib.util.spec_from_file_location("published_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@cache
def matmul_efficiency() -> float:
    """The share of the A100's fp16 peak Megatron-LM's matmuls reach, from the zero-bubble
    paper's profiled W times (its Table 9, in ``benchmarks/published.py``): each W runs
    ``2 T n`` FLOPs per block of the median stage (the stage its scheduler plans on), ``T``
    tokens a microbatch, ``n`` the block's linear weights; the mean over its 12 rows."""
    zb = _published_benchmark()
    peak = load_hardware(zb.HARDWARE).peak("fp16")
    rates = []
    for (model, _), (_, _, w_ms, _) in zb.PROFILED.items():
        setting = next(s for s in zb.SETTINGS if s.model == model)
        blocks = sorted(setting.blocks(setting.gpus))[setting.gpus // 2]
        spec = setting.spec()
        n = spec.layer_params() - 2 * spec.hidden
        tokens = setting.microbatch_size * zb.SEQ
        rates.append(blocks * 2.0 * tokens * n / (w_ms / 1e3) / peak)
    return statistics.fmean(rates)


def costs(row: Row, config: Config, blocks: Sequence[int] | None = None) -> CostModel:
    """The cost model of ``config`` for ``row`` as Megatron-LM ran it (see the docstring);
    ``blocks``: blocks per stage (default: the planner's balanced cut)."""
    model = costs_from_spec(
        row.spec(),
        HARDWARE,
        stages=config.stages,
        pp=config.pp,
        dp=config.dp,
        tp=config.tp,
        seq=SEQ,
        microbatch_size=config.microbatch_size,
        dtype="fp16",
        efficiency=matmul_efficiency(),
        recompute=config.recompute,
        grad_bytes=GRAD_BYTES,
        attention="unfused",
        dropout=True,
        sequence_parallel=False,
        tp_across_nodes=config.tp > load_hardware(HARDWARE).gpus_per_node,
        blocks=blocks,
    )
    if config.pp == 1:
        return model
    return replace(model, post=model.transfer_time(0))  # blocking sends and receives


def layout(row: Row) -> Config:
    """The row's own configuration (every microbatch recomputed)."""
    return Config(
        row.pp, row.dp, row.microbatch_size, row.microbatches, row.pp * row.chunks,
        recompute=True, tp=row.tp,
    )  # fmt: skip


def predict(row: Row) -> tuple[float, float]:
    """Simulated step seconds and peak memory (bytes, the fullest GPU) at the row's own
    layout: 1F1B (interleaved with the script's chunks), every microbatch recomputed."""
    config = layout(row)
    c = costs(row, config, blocks=even_cut(row.layers, config.stages))
    name = "1f1b" if row.chunks == 1 else "interleaved-1f1b"
    schedule = recompute(generate(name, row.pp, row.microbatches, row.chunks))
    timeline = simulate(build_schedule(schedule, reduce_grad=row.dp > 1), c)
    return timeline.makespan, max(timeline.peak_memory)


def schedules() -> list[str]:
    from zeropipe.core.schedules import auto  # noqa: F401  (registers auto, to be skipped)

    return [s for s in sorted(GENERATORS) if s not in SKIPPED]


def best_plan(row: Row) -> Candidate:
    """The planner's best plan for the row's GPUs and batch (see the docstring)."""
    hw = load_hardware(HARDWARE)
    ranking = search(
        gpus=row.gpus,
        layers=row.layers,
        global_batch=row.batch,
        costs_for=lambda config: costs(row, config),
        memory=hw.memory,
        schedules=schedules(),
        microbatch_sizes=sorted({1, 2, 4, 8, row.microbatch_size}),
        flops_per_sample=row.spec().flops_per_token(SEQ) * SEQ,
        peak_flops=hw.peak("fp16"),
        seq=SEQ,
        top=1,
        chunks=sorted({2, row.chunks} - {1}),
        tp_options=TP_OPTIONS,
    )
    assert ranking.best is not None  # search raises rather than return nothing
    return ranking.best


def run(rows: Sequence[Row], plan: bool = True) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        t0 = time.perf_counter()
        step, peak = predict(row)
        entry: dict[str, Any] = {
            "row": row.params,
            "tp": row.tp,
            "pp": row.pp,
            "dp": row.dp,
            "gpus": row.gpus,
            "batch": row.batch,
            "microbatch_size": row.microbatch_size,
            "chunks": row.chunks,
            "published_tflops": row.tflops,
            "predicted_step_s": step,
            "predicted_tflops": row.tflops_per_gpu(step),
            "ratio": row.tflops_per_gpu(step) / row.tflops,
            "predicted_peak_gib": peak / 2**30,
        }
        if plan:
            best = best_plan(row)
            entry["best"] = {
                **{k: v for k, v in best.to_dict().items() if k != "mfu"},
                "tflops": row.tflops_per_gpu(best.step_time),
            }
        out.append(entry)
        print(f"  {row.params}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def _layout_text(tp: int, pp: int, dp: int) -> str:
    return f"t{tp} p{pp} d{dp}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'row':>8} {'layout':>13} {'mbs':>3} {'v':>2} | {'published':>9} {'predicted':>9} "
        f"{'ratio':>6} {'peak GiB':>8} | best plan"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        text = (
            f"{r['row']:>8} {_layout_text(r['tp'], r['pp'], r['dp']):>13} "
            f"{r['microbatch_size']:>3} {r['chunks']:>2} | {r['published_tflops']:>9.0f} "
            f"{r['predicted_tflops']:>9.1f} {r['ratio']:>6.3f} {r['predicted_peak_gib']:>8.1f} |"
        )
        if "best" in r:
            b = r["best"]
            text += (
                f" {_layout_text(b['tp'], b['pp'], b['dp'])} mbs {b['microbatch_size']} "
                f"{b['schedule']} v{b['chunks']}, {b['memory_plan']}: {b['tflops']:.1f}"
            )
        lines.append(text)
    return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]]) -> str:
    return within_summary(rows, 0.15, "at their own layout")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", help="comma-separated subset, e.g. 1.7B,18.4B")
    p.add_argument(
        "--no-search", action="store_true", help="only the rows' own layouts (seconds, not minutes)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = _parse(argv)
    rows = list(ROWS)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - {r.params for r in ROWS}
        if unknown:
            raise SystemExit(
                f"unknown row(s) {sorted(unknown)}; Table 1 has {', '.join(r.params for r in ROWS)}"
            )
        rows = [r for r in ROWS if r.params in wanted]
    t0 = time.perf_counter()
    out = run(rows, plan=not args.no_search)
    print(
        f"{SOURCE}: Table 1 (teraFLOP/s per GPU, the paper's count) against zeropipe's "
        f"prediction (costs_from_spec on {HARDWARE}, fp16, unfused attention, dropout, full "
        f"recompute, no sequence parallelism, matmuls at {matmul_efficiency():.3f} of peak "
        f"from the zero-bubble paper's profiled W times, no per-row factor); layout: tensor "
        f"(t), pipeline (p), data (d) parallel sizes; v: chunks per rank; peak: the fullest "
        f"GPU's predicted memory"
    )
    lines = [table(out), summary(out)]
    finish(out, lines, source=SOURCE, hardware=HARDWARE, json_path=args.json, started=t0)
    return out


if __name__ == "__main__":
    main()
