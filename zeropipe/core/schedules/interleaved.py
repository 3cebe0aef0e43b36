"""Interleaved 1F1B (Megatron-LM) and its zero-bubble form (torch's ScheduleInterleavedZeroBubble).

Looped placement: with ``p`` ranks and ``v`` chunks per rank, stage ``s`` lives
on rank ``s % p``, so a microbatch visits every rank ``v`` times.  Each rank
walks one *table* of ``(microbatch, chunk)`` pairs: microbatches are taken in
groups, and a group goes through chunk 0, then chunk 1, ... before the next
group starts (depth first within the group).  Forwards follow the table;
backwards follow it too, with the chunks reversed.  p=2, v=2, m=4::

    table (groups of 2):   (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)
    rank 0 forwards:        0F0   0F1   2F0   2F1   0F2   0F3   2F2   2F3
    rank 0 backwards:       2B0   2B1   0B0   0B1   2B2   2B3   0B2   0B3

A rank first runs ``warmup`` forwards, then alternates one forward and one
backward, then drains the backwards:

    interleaved-1f1b   warmup = 2(p-1-r) + (v-1) G
    interleaved-zb     warmup =  (p-1-r) + (v-1) G    backward split into I and W;
                       rank r keeps its first r W back, then runs one W after each I

``G`` is the size of the first group.  With one chunk, interleaved-1f1b is
plain 1F1B (warmup ``p-1-r``), as in Megatron, which hands ``v = 1`` to its
non-interleaved schedule; torch's ScheduleInterleaved1F1B keeps ``2(p-1-r)``.

Group sizes: Megatron (default group size ``p``) refuses ``m`` that ``p`` does
not divide: with a last group smaller than ``p``, a rank's next backward can
depend on a forward queued behind it on another rank (p=4, m=5, v=3 in strict
per-rank order deadlocks).  torch takes ``max(1, m // p)`` equal groups and
refuses ``m`` they do not divide.  Both generators here take ``max(1, m // p)``
groups whose sizes differ by at most one, larger first: that is exactly
Megatron's and torch's order wherever they accept ``m``, and every group keeps
``>= p`` microbatches (or all of them when ``m < p``), so any ``m >= 1`` works.
"""

from __future__ import annotations

from collections import deque

from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.schedules.registry import register

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W


def _even_groups(ranks: int, microbatches: int) -> list[int]:
    """``max(1, m // p)`` groups whose sizes differ by at most one, larger first."""
    rounds = max(1, microbatches // ranks)
    size, extra = divmod(microbatches, rounds)
    return [size + 1] * extra + [size] * (rounds - extra)


def _table(groups: list[int], chunks: int) -> list[tuple[int, int]]:
    """The ``(microbatch, chunk)`` order: each group through every chunk in turn."""
    out: list[tuple[int, int]] = []
    start = 0
    for size in groups:
        for c in range(chunks):
            out.extend((mb, c) for mb in range(start, start + size))
        start += size
    return out


def _rank_order(
    rank: int,
    ranks: int,
    chunks: int,
    table: list[tuple[int, int]],
    warmup: int,
    split: bool,
    w_delay: int,
) -> list[Action]:
    """Warm-up forwards, then forward/backward pairs, then the last backwards.

    With ``split``, each I queues its W; the first ``w_delay`` W wait for the end.
    """
    fwd = [Action(F, c * ranks + rank, mb) for mb, c in table]
    bwd = [Action(I if split else B, (chunks - 1 - c) * ranks + rank, mb) for mb, c in table]
    warmup = min(warmup, len(fwd))
    acts = fwd[:warmup]
    pending: deque[Action] = deque()
    for k, back in enumerate(bwd):
        if warmup + k < len(fwd):
            acts.append(fwd[warmup + k])
        acts.append(back)
        if split:
            pending.append(Action(W, back.stage, back.microbatch))
            if k >= w_delay:
                acts.append(pending.popleft())
    acts.extend(pending)
    return acts


@register(
    "interleaved-1f1b",
    "Megatron interleaved 1F1B: v looped chunks per rank, depth first over groups of >= p",
    default_chunks=2,
    takes_chunks=True,
)
def interleaved_1f1b(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    groups = _even_groups(ranks, microbatches)
    table = _table(groups, chunks)
    acts = []
    for r in range(ranks):
        # With one chunk Megatron runs plain 1F1B (see the module docstring).
        hops = ranks - 1 - r if chunks == 1 else 2 * (ranks - 1 - r)
        warmup = hops + (chunks - 1) * groups[0]
        acts.append(_rank_order(r, ranks, chunks, table, warmup, split=False, w_delay=0))
    placement = tuple(s % ranks for s in range(ranks * chunks))
    return Schedule(placement, acts, microbatches, "interleaved-1f1b")


@register(
    "interleaved-zb",
    "interleaved zero bubble (torch ScheduleInterleavedZeroBubble): looped placement, I/W split",
    default_chunks=2,
    takes_chunks=True,
)
def interleaved_zb(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    groups = _even_groups(ranks, microbatches)
    table = _table(groups, chunks)
    acts = []
    for r in range(ranks):
        warmup = (ranks - 1 - r) + (chunks - 1) * groups[0]
        acts.append(_rank_order(r, ranks, chunks, table, warmup, split=True, w_delay=r))
    placement = tuple(s % ranks for s in range(ranks * chunks))
    return Schedule(placement, acts, microbatches, "interleaved-zb")
