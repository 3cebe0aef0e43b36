"""What the command line's subcommands share: argument types (argparse ``type=`` callables),
flags derived from a dataclass's fields, and :func:`refuse_too_big`, which refuses up front a
schedule size that would run for hours.

A settings dataclass is its command line's one source: a field whose metadata is
:func:`flag`'s becomes ``--field-name``, of the field's type, with the field's default and
the help (and ``--help`` section) the metadata gives::

    @dataclass
    class Settings:
        steps: int = field(default=300, metadata=flag("training steps (default {default})",
                                                      group="optimisation"))
        planned: str | None = None  # no metadata: not a flag

    add_dataclass_arguments(parser, Settings)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

from zeropipe.core.errors import ZeropipeError

__all__ = [
    "ACTIONS_PER_SECOND",
    "ACTION_BYTES",
    "SCHEDULE_LIMIT",
    "add_dataclass_arguments",
    "flag",
    "flag_fields",
    "flag_name",
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


# -- flags from a dataclass's fields ---------------------------------------------------


def flag(help: str, *, group: str, metavar: str | None = None) -> dict[str, str]:
    """The metadata that makes a dataclass field a flag (see the module's docstring).

    ``help`` may name the field's default as ``{default}`` (or ``{default:g}``): the text
    and the value then cannot drift apart.  ``group`` titles the section of ``--help`` the
    flag is listed in; ``metavar`` names its value there (default: the name in capitals).
    """
    meta = {"help": help, "group": group}
    if metavar is not None:
        meta["metavar"] = metavar
    return meta


def flag_name(field_name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + field_name.replace("_", "-")


def flag_fields(config_type: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``config_type`` that are flags (their metadata is :func:`flag`'s)."""
    return [f for f in dataclasses.fields(config_type) if "help" in f.metadata]


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_type: type) -> None:
    """A flag for each of :func:`flag_fields`, in field order, each in its group's section."""
    hints = typing.get_type_hints(config_type)
    groups: dict[str, Any] = {}
    for f in flag_fields(config_type):
        title = f.metadata["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        groups[title].add_argument(flag_name(f.name), **_argument(f, hints[f.name]))


def _argument(f: dataclasses.Field[Any], annotation: Any) -> dict[str, Any]:
    """``add_argument``'s keywords for field ``f``: a bool is a switch; int, float and str
    (each maybe ``| None``) take a value of that type."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = (
        [t for t in typing.get_args(annotation) if t is not type(None)] if union else [annotation]
    )
    if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
        raise TypeError(f"{f.name}: a flag is a bool, int, float or str, not {annotation}")
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{f.name}: a flag's field needs a default")
    kind = kinds[0]
    kwargs: dict[str, Any] = {
        "default": f.default,
        "help": f.metadata["help"].format(default=f.default),
    }
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    if kind is not str:
        kwargs["type"] = kind
    if "metavar" in f.metadata:
        kwargs["metavar"] = f.metadata["metavar"]
    return kwargs
