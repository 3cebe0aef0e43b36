"""What the command line's subcommands share: argument types (argparse ``type=`` callables),
and :func:`refuse_renamed`, which keeps a renamed flag failing with its new name."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["int_at_least", "positive_float", "refuse_renamed", "share"]


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


class _Renamed(argparse.Action):
    """A flag that was renamed: using it is a usage error that names its new name."""

    def __init__(self, option_strings: Sequence[str], dest: str, message: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.message = message

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        # No argument name: the message already starts with the flag.
        raise argparse.ArgumentError(None, self.message)


def refuse_renamed(parser: argparse.ArgumentParser, old: str, new: str, why: str) -> None:
    """Make ``old`` (hidden from --help) fail as "OLD is now NEW: WHY", instead of it being
    taken for another flag or silently meaning something else."""
    parser.add_argument(
        old,
        action=_Renamed,
        dest=f"renamed_{old.strip('-')}",
        default=argparse.SUPPRESS,  # nothing in the parsed namespace
        message=f"{old} is now {new}: {why}",
    )
