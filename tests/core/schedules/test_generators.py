"""Every registered generator over a (ranks, microbatches, chunks) grid, plus golden text.

The grid: ranks 1..8, microbatches 1..4p, and for generators that take chunks
also chunks 1..4.  Each combination either validates or is refused with
``ScheduleError(rule="unsupported")`` whose message names the bound; the
refusals are listed in ``_REFUSED`` and nothing else may be refused.  At the
default chunk count every microbatch count is tried; at the others the counts
around the places where a generator changes shape (1, 2, p-1..p+1, 2p-1..2p+1,
3p+1, 4p), which keeps the whole grid within a few seconds.

The golden schedules were checked step by step against the published rules
(see each generator's module docstring) and, where torch has the schedule,
against torch.distributed.pipelining's order for the same sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.validate import validate

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
NAMES = sorted(n for n in GENERATORS if n != "auto")  # auto is searched: test_auto.py
V_SHAPED = {"zbv", "dualpipev"}
# Placed as a V: the V-shaped ones and dualpipe, whose second direction's stages come back.
V_PLACED = V_SHAPED | {"dualpipe"}

# Generator -> (is (ranks, microbatches) refused?, text the refusal must contain).
_REFUSED: dict[str, Callable[[int, int], str | None]] = {
    "dualpipev": lambda p, m: (
        f"microbatches >= 2 x ranks - 1 = {2 * p - 1}" if m < 2 * p - 1 else None
    ),
    "dualpipe": lambda p, m: (
        "an even number of ranks"
        if p % 2
        else "an even number of microbatches"
        if m % 2 or m < max(2 * p - 2, 2)
        else None
    ),
}

# Which action kinds each generator uses: a split backward (I + W), full ones (B), or both.
_KINDS = {
    "gpipe": {F, B},
    "1f1b": {F, B},
    "interleaved-1f1b": {F, B},
    "looped-bfs": {F, B},
    "zb-h1": {F, I, W},
    "zb-h2": {F, I, W},
    "zbv": {F, I, W},
    "interleaved-zb": {F, I, W},
    "dualpipev": {F, B, I, W},
    "dualpipe": {F, B, I, W},
}


def _microbatch_counts(ranks: int, full: bool) -> list[int]:
    top = 4 * ranks
    if full:
        return list(range(1, top + 1))
    p = ranks
    edges = {1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1, top}
    return sorted(m for m in edges if 1 <= m <= top)


def _expected_placement(name: str, ranks: int, chunks: int) -> tuple[int, ...]:
    if name in V_PLACED:
        return tuple(range(ranks)) + tuple(reversed(range(ranks)))
    return tuple(s % ranks for s in range(ranks * chunks))


def test_every_generator_is_covered_here() -> None:
    assert set(_KINDS) | {"auto"} == set(GENERATORS)


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize("name", NAMES)
def test_generator_grid_validates_or_refuses_with_reason(name: str, ranks: int) -> None:
    gen = GENERATORS[name]
    chunk_counts = range(1, 5) if gen.takes_chunks else [gen.default_chunks]
    refused = _REFUSED.get(name, lambda p, m: None)
    for chunks in chunk_counts:
        supported = []
        for m in _microbatch_counts(ranks, full=chunks == gen.default_chunks):
            reason = refused(ranks, m)
            if reason is not None:
                with pytest.raises(ScheduleError) as err:
                    generate(name, ranks, m, chunks)
                assert err.value.rule == "unsupported"
                assert reason in str(err.value), str(err.value)
                continue
            s = generate(name, ranks, m, chunks)
            where = f"{name} p={ranks} m={m} v={chunks}"
            assert s.name == name, where
            assert s.microbatches == m, where
            assert s.num_ranks == ranks, where
            assert s.placement == _expected_placement(name, ranks, chunks), where
            assert not s.is_lowered, where
            assert {a.kind for acts in s.actions for a in acts} == _KINDS[name], where
            validate(s)
            supported.append(m)
        odd_ranks_refused = name == "dualpipe" and ranks % 2 == 1
        assert supported or odd_ranks_refused, f"{name} runs no microbatch count at p={ranks}"


@pytest.mark.parametrize("name", NAMES)
def test_lowered_schedules_validate(name: str) -> None:
    for ranks in (1, 2, 3, 5):
        for m in (2 * ranks - 1, 2 * ranks + 1, 3 * ranks, 4 * ranks):
            if _REFUSED.get(name, lambda p, m: None)(ranks, m) is not None:
                continue
            s = lower(generate(name, ranks, m))
            assert s.is_lowered == (ranks > 1)
            validate(s)


@pytest.mark.parametrize("name", sorted(V_SHAPED))
def test_v_schedules_refuse_other_chunk_counts(name: str) -> None:
    with pytest.raises(ScheduleError) as err:
        generate(name, 4, 8, 3)
    assert err.value.rule == "unsupported"
    assert "2 chunk(s) per rank" in str(err.value)


def test_dualpipev_refusal_points_to_the_bound_and_an_alternative() -> None:
    generate("dualpipev", 4, 7)  # 2p - 1 is the smallest count it runs
    with pytest.raises(ScheduleError) as err:
        generate("dualpipev", 4, 6)
    message = str(err.value)
    assert "microbatches >= 2 x ranks - 1 = 7" in message
    assert "got 6" in message
    assert "zbv" in message


# -- golden schedules -------------------------------------------------------------
#
# Read them as: rank r runs its list left to right.  Hand checks:
#
# 1f1b p=2: rank 0 warms up with p-1-r = 1 forward, then one F per B.
# zb-h1 p=2: rank r runs F(x) I(x-(p-1-r)) W(x-(p-1)) per slot x, so rank 1
#   (the last) delays each W by one slot and rank 0 idles one unit, not three.
# zb-h2 p=2: lags doubled: rank 0 warms up with 2p-1 = 3 forwards.
# zbv p=2: rank 0 owns stages 0 and 3: 2p-1 = 3 F of chunk 0, then (p-r) = 2
#   x [F I W] of chunk 1, then alternating F I W of chunks 0 and 1, then drain.
# interleaved-1f1b p=2 v=2 m=4: groups of 2; rank 0 warms up with
#   2(p-1) + (v-1)p = 4 forwards; backwards walk the table chunk-reversed.
# interleaved-zb: the same table, warm-up (p-1-r) + (v-1)p, W after each I
#   except the first r.
# looped-bfs: every microbatch through chunk 0, then chunk 1; backwards reversed.
# dualpipev p=2 m=4: rank 0: 2 x F0, F0 F3, I3 W3 F3, [F0 B3] [F3 B0], B3 [F3 B0],
#   B3 I0 (split from the middle pair on), W I0, W.

GOLDEN = {
    ("1f1b", 2, 4, 1): """
rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
""",
    ("zb-h1", 2, 4, 1): """
rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3
rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3
""",
    ("zb-h2", 2, 4, 1): """
rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
rank 1: 1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3
""",
    ("zbv", 2, 4, 2): """
rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
""",
    ("interleaved-1f1b", 2, 4, 2): """
rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
""",
    ("interleaved-zb", 2, 4, 2): """
rank 0: 0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3
rank 1: 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3
""",
    ("looped-bfs", 2, 2, 2): """
rank 0: 0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0
rank 1: 1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0
""",
    ("dualpipev", 2, 4, 2): """
rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3
rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0) (1F3;2B1) (2F3;1B1) 2B2 1B2 2I3 1I3 2W3 1W3
""",
}


@pytest.mark.parametrize("key", sorted(GOLDEN), ids=lambda k: f"{k[0]}-p{k[1]}-m{k[2]}-v{k[3]}")
def test_golden_schedule(key: tuple[str, int, int, int]) -> None:
    name, ranks, m, chunks = key
    s = generate(name, ranks, m, chunks)
    body = "\n".join(s.to_text().splitlines()[4:])
    assert body == GOLDEN[key].strip()
    assert s.placement == _expected_placement(name, ranks, chunks)
    assert Schedule.from_text(s.to_text()) == s


def test_golden_dualpipev_pairs_overlapped_steps_forward_first() -> None:
    # Step 4 of rank 0 at p=2, m=4: [F(a) B(b)] [F(b) B(a)], each pair adjacent.
    acts = [str(a) for a in generate("dualpipev", 2, 4).actions[0]]
    at = acts.index("0F3")
    assert acts[at : at + 4] == ["0F3", "3B1", "3F2", "0B0"]
    # ... and recorded as overlapped pairs; the last rank's first [F(a) B(b)] is not one.
    s = generate("dualpipev", 2, 4)
    assert s.overlapped(0) == frozenset({at, at + 2, at + 5})
    assert s.actions[1][4:6] == (Action.parse("1F2"), Action.parse("2B0"))
    assert 4 not in s.overlapped(1)
