"""Pinned results of the ``auto`` search: the schedule it picks and its makespan.

The search prunes and shares list-scheduler runs (cut at the best few found so far,
policies that decide alike run once); none of that may change what it picks.  These
were recorded before those shortcuts existed; each row: ranks, microbatches, costs
("default": unit times, "paper": the zero-bubble paper's F=18.5 I=18.1 W=9.3 comm=0.6),
act_w, memory limit, makespan, how the explanation names the winner, and the first 16
hex digits of the sha256 of the schedule's text.  On 2 ranks with room for 3 microbatches
the pick is dualpipe: weights cost nothing here, and its two directions leave no bubble.
"""

from __future__ import annotations

import hashlib

import pytest

from zeropipe.core.costs import CostModel
from zeropipe.core.schedules import generate
from zeropipe.core.schedules.auto import search

Pin = tuple[int, int, str, float, int | str | None, float, str, str]

PINS: list[Pin] = [
    (2, 4, "default", 0.0, "1f1b", 12.5, "the named schedule zbv", "9f29dbab62379c0a"),
    (2, 4, "default", 0.0, 2, 12.5, "the named schedule zbv", "9f29dbab62379c0a"),
    (2, 4, "default", 0.0, 4, 12.0, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "default", 0.0, None, 12.0, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "default", 0.9, "1f1b", 12.5, "the named schedule zbv", "9f29dbab62379c0a"),
    (2, 4, "default", 0.9, 2, 12.5, "the named schedule zbv", "9f29dbab62379c0a"),
    (2, 4, "default", 0.9, 4, 12.0, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "default", 0.9, None, 12.0, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (
        2,
        4,
        "paper",
        0.0,
        2,
        194.45000000000007,
        "zbv's F/I order, W placed anew",
        "2618aa120fd19dd7",
    ),
    (2, 4, "paper", 0.0, 4, 185.4, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "paper", 0.0, None, 185.4, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "paper", 0.9, 2, 194.80000000000007, "the named schedule zbv", "9f29dbab62379c0a"),
    (2, 4, "paper", 0.9, 4, 185.4, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (2, 4, "paper", 0.9, None, 185.4, "the named schedule dualpipe", "f17b98e87d130ae6"),
    (4, 6, "default", 0.0, "1f1b", 19.5, "zbv's F/I order, W placed anew", "15e54ace27eb9fca"),
    (4, 6, "default", 0.0, 4, 19.5, "zbv's F/I order, W placed anew", "15e54ace27eb9fca"),
    (
        4,
        6,
        "default",
        0.0,
        8,
        19.5,
        "interleaved-1f1b v=2's F/I order, W placed anew",
        "a7c8d95c5dc7f1f4",
    ),
    (
        4,
        6,
        "default",
        0.0,
        None,
        19.5,
        "interleaved-1f1b v=2's F/I order, W placed anew",
        "a7c8d95c5dc7f1f4",
    ),
    (4, 6, "default", 0.9, "1f1b", 19.5, "zbv's F/I order, W placed anew", "47be912912c0e314"),
    (4, 6, "default", 0.9, 4, 19.5, "zbv's F/I order, W placed anew", "47be912912c0e314"),
    (
        4,
        6,
        "default",
        0.9,
        8,
        19.5,
        "interleaved-1f1b v=2's F/I order, W placed anew",
        "a7c8d95c5dc7f1f4",
    ),
    (
        4,
        6,
        "default",
        0.9,
        None,
        19.5,
        "interleaved-1f1b v=2's F/I order, W placed anew",
        "a7c8d95c5dc7f1f4",
    ),
    (
        4,
        6,
        "paper",
        0.0,
        4,
        312.14999999999975,
        "zbv's F/I order, W placed anew",
        "67dcab826c65f5f2",
    ),
    (
        4,
        6,
        "paper",
        0.0,
        8,
        304.94999999999993,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "7e5aed0151d14a56",
    ),
    (
        4,
        6,
        "paper",
        0.0,
        None,
        304.94999999999993,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "7e5aed0151d14a56",
    ),
    (
        4,
        6,
        "paper",
        0.9,
        4,
        312.14999999999986,
        "zbv's F/I order, W placed anew",
        "b0aa5cc8146ea60c",
    ),
    (
        4,
        6,
        "paper",
        0.9,
        8,
        304.94999999999993,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "7e5aed0151d14a56",
    ),
    (
        4,
        6,
        "paper",
        0.9,
        None,
        304.94999999999993,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "7e5aed0151d14a56",
    ),
    (4, 8, "default", 0.0, "1f1b", 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.0, 4, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.0, 8, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.0, None, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.9, "1f1b", 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.9, 4, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.9, 8, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (4, 8, "default", 0.9, None, 25.5, "the named schedule zbv", "2c79ea6555f00515"),
    (
        4,
        8,
        "paper",
        0.0,
        4,
        399.7499999999998,
        "zbv's F/I order, W placed anew",
        "f8aadabf6e0463f1",
    ),
    (
        4,
        8,
        "paper",
        0.0,
        8,
        396.74999999999983,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "b1ae8b272a1fc5e9",
    ),
    (
        4,
        8,
        "paper",
        0.0,
        None,
        396.74999999999983,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "b1ae8b272a1fc5e9",
    ),
    (4, 8, "paper", 0.9, 4, 403.60000000000025, "the named schedule zbv", "2c79ea6555f00515"),
    (
        4,
        8,
        "paper",
        0.9,
        8,
        396.74999999999983,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "b1ae8b272a1fc5e9",
    ),
    (
        4,
        8,
        "paper",
        0.9,
        None,
        396.74999999999983,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "b1ae8b272a1fc5e9",
    ),
    (8, 16, "default", 0.0, "1f1b", 51.5, "the named schedule zbv", "7ed916f4604141a2"),
    (
        8,
        16,
        "paper",
        0.0,
        16,
        803.3499999999988,
        "V placement, 2 chunk(s)/rank, I/W split, W into gaps, F first",
        "bbb997e5cdaab8dc",
    ),
    (
        8,
        16,
        "paper",
        0.0,
        8,
        810.6999999999988,
        "zbv's F/I order, W placed anew",
        "09aafa2536ad31ad",
    ),
]


def _costs(name: str, ranks: int, act_w: float) -> CostModel:
    if name == "default":
        return CostModel.uniform(ranks, act_w=act_w)
    return CostModel.uniform(ranks, F=18.5, I=18.1, W=9.3, comm=0.6, act_w=act_w)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("pin", PINS, ids=lambda p: "-".join(map(str, p[:5])))
def test_auto_picks_what_it_picked_before(pin: Pin) -> None:
    ranks, m, costs, act_w, limit, makespan, how, digest = pin
    result = search(_costs(costs, ranks, act_w), ranks, m, limit)
    assert result.timeline.makespan == makespan
    assert result.explanation.split(";")[0] == f"auto: {how}"
    assert _digest(result.schedule.to_text()) == digest


def test_generate_auto_is_the_searched_schedule() -> None:
    # generate("auto") is search() under unit costs within 1F1B's peak.
    pin = next(p for p in PINS if p[:5] == (8, 16, "default", 0.0, "1f1b"))
    assert _digest(generate("auto", 8, 16).to_text()) == pin[7]
