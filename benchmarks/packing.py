"""Benchmark: documents of skewed lengths through a pipeline, three ways, side by side.

Many short documents and a few long ones (seeded), one training step over all of them on a
small Hugging Face Llama built from a config (nothing downloaded), split into 2 stages under
1F1B in one process (``mesh="local"``), the same documents fed three ways:

    padded     one row per document, every row padded to the longest document
    packed     whole documents packed into rows of that length (first-fit decreasing),
               position ids restarting at each, so attention never crosses one
               (zeropipe.apps.data.packing.pack_documents)
    budget     documents sorted and cut into the step's microbatches of about equal padded
               tokens, each padded only to its own longest row (token_budget_microbatches,
               a zeropipe.Microbatches of different shapes)

For each: real tokens per second (documents' tokens, not padding, over the median step time
of interleaved repetitions), the share of the step's tokens that are padding, the rows and
the microbatches' shapes, and the step's loss (the same documents and labels: equal to
float32 rounding, which shows the packed rows are masked apart).

    python benchmarks/packing.py
    python benchmarks/packing.py --quick          # a few seconds: what the test runs
    python benchmarks/packing.py --docs 256 --reps 7 --threads 4
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import zeropipe
from zeropipe.apps.data.packing import pack_documents, token_budget_microbatches

MODES = ("padded", "packed", "budget")


@dataclass
class Row:
    mode: str
    seconds: float  # median step time
    real: int  # documents' tokens
    padded: int  # tokens the step computes on, padding included
    rows: int
    shapes: str
    loss: float

    @property
    def tokens_per_second(self) -> float:
        return self.real / self.seconds

    @property
    def padding(self) -> float:
        return 1.0 - self.real / self.padded


def documents(
    count: int, short: tuple[int, int], long: tuple[int, int], share: float, vocab: int, seed: int
) -> list[Tensor]:
    """``count`` documents: most of a length drawn from ``short``, ``share`` of them from
    ``long`` (both inclusive ranges), token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lo, hi = long if torch.rand((), generator=g).item() < share else short
        n = int(torch.randint(lo, hi + 1, (), generator=g))
        out.append(torch.randint(1, vocab, (n,), generator=g))
    return out


def build_model(vocab: int, hidden: int, layers: int, positions: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def padded_batch(docs: list[Tensor], width: int) -> tuple[dict[str, Tensor], Tensor]:
    """One row per document, right-padded to ``width`` (pads labelled -100)."""
    ids = torch.zeros(len(docs), width, dtype=torch.int64)
    labels = torch.full_like(ids, -100)
    for r, doc in enumerate(docs):
        ids[r, : len(doc)] = doc
        labels[r, : len(doc)] = doc
    pos = torch.arange(width).expand(len(docs), width).clone()
    return {"input_ids": ids, "position_ids": pos}, labels


def _step_of(
    pipe: zeropipe.Pipeline, mode: str, docs: list[Tensor], m: int
) -> tuple[Callable[[], Tensor], int, int, str]:
    """The step to time, its padded tokens, rows and the microbatches' shapes."""
    width = max(len(d) for d in docs)
    if mode == "budget":
        batches = token_budget_microbatches(docs, m, positions=True)
        shapes = [tuple(x["input_ids"].shape) for x in batches.inputs]  # type: ignore[index]
        padded = sum(r * s for r, s in shapes)
        text = " ".join(f"{r}x{s}" for r, s in shapes)
        return lambda: pipe.step(batches), padded, sum(r for r, _ in shapes), text
    batch, labels = padded_batch(docs, width) if mode == "padded" else pack_documents(docs, width)
    rows = len(labels)
    if rows < m:
        raise SystemExit(f"{mode}: {rows} rows cannot fill {m} microbatches; give more --docs")
    per = [len(t) for t in torch.tensor_split(labels, m)]
    text = f"{min(per)}-{max(per)} rows x {width}" if min(per) != max(per) else f"{per[0]}x{width}"
    return lambda: pipe.step(batch, labels), labels.numel(), rows, text


def measure(args: argparse.Namespace) -> tuple[list[Row], list[int]]:
    """Each mode's median step over interleaved repetitions (the order rotates), and the
    documents' lengths."""
    torch.set_num_threads(args.threads)
    docs = documents(
        args.docs,
        (args.short_min, args.short_max),
        (args.long_min, args.long_max),
        args.long_share,
        args.vocab,
        args.seed,
    )
    model = build_model(args.vocab, args.hidden, args.layers, max(len(d) for d in docs))
    schedule = zeropipe.build_schedule("1f1b", ranks=2, microbatches=args.microbatches)
    pipe = zeropipe.Pipeline(
        zeropipe.split(model, 2), schedule, loss_fn=zeropipe.causal_lm_loss, mesh="local"
    )
    steps = {mode: _step_of(pipe, mode, docs, args.microbatches) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    losses: dict[str, float] = {}
    for mode in MODES:  # warm-up: boundary shapes learnt, saved bytes counted
        model.zero_grad(set_to_none=True)
        losses[mode] = steps[mode][0]().item()
    for rep in range(args.reps):
        order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
        for mode in order:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            steps[mode][0]()
            times[mode].append(time.perf_counter() - start)
    real = sum(len(d) for d in docs)
    rows = [
        Row(
            mode,
            statistics.median(times[mode]),
            real,
            steps[mode][1],
            steps[mode][2],
            steps[mode][3],
            losses[mode],
        )
        for mode in MODES
    ]
    return rows, sorted(len(d) for d in docs)


def report(rows: list[Row], sizes: list[int], args: argparse.Namespace) -> str:
    lines = [
        f"{args.docs} documents, lengths {sizes[0]}..{sizes[-1]} (median {sizes[len(sizes) // 2]}"
        f", {sum(n > args.short_max for n in sizes)} long), {rows[0].real} tokens; Llama "
        f"hidden {args.hidden} x {args.layers} layers, 2 stages, 1f1b, "
        f"{args.microbatches} microbatches, {args.threads} thread(s), median of {args.reps}",
        f"{'mode':<8} {'tokens/s':>10} {'padding':>8} {'rows':>5} {'step s':>8} "
        f"{'loss':>9}  microbatches",
    ]
    for r in rows:
        lines.append(
            f"{r.mode:<8} {r.tokens_per_second:>10,.0f} {r.padding:>8.1%} {r.rows:>5} "
            f"{r.seconds:>8.3f} {r.loss:>9.5f}  {r.shapes}"
        )
    base = rows[0].tokens_per_second
    lines.append(
        "vs padded: " + ", ".join(f"{r.mode} {r.tokens_per_second / base:.2f}x" for r in rows[1:])
    )
    lines.append(
        f"({platform.node()}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')})"
    )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=128)
    p.add_argument("--short-min", type=int, default=16)
    p.add_argument("--short-max", type=int, default=96)
    p.add_argument("--long-min", type=int, default=384)
    p.add_argument("--long-max", type=int, default=512)
    p.add_argument("--long-share", type=float, default=0.05)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small run, for the test")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.long_min, args.long_max = 16, 48, 64
        args.short_min, args.short_max, args.hidden, args.layers, args.reps = 4, 16, 16, 2, 1
        args.long_share = 0.15
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    rows, sizes = measure(args)
    print(report(rows, sizes, args))
    return {r.mode: r for r in rows}


if __name__ == "__main__":
    main()
