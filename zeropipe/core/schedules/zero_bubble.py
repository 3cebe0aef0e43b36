"""ZB-H1 and ZB-H2: the handcrafted zero-bubble schedules of Qi et al. (ICLR 2024).

Both split the backward into I (input gradient, on the critical path) and W
(weight gradient, deferrable).  In the steady state rank ``r`` of ``p`` runs
triples ``F(x) I(x - a_r) W(x - c)``: the I lags the forward by ``a_r``
microbatches, the W by the same ``c`` on every rank.  Warm-up and cool-down
are the same triples with the out-of-range entries left out, which is why
the formula holds for every microbatch count ``m``, not only ``m >= p``.

    ZB-H1   a_r = p-1-r      c = p-1     peak as 1F1B: p microbatches on rank 0
    ZB-H2   a_r = 2(p-1-r)   c = 2(p-1)  peak 2p-1 on rank 0; idle (p-1-r)(F+I-2W)
                                         inside rank r's span, none at F = I = W

ZB-H1, p=4, unit costs.  Rank r holds back its first r W: run early they
would delay the I that the ranks before it are waiting for; run at the end
they fill the time in which those ranks drain::

    r0: F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 ...
    r3:          F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 ...

Delaying W is what moves the first backward earlier: an I is done one I-time
after its successor's, not one full backward later.
"""

from __future__ import annotations

from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.schedules.registry import register

F, I, W = Kind.F, Kind.I, Kind.W


def _lagged(ranks: int, microbatches: int, lag_i: list[int], lag_w: int) -> list[list[Action]]:
    """Per rank: for slot x, F(x), I(x - lag_i[r]), W(x - lag_w), each if in range."""
    m = microbatches
    out = []
    for r in range(ranks):
        acts: list[Action] = []
        for x in range(m + lag_w):
            if x < m:
                acts.append(Action(F, r, x))
            if 0 <= x - lag_i[r] < m:
                acts.append(Action(I, r, x - lag_i[r]))
            if 0 <= x - lag_w < m:
                acts.append(Action(W, r, x - lag_w))
        out.append(acts)
    return out


@register("zb-h1", "zero bubble H1: 1F1B with I/W split and W delayed; 1F1B's peak memory")
def zb_h1(ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    lag_i = [ranks - 1 - r for r in range(ranks)]
    acts = _lagged(ranks, microbatches, lag_i, ranks - 1)
    return Schedule(tuple(range(ranks)), acts, microbatches, "zb-h1")


@register(
    "zb-h2", "zero bubble H2: more warm-up forwards, bubble-free at F=I=W; peak 2p-1 microbatches"
)
def zb_h2(ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    lag_i = [2 * (ranks - 1 - r) for r in range(ranks)]
    acts = _lagged(ranks, microbatches, lag_i, 2 * (ranks - 1))
    return Schedule(tuple(range(ranks)), acts, microbatches, "zb-h2")
