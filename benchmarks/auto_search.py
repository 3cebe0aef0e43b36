"""Benchmark: the auto schedule search -- its time, what it reaches, balancing, and a real run.

Three parts, each printing a table (``--part`` picks one; default: all)::

    search    zeropipe.core.schedules.auto.search on the zero-bubble paper's profiled costs
              (1.5B model: F=18.5, I=18.1, W=9.3, comm=0.6 per rank's worth of layers)
              at p=8, m=24 and p=32, m=96, memory limits p and 2p microbatches, for
              act_w = 0 (the named schedules' closed forms) and 0.9 (W keeps the
              linears' inputs and output gradients of a flash-attention layer):
              search seconds, makespan, steady bubble, the best named schedule
              that fits, and the published ZB-1p / ZB-2p figures.
              Goals: p=8 under 10 s, p=32 under 60 s; steady bubble at most half
              of 0.1585 (limit p) and of 0.0433 (limit 2p).
    balance   a deliberately lopsided nn.Sequential (two wide MLP blocks among
              narrow ones) cut into 2 stages evenly and by measured time: the
              slowest stage's measured F + B, median of interleaved repetitions.
    runtime   a 2-rank CPU pipeline over gloo (zeropipe.launch, one process and one
              intra-op thread per rank) of a small GPT: every named schedule and
              auto, each cut by measured layer time for its stage count, costs
              profiled in the same two processes (wire included); median measured
              step time beside the simulator's prediction for the same schedule
              and costs (lowered as the runtime runs it, so every post is paid),
              and pipeline efficiency = (the same work in one process)
              / (2 x step time).  Goals: auto at least as fast as the best named schedule;
              prediction within 10% of the measurement for 1f1b, zbv and auto.

CPU runs use one intra-op thread per rank (``--threads``).  On a machine
shared with other work, step times move; repetitions are interleaved (the
schedule order rotates) so that drift hits every schedule alike.

    python benchmarks/auto_search.py                    # all three
    python benchmarks/auto_search.py --part search --big-only
    python benchmarks/auto_search.py --part runtime --steps 12 --layers 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from zeropipe.core.costs import CostModel
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.schedules import GENERATORS
from zeropipe.core.schedules.auto import search
from zeropipe.core.simulate import simulate
from zeropipe.planning.balance import balance, stage_costs
from zeropipe.planning.plan import layer_costs, profile
from zeropipe.runtime.step.stage import split_layers

PAPER = {"limit p": ("ZB-1p", 0.1585), "limit 2p": ("ZB-2p", 0.0433)}


# -- part 1: the search -------------------------------------------------------------------
def part_search(args: argparse.Namespace) -> None:
    sizes = [(32, 96)] if args.big_only else [(8, 24), (32, 96)]
    print("search: zero-bubble paper costs F=18.5 I=18.1 W=9.3 comm=0.6 (per rank's layers)")
    head = (
        f"{'p':>3} {'m':>3} {'act_w':>5} {'limit':>6} {'seconds':>7} {'makespan':>9} "
        f"{'steady':>7} {'goal':>7} {'best named (steady)':>28}  chosen"
    )
    print(head)
    for p, m in sizes:
        for act_w in (0.0, 0.9):
            costs = CostModel.uniform(p, F=18.5, I=18.1, W=9.3, comm=0.6, act_w=act_w)
            for label, limit in (("limit p", p), ("limit 2p", 2 * p)):
                t0 = time.perf_counter()
                result = search(costs, p, m, limit)
                seconds = time.perf_counter() - t0
                named = [c for c in result.candidates if c.source == "named"]
                best = min(named, key=lambda c: c.makespan, default=None)
                named_txt = "-"
                if best is not None:
                    tl = simulate(best.schedule, best.costs)
                    named_txt = f"{best.name} {tl.makespan:.1f} ({tl.steady_bubble_rate:.4f})"
                tl = result.timeline
                goal = f"{PAPER[label][1] / 2:.4f}" if (p, m) == (8, 24) else "-"
                how = result.explanation.split(";")[0].removeprefix("auto: ")
                print(
                    f"{p:>3} {m:>3} {act_w:>5.1f} {limit:>6} {seconds:>7.2f} {tl.makespan:>9.1f} "
                    f"{tl.steady_bubble_rate:>7.4f} {goal:>7} {named_txt:>28}  {how}"
                )
    print(
        f"published: ZB-1p {PAPER['limit p'][1]} (limit p), ZB-2p {PAPER['limit 2p'][1]} (limit 2p)"
    )


# -- part 2: balancing -----------------------------------------------------------------------
def _lopsided() -> nn.Sequential:
    torch.manual_seed(0)

    def block(hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 64))

    return nn.Sequential(block(2048), block(96), block(2048), block(96), block(96), block(96))


def part_balance(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = _lopsided()
    x = torch.randn(64, 64)
    layers = layer_costs(model, x, repeat=args.repeat)
    times = [c.F + c.time(Kind.B) for c in layers.stages]
    cuts = {"uniform": [3, 3], "balanced": balance(times, 2)}
    rows: dict[str, list[float]] = {k: [] for k in cuts}
    for rep in range(args.rounds):
        for name in list(cuts)[rep % 2 :] + list(cuts)[: rep % 2]:
            costs = profile(split_layers(model, cuts[name]), x, repeat=args.repeat)
            rows[name].append(max(s.F + s.time(Kind.B) for s in costs.stages))
    print("balance: 6 MLP blocks (2 wide, 4 narrow) into 2 stages; slowest stage's F + B")
    base = statistics.median(rows["uniform"])
    for name, cut in cuts.items():
        med = statistics.median(rows[name])
        print(f"  {name:<9} cut {cut!s:<8} slowest stage {1e3 * med:8.3f} ms  ({med / base:.2f}x)")


# -- part 3: a real 2-rank run -----------------------------------------------------------------
def _model(cfg: dict[str, int]) -> tuple[nn.Sequential, torch.Tensor, Any]:
    from zeropipe.apps.models import GPTConfig, gpt
    from zeropipe.apps.models.gpt import lm_loss

    gcfg = GPTConfig(layers=cfg["layers"], width=cfg["width"], seq=cfg["seq"], heads=4, dropout=0.0)
    model = gpt(gcfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, gcfg.vocab, (cfg["batch"], gcfg.seq), generator=gen)
    return model, tokens, lm_loss


def _worker(rank: int, world: int, cfg: dict[str, int]) -> dict[str, Any]:
    import torch.distributed as dist

    from zeropipe.runtime.pipeline import Pipeline

    model, tokens, loss_fn = _model(cfg)
    m = cfg["microbatches"]
    micro = tokens[: len(tokens) // m]
    # Both ranks profile at once, as they will run: two processes on the machine.
    layers = layer_costs(model, micro, target=micro, loss_fn=loss_fn, repeat=cfg["repeat"])
    times = [c.F + c.time(Kind.B) for c in layers.stages]

    def costs_for(num_stages: int) -> CostModel | None:
        if num_stages > len(times):
            return None
        return stage_costs(layers, balance(times, num_stages))

    schedules: dict[str, Schedule] = {}
    for name, gen in sorted(GENERATORS.items()):
        if name == "auto":
            continue
        try:
            schedules[name] = gen.build(world, m, gen.default_chunks)
        except Exception:
            continue
    result = search(costs_for, world, m, None)
    schedules["auto"] = result.schedule
    # Rank 0's figures decide (the ranks' profiles differ a little): one schedule for all.
    # Schedules travel as text: a pickled Action keeps the hash of the process that made it.
    box: list[Any] = [{k: s.to_text() for k, s in schedules.items()}, layers, result.explanation]
    dist.broadcast_object_list(box, src=0)
    schedules = {k: Schedule.from_text(text) for k, text in box[0].items()}
    layers, explanation = box[1], box[2]
    times = [c.F + c.time(Kind.B) for c in layers.stages]
    pipes: dict[str, Pipeline] = {}
    predicted: dict[str, float] = {}
    for name, sched in schedules.items():
        cut = balance(times, sched.num_stages)
        pipes[name] = Pipeline(split_layers(model, cut), sched, microbatches=m, loss_fn=loss_fn)
        predicted[name] = simulate(sched, stage_costs(layers, cut)).makespan
    # The same work in one process (rank 1 idles meanwhile): the sequential baseline of
    # pipeline efficiency, and a check that the two ranks really ran side by side.
    sequential: list[float] = []
    if rank == 0:
        local = Pipeline(
            split_layers(model, balance(times, world)),
            schedules["1f1b"],
            loss_fn=loss_fn,
            microbatches=m,
            mesh="local",
        )
        for rep in range(cfg["warmup"] + cfg["steps"]):
            t0 = time.perf_counter()
            local.step(tokens, tokens)
            if rep >= cfg["warmup"]:
                sequential.append(time.perf_counter() - t0)
    dist.barrier()
    measured: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for rep in range(cfg["warmup"] + cfg["steps"]):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            pipes[name].step(tokens, tokens)  # ends when every rank has ended it
            elapsed = time.perf_counter() - t0
            if rep >= cfg["warmup"]:
                measured[name].append(elapsed)
    return {
        "sequential": statistics.median(sequential) if sequential else 0.0,
        "measured": {k: statistics.median(v) for k, v in measured.items()},
        "predicted": predicted,
        "explanation": explanation,
        "latency": layers.latency,
        "bandwidth": layers.bandwidth,
        "post": layers.post,
        "overhead": layers.overhead,
        "chunks": {k: s.num_stages // world for k, s in schedules.items()},
        "same_as_auto": next(
            (
                k
                for k, s in schedules.items()
                if k != "auto" and s.actions == schedules["auto"].actions
            ),
            None,
        ),
    }


def part_runtime(args: argparse.Namespace) -> None:
    from zeropipe.runtime.launch import launch

    cfg = {
        "layers": args.blocks,
        "width": args.width,
        "seq": args.seq,
        "batch": args.batch,
        "microbatches": args.microbatches,
        "repeat": args.repeat,
        "steps": args.steps,
        "warmup": 2,
    }
    load = os.getloadavg()[0]  # before the ranks start: other work on the machine
    out = launch(_worker, 2, cfg, timeout=args.timeout, threads=args.threads)[0]
    print(
        f"runtime: GPT {args.blocks} blocks, width {args.width}, seq {args.seq}, batch "
        f"{args.batch} in {args.microbatches} microbatches; 2 ranks over gloo, "
        f"{args.threads} thread(s) each; wire latency {out['latency'] * 1e6:.0f} us, "
        f"bandwidth {out['bandwidth'] / 1e6:.0f} MB/s, post {out['post'] * 1e6:.0f} us, runtime "
        f"overhead {out['overhead'] * 1e6:.0f} us per action"
    )
    print(f"  {out['explanation']}")
    seq = out["sequential"]
    print(
        f"  sequential (one process, same work): {1e3 * seq:.1f} ms; load average before the "
        f"run {load:.1f} on {os.cpu_count()} cores"
    )
    if load > (os.cpu_count() or 1):  # (a lagging one-minute average: only a clear excess)
        print(
            "  WARNING: the machine was busy; the two ranks did not have a core each, so "
            "measured step times (and their ratio to the prediction) are not meaningful"
        )
    named = {k: v for k, v in out["measured"].items() if k != "auto"}
    best = min(named, key=named.__getitem__)
    print(
        f"  {'schedule':<17} {'v':>2} {'measured ms':>11} {'predicted ms':>12} {'pred/meas':>9} "
        f"{'efficiency':>10}"
    )
    for name in sorted(out["measured"], key=out["measured"].__getitem__):
        meas, pred = out["measured"][name], out["predicted"][name]
        print(
            f"  {name:<17} {out['chunks'][name]:>2} {1e3 * meas:>11.1f} {1e3 * pred:>12.1f} "
            f"{pred / meas:>9.3f} {seq / (2 * meas):>10.3f}"
        )
    auto = out["measured"]["auto"]
    print(f"  auto / best named ({best}): {auto / named[best]:.3f}")
    twin = out["same_as_auto"]
    if twin is not None:
        print(
            f"  auto's schedule is {twin}'s, action for action: their two rows measure the "
            f"same work, so auto / {twin} = {auto / out['measured'][twin]:.3f} is run-to-run noise"
        )


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("search", "balance", "runtime", "all"), default="all")
    p.add_argument("--big-only", action="store_true", help="search: only p=32, m=96")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7, help="profile repetitions (median)")
    p.add_argument("--rounds", type=int, default=3, help="balance: interleaved rounds")
    p.add_argument("--blocks", type=int, default=6, help="runtime: GPT blocks")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="runtime: timed steps per schedule")
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args()


def main() -> None:
    args = _parse()
    parts = ("search", "balance", "runtime") if args.part == "all" else (args.part,)
    for part in parts:
        {"search": part_search, "balance": part_balance, "runtime": part_runtime}[part](args)
        print()


if __name__ == "__main__":
    main()
