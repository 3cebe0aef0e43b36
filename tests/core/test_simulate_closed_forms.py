"""Simulated makespan, bubbles and peak memory against the literature's closed forms.

All cases: comm = 0, per-stage times F, I, W with B = I + W, the default
memory model (act = 1 per rank's worth of layers, act_w = 0), and exact
equality up to 1e-9.

Conditions, and why the grids below respect them:

* GPipe, 1F1B: none; every m >= 1.
* ZB-H1 and ZB-H2 (Qi et al. 2024, section 2) assume W is the cheapest pass:
  ``W <= F`` and ``W <= I``.  With W > I a rank finishes its W before the I it
  waits for arrives, and the bubble is larger than the formula (tested below).
  ZB-H1 needs m >= p to reach its steady state, ZB-H2 m >= 2p - 1.
* ZB-H2's figure is the *parallelogram*: its bubble is counted inside each
  rank's own span (first start to last end), the way consecutive iterations
  overlap when the optimizer step does not synchronise the ranks.  Rank r
  idles (p-1-r)(F+I-2W) inside its span.  Over the whole makespan every rank
  also waits for the others to start or finish; that is
  (p-1) max(F, F+I-2W): rank p-1 cannot start before (p-1)F, and rank 0's
  own gaps add up to (p-1)(F+I-2W).  (This second form is our derivation.)
* Interleaved 1F1B (Narayanan et al. 2021): bubble (p-1)(F+B)/v for m >= p;
  first-stage memory p(1 + (p-1)/(pv)) microbatches (Korthikanti et al. 2022)
  once the warm-up fits, m a multiple of p and >= 2p.
* ZB-V (Qi et al. 2024, section 6): no bubble inside any rank's span when
  F = I = W, and 1F1B's peak (p) on every rank, for m >= 2p - 1.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from zeropipe.core.costs import CostModel
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import Timeline, simulate

# (F, I, W); each has W <= F and W <= I.
COSTS = [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (1.5, 1.2, 0.7), (3.0, 1.0, 1.0)]
EPS = 1e-9


def _counts(p: int, least: int) -> list[int]:
    return sorted({m for m in (1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2) if m >= least})


def _run(name: str, p: int, m: int, cost: tuple[float, float, float], chunks: int = 1) -> Timeline:
    F, I, W = cost
    s = generate(name, p, m, chunks)
    return simulate(s, CostModel.uniform(s.num_stages, chunks=chunks, F=F, I=I, W=W))


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_makespan_and_bubble(name: str, cost: tuple[float, float, float]) -> None:
    F, I, W = cost
    for p in range(1, 7):
        for m in _counts(p, 1):
            t = _run(name, p, m, cost)
            assert t.makespan == pytest.approx((m + p - 1) * (F + I + W), abs=EPS), (p, m)
            for r in range(p):
                assert t.makespan - t.busy(r) == pytest.approx((p - 1) * (F + I + W), abs=EPS)


@pytest.mark.parametrize("cost", COSTS)
def test_zb_h1_bubble_per_rank(cost: tuple[float, float, float]) -> None:
    F, I, W = cost
    for p in range(1, 7):
        for m in _counts(p, p):
            t = _run("zb-h1", p, m, cost)
            for r in range(p):
                bubble = t.makespan - t.busy(r)
                assert bubble == pytest.approx((p - 1) * (F + I - W), abs=EPS), (p, m, r)


@pytest.mark.parametrize("cost", COSTS)
def test_zb_h2_bubble_inside_each_span_and_over_the_makespan(
    cost: tuple[float, float, float],
) -> None:
    F, I, W = cost
    for p in range(1, 7):
        for m in _counts(p, 2 * p - 1):
            t = _run("zb-h2", p, m, cost)
            for r in range(p):
                inside = t.span(r) - t.busy(r)
                assert inside == pytest.approx((p - 1 - r) * (F + I - 2 * W), abs=EPS), (p, m, r)
                overall = t.makespan - t.busy(r)
                assert overall == pytest.approx((p - 1) * max(F, F + I - 2 * W), abs=EPS)


def test_zb_closed_forms_need_w_no_larger_than_i() -> None:
    F, I, W = 1.0, 0.5, 1.0  # W > I: outside the formulas' domain
    p, m = 4, 8
    t = _run("zb-h1", p, m, (F, I, W))
    assert t.makespan - t.busy(0) > (p - 1) * (F + I - W) + 0.1
    t = _run("zb-h2", p, m, (F, I, W))
    assert t.span(0) - t.busy(0) > (p - 1) * (F + I - 2 * W) + 0.1


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("gpipe", lambda p, m, r: m),
        ("1f1b", lambda p, m, r: p - r),
        ("zb-h1", lambda p, m, r: p - r),
        ("zb-h2", lambda p, m, r: 2 * (p - r) - 1),
    ],
)
def test_peak_activations(name: str, peak: Callable[[int, int, int], int]) -> None:
    for p in range(1, 7):
        for m in _counts(p, 2 * p - 1):
            t = _run(name, p, m, (1.0, 1.0, 1.0))
            assert t.peak_memory == pytest.approx([peak(p, m, r) for r in range(p)]), (p, m)
    # The headline figures, rank 0 at p = 4, m = 8.
    expected = {"gpipe": 8, "1f1b": 4, "zb-h1": 4, "zb-h2": 7}[name]
    assert _run(name, 4, 8, (1.0, 1.0, 1.0)).peak_memory[0] == expected


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_1f1b_bubble_and_first_stage_memory(
    chunks: int, cost: tuple[float, float, float]
) -> None:
    F, I, W = cost
    v = chunks
    for p in range(1, 6):
        for m in _counts(p, p):
            t = _run("interleaved-1f1b", p, m, cost, chunks)
            for r in range(p):
                bubble = t.makespan - t.busy(r)
                assert bubble == pytest.approx((p - 1) * (F + I + W) / v, abs=EPS), (p, m, r)
        for m in (2 * p, 3 * p):
            t = _run("interleaved-1f1b", p, m, cost, chunks)
            assert t.peak_memory[0] == pytest.approx(p * (1 + (p - 1) / (p * v)), abs=EPS)


def test_zbv_has_no_bubble_inside_its_spans_and_1f1b_memory() -> None:
    for p in range(1, 7):
        for m in _counts(p, 2 * p - 1):
            t = _run("zbv", p, m, (1.0, 1.0, 1.0), chunks=2)
            for r in range(p):
                assert t.span(r) - t.busy(r) == pytest.approx(0.0, abs=EPS), (p, m, r)
            assert t.peak_memory == pytest.approx([float(p)] * p), (p, m)
