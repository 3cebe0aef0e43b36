"""Benchmark: zeropipe's spec cost model against the zero-bubble paper's measured throughput.

The paper (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024,
arXiv 2401.10241) measured four schedules on GPT-3-like models on A100 SXM 80GB
GPUs (Megatron-LM, 8 GPUs a node, RoCE between nodes, pipeline only: no data or
tensor parallelism) and published samples per GPU per second in its Table 4.
Here every row is predicted from the published setting alone (Table 3: layers,
hidden size, heads, GPUs, microbatch size and count; sequence 1024) with
``costs_from_spec`` on the shipped ``a100-80gb`` spec, its default
efficiencies, and nothing fitted per row::

    1F1B     the named schedule 1f1b
    1F1B-I   interleaved-1f1b with the paper's chunking: "the maximum number of
             chunks, each transformer layer a chunk"; every model has
             layers = k x GPUs - 2, so k = (layers + 2) / GPUs chunks per rank,
             embedding and head in the place of one layer each (--chunks overrides)
    ZB-1p    auto (one chunk per rank, as the paper's ZB-1p) with each rank's
             activation memory limited to p microbatches of its stage (the paper's
             "activation memory limited to p M_B"; weights on top), searched on
             uniform stages and run on the real ones (below)
    ZB-2p    the same with 2p microbatches

The paper's code base plans its ZB schedules for uniform stages: its scheduler
takes one F, B and W time for all stages, the median of the ranks' profiled
times ("Using uniform f/b/w timing for now", megatron/core/pipeline_parallel/
zb_schedules.py of sail-sg/zero-bubble-pipeline-parallelism, December 2023), and
one memory limit, and it counts memory in its own units: an F takes two, its B
gives one back and its W the other (``mem_f=2, mem_b=-1, mem_w=-1`` in
``auto_schedule.py`` of the same code base, November 2023).  So the ZB schedules here
are searched on a cost model whose every stage has the median stage's times and
memory (F, I, W, B, R, activations, weights; :func:`uniform_stages`), with half a
microbatch's activations waiting for its W (:func:`paper_memory`), and the order
found is simulated on the real stages, where the first and last are lighter or
heavier (``--planning per-stage`` searches on the real stages, as ``zeropipe plan``
does: the schedule a planner that sees them would run).

Every schedule runs the paper's layout of the layers: the embedding and the head
each take a transformer block's place and the places are cut evenly, so the first
and last stages hold one block fewer (the layout of its code base's
``--allow-padding-num-layers``; its README recommends layers = k x pipeline size
- 2 for it, as every model of the paper has).

Predicted throughput is samples per GPU per second, m x microbatch size / (GPUs x
iteration time), as the paper counts, where the iteration time is the longest rank's
span of compute in the simulated step: the paper's optimizer post-validation lets each
rank start the next iteration as soon as its own work is done (``--timing makespan``
takes the whole step instead; for 1F1B and 1F1B-I the two are equal); each schedule's ratio to 1F1B
is compared with the published ratio (relative error), and the ranking of the
four schedules with the published one.

Transfers are priced as Megatron-LM (the paper's code base) runs them by default:
each pipeline exchange is issued and waited on before the rank computes on, so a
send or receive occupies its rank for the wire time (``CostModel.post`` set to
the boundary's transfer time; ``--p2p overlapped`` prices them as zeropipe's own
runtime runs them, posted and overlapped with compute).  The receives are posted
where zeropipe's runtime posts them, all of a step's before the rank's first consumer,
each charged its wire time there (``--receives at-use`` posts each one compute action
ahead of its consumer, as Megatron receives).  It is the same setting for every row
and schedule.

The blocks run as the paper's launch script of its date runs them
(``examples/pretrain_llama_7b.sh`` of the commit that added zero bubble to its code
base, ed85b11c, 2023-11-03: sequence 1024 and 3p microbatches, as in Table 3):
``--fp16``, dropout at Megatron's default of 0.1, and no ``--use-flash-attn``, so
Megatron's unfused attention, whose score matrices pass through memory in F and I
(``--attention flash`` prices a fused kernel instead).

Assumed where the paper is silent: the model is GPT-2/3-style (plain GELU FFN of
4 x hidden, multi-head attention, learned positions), the GPT-2 vocabulary (50257)
and tied input/output embeddings (Megatron's default; the last stage still holds
its copy of the head).  The network between nodes is the spec's 25 GB/s per
GPU (the paper names RoCE, not its speed).

``--table 5`` checks the simulator and the search apart from the cost model: the
paper's Table 5 gives bubble rates it computed from the F, B, W and transfer times
its code profiled (Table 9), for 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p and ZB-2p; here
the same times (:func:`profiled_costs`) are simulated and searched, and the rates set
beside the published ones.

    python benchmarks/published.py
    python benchmarks/published.py --json rows.json
    python benchmarks/published.py --models 1.5B --chunks 2
    python benchmarks/published.py --p2p overlapped --timing makespan
    python benchmarks/published.py --planning per-stage
    python benchmarks/published.py --receives at-use
    python benchmarks/published.py --attention flash
    python benchmarks/published.py --table 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations, pairwise
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.ir import COMPUTE_KINDS, Schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.core.schedules.auto import search
from zeropipe.core.simulate import Timeline, simulate
from zeropipe.planning.balance import even_cut
from zeropipe.planning.specs import ModelSpec, costs_from_spec

SOURCE = "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, arXiv 2401.10241"
HARDWARE = "a100-80gb"
SEQ = 1024
VOCAB = 50257  # GPT-2 tokenizer (assumed: the paper says "analogous to GPT-3")
SCHEDULES = ("1F1B", "1F1B-I", "ZB-1p", "ZB-2p")
P2P = ("blocking", "overlapped")  # how a pipeline transfer is priced (see the docstring)
TIMING = ("span", "makespan")  # what an iteration's time is (see the docstring)
PLANNING = ("uniform", "per-stage")  # the costs the ZB schedules are searched on
RECEIVES = ("upfront", "at-use")  # where blocking receives are posted (see the docstring)
ATTENTION = ("unfused", "flash")  # how the blocks compute attention (see the docstring)


@dataclass(frozen=True)
class Pricing:
    """How the paper's runtime is modelled: the same for every row and schedule."""

    p2p: str = "blocking"
    timing: str = "span"
    planning: str = "uniform"
    receives: str = "upfront"
    attention: str = "unfused"

    def __post_init__(self) -> None:
        if self.p2p not in P2P:
            raise ValueError(f"p2p must be one of {P2P}, got {self.p2p!r}")
        if self.timing not in TIMING:
            raise ValueError(f"timing must be one of {TIMING}, got {self.timing!r}")
        if self.planning not in PLANNING:
            raise ValueError(f"planning must be one of {PLANNING}, got {self.planning!r}")
        if self.receives not in RECEIVES:
            raise ValueError(f"receives must be one of {RECEIVES}, got {self.receives!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")


@dataclass(frozen=True)
class Setting:
    """One model of the paper's Table 3 (fixed settings of the experiments)."""

    model: str
    layers: int
    heads: int
    hidden: int
    gpus: int  # = pipeline stages: no data or tensor parallelism
    microbatch_size: int
    microbatches: tuple[int, ...]

    def spec(self) -> ModelSpec:
        return ModelSpec(
            name=f"zb-paper-{self.model}",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.heads,
            ffn=4 * self.hidden,
            vocab=VOCAB,
            tied_embeddings=True,
            gated=False,
            source=f"{SOURCE}, Table 3",
        )

    def paper_chunks(self) -> int:
        """1F1B-I's chunks per rank: one layer a chunk, embedding and head counted as one
        each (layers = k x GPUs - 2 for every model of the paper)."""
        return (self.layers + 2) // self.gpus

    def blocks(self, stages: int) -> list[int]:
        """Transformer blocks per stage as the paper lays them out: the embedding and the
        head each take a block's place, and the ``layers + 2`` places are cut evenly
        (its code base's ``--allow-padding-num-layers`` layout, for which its README
        recommends layers = k x pipeline size - 2), so the first and last stages hold
        one block fewer."""
        places = even_cut(self.layers + 2, stages)
        places[0] -= 1
        places[-1] -= 1
        return places


# Table 3 of the paper, typed in: layers, attention heads, hidden size, GPUs,
# microbatch size, numbers of microbatches (sequence length 1024 for all).
SETTINGS: tuple[Setting, ...] = (
    Setting("1.5B", 22, 24, 2304, 8, 6, (24, 32, 64)),
    Setting("6.2B", 30, 32, 4096, 8, 3, (24, 32, 64)),
    Setting("14.6B", 46, 40, 5120, 16, 1, (48, 64, 128)),
    Setting("28.3B", 62, 48, 6144, 32, 1, (96, 128, 256)),
)

# Table 4 of the paper, typed in: samples per GPU per second, by (model, microbatches),
# in the order of SCHEDULES (1F1B, 1F1B-I, ZB-1p, ZB-2p).
PUBLISHED: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("1.5B", 24): (11.8, 13.1, 12.9, 14.5),
    ("1.5B", 32): (12.5, 13.4, 13.4, 14.8),
    ("1.5B", 64): (13.6, 13.9, 14.2, 14.9),
    ("6.2B", 24): (3.50, 4.01, 3.88, 4.32),
    ("6.2B", 32): (3.70, 4.08, 4.00, 4.35),
    ("6.2B", 64): (4.03, 4.19, 4.20, 4.39),
    ("14.6B", 48): (1.40, 1.54, 1.61, 1.81),
    ("14.6B", 64): (1.49, 1.59, 1.67, 1.83),
    ("14.6B", 128): (1.64, 1.66, 1.76, 1.85),
    ("28.3B", 96): (0.76, 0.82, 0.87, 0.99),
    ("28.3B", 128): (0.80, 0.85, 0.90, 1.00),
    ("28.3B", 256): (0.88, 0.90, 0.96, 1.00),
}


# Table 9 of the paper, typed in: what its code profiled in the ZB-2p runs, one value for
# every stage, in ms: F, B (the input gradient: zeropipe's I), W and one transfer.
PROFILED: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("1.5B", 24): (18.522, 18.086, 9.337, 0.601),
    ("1.5B", 32): (18.513, 18.086, 9.331, 0.626),
    ("1.5B", 64): (18.546, 18.097, 9.321, 0.762),
    ("6.2B", 24): (29.718, 29.444, 19.927, 0.527),
    ("6.2B", 32): (29.802, 29.428, 19.530, 0.577),
    ("6.2B", 64): (29.935, 29.621, 19.388, 0.535),
    ("14.6B", 48): (11.347, 11.248, 8.132, 0.377),
    ("14.6B", 64): (11.307, 11.254, 8.101, 0.379),
    ("14.6B", 128): (11.325, 11.308, 8.109, 0.378),
    ("28.3B", 96): (10.419, 10.207, 7.715, 0.408),
    ("28.3B", 128): (10.408, 10.204, 7.703, 0.408),
    ("28.3B", 256): (10.402, 10.248, 7.698, 0.460),
}

BUBBLE_SCHEDULES = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")
# Table 5 of the paper, typed in: bubble rates it computed (not measured) from those
# times, (cost - m (F + B + W)) / cost with cost the longest stage's execution time, in
# the order of BUBBLE_SCHEDULES.
BUBBLES: dict[tuple[str, int], tuple[float, float, float, float, float, float]] = {
    ("1.5B", 24): (0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 32): (0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 64): (0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 24): (0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 32): (0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 64): (0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 48): (0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 64): (0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 128): (0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 96): (0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 128): (0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 256): (0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
}


def published(model: str, microbatches: int) -> dict[str, float]:
    """The paper's samples per GPU per second of one row, by schedule."""
    return dict(zip(SCHEDULES, PUBLISHED[(model, microbatches)], strict=True))


def costs(setting: Setting, chunks: int = 1, pricing: Pricing = Pricing()) -> CostModel:
    """The cost model of ``setting`` cut into ``chunks`` stages per rank (the paper's
    layout, :meth:`Setting.blocks`), from specs only, run as the paper's launch script
    runs it (fp16, dropout, unfused attention unless ``pricing`` says flash); blocking
    transfers: each send and receive occupies its rank for the wire time."""
    stages = setting.gpus * chunks
    model = costs_from_spec(
        setting.spec(),
        HARDWARE,
        stages=stages,
        pp=setting.gpus,
        seq=SEQ,
        microbatch_size=setting.microbatch_size,
        blocks=setting.blocks(stages),
        dtype="fp16",
        attention=pricing.attention,
        dropout=True,
    )
    if pricing.p2p == "overlapped":
        return model
    return replace(model, post=model.transfer_time(0))  # every boundary carries the same bytes


def activation_limits(c: CostModel, microbatches: int) -> list[float]:
    """Per rank: its weights plus ``microbatches`` microbatches of its stage's activations."""
    return [s.weights + microbatches * s.act for s in c.stages]


def uniform_stages(c: CostModel) -> CostModel:
    """``c`` with every stage given the median stage's times and memory (the upper
    median, ``sorted(x)[n // 2]``, as the paper's code takes it): the model the
    paper's scheduler plans on."""
    median: dict[str, float] = {}
    for name in ("F", "I", "W", "B", "R", "act", "act_w", "weights"):
        values = [getattr(s, name) for s in c.stages]
        if None not in values:  # B and R may be left to their defaults (I + W, F)
            median[name] = sorted(values)[len(values) // 2]
    return replace(c, stages=tuple(replace(s, **median) for s in c.stages))


def paper_memory(c: CostModel) -> CostModel:
    """``c`` with each microbatch's activations counted as the paper's scheduler counts
    them: an F takes two units, its B gives one back and its W the other
    (``mem_f=2, mem_b=-1, mem_w=-1`` in ``GraphConfig`` of
    ``megatron/core/pipeline_parallel/auto_schedule.py``, November 2023), so what waits
    for its W holds half of the microbatch's activations."""
    return replace(c, stages=tuple(replace(s, act_w=s.act / 2) for s in c.stages))


def rank_imbalance(c: CostModel, ranks: int) -> float:
    """The busiest rank's F + I + W over the mean rank's (stage ``s`` on rank ``s % ranks``):
    a bound on what a schedule on this cut can reach, whatever its bubbles."""
    work = [0.0] * ranks
    for s, stage in enumerate(c.stages):
        work[s % ranks] += stage.F + stage.I + stage.W
    return max(work) / (sum(work) / ranks)


def iteration_time(timeline: Timeline, timing: str = "span") -> float:
    """Seconds an iteration takes when iterations follow each other: the longest rank's
    span, from its first compute to its last.  The paper's optimizer post-validation
    removes the synchronisation at the end of a step, so each rank starts the next
    iteration once its own work is done; where the rank that starts first also ends
    last (1F1B, 1F1B-I) this is the makespan.  ``timing="makespan"``: the whole step."""
    if timing == "makespan":
        return timeline.makespan
    spans = []
    for events in timeline.events:
        work = [e for e in events if e.action.kind in COMPUTE_KINDS]
        if work:
            spans.append(max(e.end for e in work) - min(e.start for e in work))
    return max(spans)


def predict(
    setting: Setting, m: int, chunks: int | None = None, pricing: Pricing = Pricing()
) -> dict[str, float]:
    """Simulated step seconds of each schedule for ``m`` microbatches of ``setting``."""
    p = setting.gpus
    v = setting.paper_chunks() if chunks is None else chunks
    one = costs(setting, 1, pricing)
    interleaved = costs(setting, v, pricing)
    timed = pricing.timing

    def run(schedule: Schedule, c: CostModel) -> Timeline:
        if pricing.receives == "at-use" and c.post > 0 and not schedule.is_lowered:
            schedule = lower(schedule, ahead=1)
        return simulate(schedule, c)

    step = {
        "1F1B": iteration_time(run(generate("1f1b", p, m), one), timed),
        "1F1B-I": iteration_time(run(generate("interleaved-1f1b", p, m, v), interleaved), timed),
    }
    planned = paper_memory(uniform_stages(one)) if pricing.planning == "uniform" else one
    for name, k in (("ZB-1p", 1), ("ZB-2p", 2)):
        found = search(planned, p, m, activation_limits(planned, k * p), max_chunks=1)
        same = planned is one and pricing.receives == "upfront"
        step[name] = iteration_time(found.timeline if same else run(found.schedule, one), timed)
    return step


def profiled_costs(setting: Setting, m: int, chunks: int = 1) -> CostModel:
    """The paper's profiled times of one row (Table 9) as a cost model in ms: every stage
    alike (a chunk is ``1 / chunks`` of a rank's), the transfer as the wire's latency (the
    paper's scheduler adds it to every dependency between stages, as the simulator
    does), and a microbatch's activations one unit, counted as :func:`paper_memory`."""
    f, b, w, comm = PROFILED[(setting.model, m)]
    stage = StageCost(F=f / chunks, I=b / chunks, W=w / chunks, act=1 / chunks)
    return paper_memory(CostModel((stage,) * (setting.gpus * chunks), latency=comm))


def bubble_rates(setting: Setting, m: int) -> dict[str, float]:
    """Each schedule's bubble rate on the paper's profiled times, as its Table 5 defines
    it: ``(cost - m (F + B + W)) / cost``, cost the longest stage's execution time (its
    span: :func:`iteration_time`).  1F1B-I has the paper's chunking; ZB-1p and ZB-2p are
    ``auto`` under a limit of p and 2p microbatches, as in :func:`predict`."""
    p, v = setting.gpus, setting.paper_chunks()
    one = profiled_costs(setting, m)
    timelines = {
        "1F1B": simulate(generate("1f1b", p, m), one),
        "1F1B-I": simulate(generate("interleaved-1f1b", p, m, v), profiled_costs(setting, m, v)),
        "ZB-H1": simulate(generate("zb-h1", p, m), one),
        "ZB-H2": simulate(generate("zb-h2", p, m), one),
    }
    for name, k in (("ZB-1p", 1), ("ZB-2p", 2)):
        timelines[name] = search(one, p, m, activation_limits(one, k * p), max_chunks=1).timeline
    f, b, w, _ = PROFILED[(setting.model, m)]
    ideal = m * (f + b + w)
    rates = {}
    for name in BUBBLE_SCHEDULES:
        cost = iteration_time(timelines[name])
        rates[name] = (cost - ideal) / cost
    return rates


def bubble_row(setting: Setting, m: int) -> dict[str, Any]:
    """One row of Table 5: published and simulated bubble rates and their differences."""
    pub = dict(zip(BUBBLE_SCHEDULES, BUBBLES[(setting.model, m)], strict=True))
    ours = bubble_rates(setting, m)
    return {
        "model": setting.model,
        "gpus": setting.gpus,
        "microbatches": m,
        "published": pub,
        "simulated": ours,
        "difference": {s: ours[s] - pub[s] for s in BUBBLE_SCHEDULES},
    }


def bubble_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'model':>6} {'GPUs':>4} {'m':>4} | " + " | ".join(
        f"{s + ' pub/sim':>15}" for s in BUBBLE_SCHEDULES
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r['published'][s]:.4f}/{r['simulated'][s]:.4f}" for s in BUBBLE_SCHEDULES]
        lines.append(
            f"{r['model']:>6} {r['gpus']:>4} {r['microbatches']:>4} | "
            + " | ".join(f"{c:>15}" for c in cells)
        )
    worst = {s: max(abs(r["difference"][s]) for r in rows) for s in BUBBLE_SCHEDULES}
    lines.append(
        "largest |simulated - published|: " + ", ".join(f"{s} {d:.4f}" for s, d in worst.items())
    )
    return "\n".join(lines)


def ratios(throughput: Mapping[str, float]) -> dict[str, float]:
    """Each schedule's throughput over 1F1B's."""
    return {name: throughput[name] / throughput["1F1B"] for name in SCHEDULES}


def _order(x: float, y: float) -> int:
    """1 if ``x`` is faster, -1 if ``y`` is, 0 for a tie (equal up to rounding: two
    schedules the simulator times alike can differ in the last bits)."""
    if abs(x - y) <= 1e-9 * max(abs(x), abs(y)):
        return 0
    return 1 if x > y else -1


def ranking_agrees(published: Mapping[str, float], predicted: Mapping[str, float]) -> bool:
    """Whether every pair the paper orders is ordered alike: a published tie accepts
    either order, a predicted tie of a pair the paper orders is a disagreement."""
    for a, b in combinations(SCHEDULES, 2):
        pub = _order(published[a], published[b])
        if pub != 0 and _order(predicted[a], predicted[b]) != pub:
            return False
    return True


def ranking(throughput: Mapping[str, float]) -> str:
    """The schedules fastest first, ``=`` between tied ones."""
    order = sorted(SCHEDULES, key=lambda s: -throughput[s])
    text = order[0]
    for before, name in pairwise(order):
        text += (" = " if _order(throughput[before], throughput[name]) == 0 else " > ") + name
    return text


def row(
    setting: Setting, m: int, chunks: int | None = None, pricing: Pricing = Pricing()
) -> dict[str, Any]:
    """One row of the comparison: published and predicted ratios, errors, ranking."""
    step = predict(setting, m, chunks, pricing)
    v = setting.paper_chunks() if chunks is None else chunks
    samples = m * setting.microbatch_size / setting.gpus  # per GPU, as the paper counts
    predicted = {name: samples / seconds for name, seconds in step.items()}
    pub = published(setting.model, m)
    pub_ratio, pred_ratio = ratios(pub), ratios(predicted)
    errors = {s: pred_ratio[s] / pub_ratio[s] - 1 for s in SCHEDULES if s != "1F1B"}
    return {
        "model": setting.model,
        "gpus": setting.gpus,
        "microbatches": m,
        "microbatch_size": setting.microbatch_size,
        "chunks_1f1b_i": v,
        "p2p": pricing.p2p,
        "timing": pricing.timing,
        "planning": pricing.planning,
        "receives": pricing.receives,
        "imbalance_1f1b": rank_imbalance(costs(setting), setting.gpus),
        "imbalance_1f1b_i": rank_imbalance(costs(setting, v), setting.gpus),
        "published": pub,
        "predicted_step_s": step,
        "predicted": predicted,
        "published_ratio": pub_ratio,
        "predicted_ratio": pred_ratio,
        "error": errors,
        "max_error": max(abs(e) for e in errors.values()),
        "ranking_agrees": ranking_agrees(pub, predicted),
        "published_ranking": ranking(pub),
        "predicted_ranking": ranking(predicted),
    }


def run(
    models: Sequence[str] | None = None, chunks: int | None = None, pricing: Pricing = Pricing()
) -> list[dict[str, Any]]:
    out = []
    for setting in SETTINGS:
        if models and setting.model not in models:
            continue
        for m in setting.microbatches:
            t0 = time.perf_counter()
            out.append(row(setting, m, chunks, pricing))
            print(
                f"  {setting.model} m={m}: {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'model':>6} {'GPUs':>4} {'m':>4} {'v':>2} {'load':>11} | {'1F1B pub/pred':>13} | "
        + " | ".join(f"{s + ' pub/pred (err)':>26}" for s in SCHEDULES[1:])
        + " | ranking"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [
            f"{r['published_ratio'][s]:.3f} / {r['predicted_ratio'][s]:.3f} ({r['error'][s]:+6.1%})"
            for s in SCHEDULES[1:]
        ]
        lines.append(
            f"{r['model']:>6} {r['gpus']:>4} {r['microbatches']:>4} {r['chunks_1f1b_i']:>2} "
            f"{r['imbalance_1f1b']:>5.2f}/{r['imbalance_1f1b_i']:<5.2f} | "
            f"{r['published']['1F1B']:>6.2f}/{r['predicted']['1F1B']:<6.2f} | "
            + " | ".join(f"{c:>26}" for c in cells)
            + f" | {'agrees' if r['ranking_agrees'] else 'differs: ' + r['predicted_ranking']}"
        )
    return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]]) -> str:
    worst = max(rows, key=lambda r: r["max_error"])
    within = sum(r["max_error"] <= 0.10 for r in rows)
    agree = sum(r["ranking_agrees"] for r in rows)
    return (
        f"max |error| {worst['max_error']:.1%} ({worst['model']} m={worst['microbatches']}); "
        f"rows with every ratio within 10%: {within}/{len(rows)}; "
        f"ranking agrees: {agree}/{len(rows)}"
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--table",
        type=int,
        choices=(4, 5),
        default=4,
        help="4 (default): measured throughput against the spec cost model; 5: the "
        "paper's bubble rates, computed from its own profiled times (Table 9), against the "
        "simulator's on the same times",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default="unfused",
        help="unfused (default): Megatron-LM's attention without --use-flash-attn, as the "
        "paper's launch script runs it; flash: a fused kernel",
    )
    p.add_argument("--models", help="comma-separated subset, e.g. 1.5B,6.2B")
    p.add_argument(
        "--chunks", type=int, help="1F1B-I chunks per rank (default: the paper's, (layers+2)/GPUs)"
    )
    p.add_argument(
        "--p2p",
        choices=P2P,
        default="blocking",
        help="blocking (default): a transfer occupies both ranks for its wire time, as "
        "Megatron-LM waits on it; overlapped: posted and overlapped, as zeropipe runs it",
    )
    p.add_argument(
        "--timing",
        choices=TIMING,
        default="span",
        help="span (default): an iteration is the longest rank's span of compute, as the "
        "paper's optimizer post-validation lets ranks go on; makespan: the whole step",
    )
    p.add_argument(
        "--planning",
        choices=PLANNING,
        default="uniform",
        help="uniform (default): the ZB schedules are searched on uniform stages (the "
        "median stage), as the paper's code plans them, and run on the real ones; "
        "per-stage: searched on the real stages",
    )
    p.add_argument(
        "--receives",
        choices=RECEIVES,
        default="upfront",
        help="blocking transfers only; upfront (default): each rank posts a step's receives "
        "before its first consumer, as zeropipe's runtime does (each post charged its wire "
        "time there); at-use: each one compute action ahead of its consumer, as Megatron "
        "receives",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = _parse(argv)
    models = args.models.split(",") if args.models else None
    if models:
        unknown = set(models) - {s.model for s in SETTINGS}
        if unknown:
            raise SystemExit(
                f"unknown model(s) {sorted(unknown)}; the paper has 1.5B, 6.2B, 14.6B, 28.3B"
            )
    t0 = time.perf_counter()
    if args.table == 5:
        # Table 5 is computed from the paper's own times: no spec pricing to choose.
        default = vars(_parse([]))
        pricing = ("chunks", "p2p", "timing", "planning", "receives", "attention")
        given = [f"--{k}" for k in pricing if getattr(args, k) != default[k]]
        if given:
            raise SystemExit(f"--table 5 uses the paper's profiled times; drop {', '.join(given)}")
        return bubbles_main(models, args.json, t0)
    pricing = Pricing(args.p2p, args.timing, args.planning, args.receives, args.attention)
    rows = run(models, args.chunks, pricing)
    print(
        f"{SOURCE}: Table 4 (samples per GPU per second) against zeropipe's prediction "
        f"(costs_from_spec, {HARDWARE}, default efficiencies, {args.p2p} transfers, "
        f"{args.timing} timing, ZB planned on {args.planning} stages, receives "
        f"{args.receives}, {args.attention} attention, "
        f"no per-row factors); "
        f"ratios to 1F1B, error = predicted / published - 1; v: 1F1B-I chunks per rank; "
        f"load: busiest rank's work / mean rank's, 1F1B / 1F1B-I cut; 1F1B in samples "
        f"per GPU per second"
    )
    print(table(rows))
    print(summary(rows))
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": SOURCE, "hardware": HARDWARE, "rows": rows}, f, indent=1)
    return rows


def bubbles_main(
    models: Sequence[str] | None, json_path: str | None, t0: float
) -> list[dict[str, Any]]:
    rows = [
        bubble_row(setting, m)
        for setting in SETTINGS
        if not models or setting.model in models
        for m in setting.microbatches
    ]
    print(
        f"{SOURCE}: Table 5 (bubble rates the paper computed from its profiled F, B, W and "
        f"transfer times, Table 9) against zeropipe's simulator and auto search on the same "
        f"times; bubble = (cost - m (F + B + W)) / cost, cost = the longest stage's span"
    )
    print(bubble_table(rows))
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"source": SOURCE, "table": 5, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
