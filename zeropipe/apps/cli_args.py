"""What the command line's subcommands share: argument types (argparse ``type=`` callables)
and :func:`refuse_too_big`, which refuses up front a schedule size that would run for hours."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from zeropipe.core.errors import ZeropipeError

__all__ = [
    "ACTIONS_PER_SECOND",
    "ACTION_BYTES",
    "SCHEDULE_LIMIT",
    "int_at_least",
    "positive_float",
    "refuse_too_big",
    "share",
]

# What one action of a named schedule costs to generate, validate, simulate and draw:
# `zeropipe simulate --schedule zbv --ranks 128 --microbatches 1024` (786,432 actions)
# took 11.7 s and peaked at 574 MB on a 2-core VM, 2026-11-28.
ACTION_BYTES = 730
ACTIONS_PER_SECOND = 60_000.0
#: the largest schedule built without --force: about half a minute
SCHEDULE_LIMIT = 2_000_000


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer no smaller than ``low``; anything else is a usage error naming it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def share(text: str) -> float:
    """A share of something, in (0, 1]: a number above 1 is not a share, and is a usage
    error here rather than a refusal of every configuration later."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("hours", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.0f} s"


def _size(nbytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9)):
        if nbytes >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes / 1e6:,.0f} MB"


def refuse_too_big(
    actions: float,
    limit: float,
    *,
    rate: float,
    what: str,
    fix: str,
    action_bytes: float = ACTION_BYTES,
) -> None:
    """Refuse work of about ``actions`` actions over ``limit`` (those at ``rate`` a second,
    holding ``action_bytes`` each): one line saying how big ``what`` is, how long and how
    much memory it would take, and ``fix``; ``--force`` (the caller's flag, which skips
    this) runs it anyway."""
    if actions <= limit:
        return
    raise ZeropipeError(
        f"{what} is about {actions:.2g} actions, which would take ~{_duration(actions / rate)} "
        f"and ~{_size(actions * action_bytes)} of memory (at about {rate:,.0f} actions a "
        f"second); up to {limit:,.0f} actions (~{_duration(limit / rate)}) run without "
        f"--force: {fix}, or add --force to run it anyway"
    )
