"""Hypothesis strategies shared by the schedule tests: random *valid* schedules."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.ir import Action, Kind, Schedule


@st.composite
def valid_schedules(draw: st.DrawFn, max_ranks: int = 4, max_mb: int = 5) -> Schedule:
    """A random valid compute-only schedule.

    Built by a random topological walk: placement is random, each
    (stage, microbatch) chooses B or I+W and optional R / OFFLOAD+RELOAD, and
    ranks take turns emitting any action whose dependencies have been emitted.
    A random walk that respects dependencies can never deadlock.
    """
    ranks = draw(st.integers(1, max_ranks))
    stages = draw(st.integers(ranks, 2 * ranks))
    placement = list(range(ranks)) + [
        draw(st.integers(0, ranks - 1)) for _ in range(stages - ranks)
    ]
    placement = draw(st.permutations(placement))
    m = draw(st.integers(1, max_mb))
    todo: dict[tuple[int, int], list[Kind]] = {}
    for s in range(stages):
        for i in range(m):
            seq = [Kind.F]
            if draw(st.booleans()):
                seq += [Kind.OFFLOAD, Kind.RELOAD]
            if draw(st.booleans()):
                seq += [Kind.R]
            seq += [Kind.I, Kind.W] if draw(st.booleans()) else [Kind.B]
            todo[(s, i)] = seq
    done: set[tuple[int, int, Kind]] = set()
    out: list[list[Action]] = [[] for _ in range(ranks)]

    def ready(s: int, i: int) -> bool:
        kind = todo[(s, i)][0]
        if kind is Kind.F:
            return s == 0 or (s - 1, i, Kind.F) in done
        if kind in (Kind.B, Kind.I):
            if s == stages - 1:
                return True
            return (s + 1, i, Kind.B) in done or (s + 1, i, Kind.I) in done
        return True

    while todo:
        choices = sorted(k for k in todo if ready(*k))
        s, i = draw(st.sampled_from(choices))
        kind = todo[(s, i)].pop(0)
        if not todo[(s, i)]:
            del todo[(s, i)]
        done.add((s, i, kind))
        out[placement[s]].append(Action(kind, s, i))
    return Schedule(tuple(placement), out, m, "random")


def random_costs(stages: int, rng: random.Random) -> CostModel:
    """Uneven stage costs (B priced apart from I + W) and a wire, drawn from ``rng``."""
    return CostModel(
        tuple(
            StageCost(
                F=rng.uniform(0.5, 2),
                I=rng.uniform(0.5, 2),
                W=rng.uniform(0.2, 1.5),
                B=rng.uniform(1, 3),
                act=rng.uniform(0.5, 1.5),
                act_w=rng.uniform(0, 0.5),
                boundary_bytes=rng.uniform(0, 100),
            )
            for _ in range(stages)
        ),
        latency=0.05,
        bandwidth=400.0,
    )
